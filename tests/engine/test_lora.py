"""Requests with LoRA adapters in the engine: exact under speculation whatever shares the batch,
at most max_loras adapters a step, prefix-cache blocks kept apart per adapter, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from quickdraft import LLM, LoRARequest, SamplingParams
from quickdraft.models.lora import LoRAError
from quickdraft.sampling_params import InvalidParameterError
from tests.engine.test_speculative import EXACTNESS_CONFIGS, repetitive_prompts, speculative_llm
from tests.models.test_lora import write_peft_adapter

GREEDY = SamplingParams(max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("engine_lora")
    base = tiny_checkpoints["gemma3"]
    return {
        name: LoRARequest(name, int_id, str(write_peft_adapter(base, root / name, seed=int_id)))
        for int_id, name in enumerate(("first", "second"), start=1)
    }


def _target(tiny_checkpoints) -> str:
    return str(tiny_checkpoints["gemma3"])


def _lora_llm(tiny_checkpoints, **kwargs) -> LLM:
    """Q8_0 at load: the one-call C++ layers (where the CPU has them) run the adapters."""
    defaults = dict(quantization="q8_0", enable_lora=True, max_loras=2, max_model_len=256, lazy_logits_rows=0)
    return LLM(_target(tiny_checkpoints), **{**defaults, **kwargs})


def _mixed(adapters) -> tuple[list[list[int]], list[LoRARequest | None]]:
    prompts = repetitive_prompts()
    return prompts, [adapters["first"], None, adapters["second"], adapters["first"]]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain_mixed(tiny_checkpoints, adapters) -> list[list[int]]:
    llm = _lora_llm(tiny_checkpoints)
    prompts, loras = _mixed(adapters)
    together = _tokens(llm.generate(prompts, GREEDY, lora_request=loras))
    alone = [_tokens(llm.generate([p], GREEDY, lora_request=lora))[0] for p, lora in zip(prompts, loras)]
    assert together == alone  # batching changes nothing
    assert together[0] != _tokens(llm.generate([prompts[0]], GREEDY))[0]  # the adapter is applied
    return together


@pytest.mark.parametrize("config", EXACTNESS_CONFIGS, ids=lambda c: f"{c['method']}-{c.get('garbage', False)}")
def test_speculative_output_equals_plain_with_adapters(tiny_checkpoints, adapters, plain_mixed, config):
    llm = speculative_llm(
        _target(tiny_checkpoints),
        config,
        quantization="q8_0",
        enable_lora=True,
        max_loras=2,
        max_model_len=256,
        lazy_logits_rows=0,
    )
    prompts, loras = _mixed(adapters)
    assert _tokens(llm.generate(prompts, GREEDY, lora_request=loras)) == plain_mixed
    assert llm.get_metrics().num_accepted_tokens > 0 or config.get("garbage")


def test_seeded_sampling_with_an_adapter_is_the_same_with_speculation(tiny_checkpoints, adapters):
    params = [SamplingParams(max_tokens=20, temperature=0.9, seed=s) for s in range(4)]
    prompts, loras = _mixed(adapters)
    plain = _tokens(_lora_llm(tiny_checkpoints).generate(prompts, params, lora_request=loras))
    spec = _lora_llm(tiny_checkpoints, speculative_config={"method": "suffix", "num_speculative_tokens": 6})
    assert _tokens(spec.generate(prompts, params, lora_request=loras)) == plain


def test_one_adapter_a_step_under_max_loras_1(tiny_checkpoints, adapters, plain_mixed):
    """Requests of a second adapter wait until the first's are done; each answer is unchanged."""
    llm = _lora_llm(tiny_checkpoints, max_loras=1)
    seen: list[int] = []
    assign = llm.engine.runner.lora_slots.assign

    def counting(weights):
        slots = assign(weights)
        seen.append(len(slots))
        return slots

    llm.engine.runner.lora_slots.assign = counting
    prompts, loras = _mixed(adapters)
    assert _tokens(llm.generate(prompts, GREEDY, lora_request=loras)) == plain_mixed
    assert seen and max(seen) == 1


def test_prefix_cache_blocks_are_not_shared_between_adapters(tiny_checkpoints, adapters):
    llm = _lora_llm(tiny_checkpoints, block_size=4)
    prompt = repetitive_prompts()[3]  # 25 tokens: 6 full blocks
    first = llm.generate([prompt], GREEDY, lora_request=adapters["first"])[0]
    again = llm.generate([prompt], GREEDY, lora_request=adapters["first"])[0]
    other = llm.generate([prompt], GREEDY, lora_request=adapters["second"])[0]
    base = llm.generate([prompt], GREEDY)[0]
    assert again.metrics.num_cached_tokens == 24 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.metrics.num_cached_tokens == 0 and base.metrics.num_cached_tokens == 0
    fresh = _lora_llm(tiny_checkpoints, block_size=4)
    assert (
        other.outputs[0].token_ids
        == fresh.generate([prompt], GREEDY, lora_request=adapters["second"])[0].outputs[0].token_ids
    )
    assert base.outputs[0].token_ids == fresh.generate([prompt], GREEDY)[0].outputs[0].token_ids


def test_reset_prefix_cache_forgets_every_adapters_blocks(tiny_checkpoints, adapters):
    llm = _lora_llm(tiny_checkpoints, block_size=4)
    prompt = repetitive_prompts()[3]
    llm.generate([prompt], GREEDY, lora_request=adapters["first"])
    assert llm.reset_prefix_cache() and llm.get_tokenizer() is llm.tokenizer
    again = llm.generate([prompt], GREEDY, lora_request=adapters["first"])[0]
    assert again.metrics.num_cached_tokens == 0


def test_adapters_need_enable_lora(tiny_checkpoints, adapters):
    llm = LLM(_target(tiny_checkpoints), max_model_len=64)
    with pytest.raises(InvalidParameterError, match="'first' asked for, but LoRA is not enabled"):
        llm.generate([[2, 5, 6]], GREEDY, lora_request=adapters["first"])
    assert not llm.engine.has_unfinished_requests()


def test_a_bad_adapter_fails_the_call_before_anything_runs(tiny_checkpoints, adapters, tmp_path):
    llm = _lora_llm(tiny_checkpoints, max_lora_rank=4)
    with pytest.raises(LoRAError, match="rank 8 exceeds max_lora_rank 4"):
        llm.generate([[2, 5, 6], [2, 7, 8]], GREEDY, lora_request=[None, adapters["first"]])
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(LoRAError, match=r"is not a directory"):
        llm.add_lora(LoRARequest("missing", 3, str(Path(tmp_path) / "missing")))
    with pytest.raises(ValueError, match="lora_request: 1 values for 2 prompts"):
        llm.generate([[2, 5, 6], [2, 7, 8]], GREEDY, lora_request=[None])


def test_adapters_are_listed_loaded_and_removed(tiny_checkpoints, adapters):
    llm = _lora_llm(tiny_checkpoints, max_cpu_loras=2)
    assert llm.list_loras() == set()
    assert llm.add_lora(adapters["first"]) and llm.list_loras() == {1}
    llm.generate([[2, 5, 6]], GREEDY, lora_request=adapters["second"])
    assert llm.list_loras() == {1, 2}
    assert llm.remove_lora(1) and llm.list_loras() == {2} and not llm.remove_lora(1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_loras=0), "max_loras must be a positive integer"),
        (dict(max_lora_rank=0), "max_lora_rank must be a positive integer"),
        (dict(max_loras=2, max_cpu_loras=1), r"max_cpu_loras must be None or an integer >= max_loras \(2\)"),
        (dict(enable_lora="yes"), "enable_lora must be true or false"),
    ],
)
def test_lora_settings_are_checked(kwargs, message):
    from quickdraft.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.slow
def test_real_gemma_with_an_adapter_is_exact_under_speculation(tmp_path):
    """The embedded Gemma 3 270M (Q4_K_M as stored) with a random rank-16 adapter on every
    projection: suffix and ngram give plain decoding's tokens, alone and beside base requests."""
    from quickdraft.models.lora import write_random_adapter

    llm = LLM(enable_lora=True, max_loras=2, max_model_len=1024)
    adapter = LoRARequest(
        "random",
        1,
        str(write_random_adapter(tmp_path / "a", config=llm.engine.model_config, rank=16, b_std=0.02, seed=1)),
    )
    prompts = [
        "Question: List the planets of the solar system in order, one per line.\nAnswer:",
        "Question: Write the numbers from one to twenty in words.\nAnswer:",
    ]
    params = SamplingParams(max_tokens=48, temperature=0)
    plain = _tokens(llm.generate(prompts, params, lora_request=adapter))
    base = _tokens(llm.generate(prompts, params))
    assert plain != base
    for config in ({"method": "suffix"}, {"method": "ngram", "num_speculative_tokens": 4}):
        llm.engine.set_speculative_config(config)
        mixed = _tokens(llm.generate(prompts + prompts, params, lora_request=[adapter, adapter, None, None]))
        assert mixed == plain + base


def test_a_constrained_chat_with_an_adapter_is_exact_under_speculation(tiny_checkpoints, tmp_path):
    """Adapters compose with the rest of a request: a JSON-constrained chat reply (qwen3's template)
    under an adapter is the same with suffix speculation and without, and parses."""
    import json

    base = tiny_checkpoints["qwen3"]
    adapter = LoRARequest("qwen", 1, str(write_peft_adapter(base, tmp_path / "qwen", seed=4)))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = SamplingParams(max_tokens=40, temperature=0, structured_outputs={"json": schema})
    messages = [{"role": "user", "content": "Give me a number as JSON."}]
    replies = []
    for spec in (None, {"method": "suffix", "num_speculative_tokens": 6}):
        llm = LLM(str(base), enable_lora=True, max_model_len=256, speculative_config=spec)
        replies.append(llm.chat(messages, params, lora_request=adapter)[0].outputs[0])
    assert replies[0].token_ids == replies[1].token_ids
    if replies[0].finish_reason == "stop":
        assert isinstance(json.loads(replies[0].text)["a"], int)
