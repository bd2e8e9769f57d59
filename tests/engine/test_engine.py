"""End-to-end engine behaviour on tiny random checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from quickdraft import LLM, SamplingParams
from tests.conftest import ARCHS
from tests.models.test_decoder import prompt, reference_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


def reference_greedy(path, token_ids: list[int], num_tokens: int) -> list[int]:
    model = reference_model(path)
    ids = list(token_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(token_ids) :]


@pytest.fixture(scope="module")
def gemma_llm(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["gemma3"]), max_model_len=256, max_num_seqs=4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_checkpoints, arch):
    llm = LLM(str(tiny_checkpoints[arch]), max_model_len=128)
    tokens = prompt(12, seed=21)
    out = llm.generate([tokens], SamplingParams(max_tokens=24, **GREEDY))[0]
    assert out.outputs[0].token_ids == reference_greedy(tiny_checkpoints[arch], tokens, 24)
    assert out.outputs[0].finish_reason == "length"


def test_continuous_batching_equals_each_request_alone(tiny_checkpoints):
    path = str(tiny_checkpoints["gemma3"])
    prompts = [prompt(n, seed=30 + n) for n in (5, 17, 9, 30, 3, 12)]
    lengths = [7, 20, 3, 11, 15, 9]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in lengths]
    alone_llm = LLM(path, max_model_len=128, max_num_seqs=1)
    alone = [alone_llm.generate([p], q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    # Two slots and a small token budget: requests join and leave mid-run, prompts are chunked.
    batched_llm = LLM(path, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=8)
    batched = [o.outputs[0].token_ids for o in batched_llm.generate(prompts, params)]
    assert batched == alone
    assert [len(t) for t in batched] == lengths
    assert batched_llm.engine.cache.num_free_slots == 2


def test_chunked_prefill_equals_single_prefill(tiny_checkpoints):
    path = str(tiny_checkpoints["llama"])
    tokens = prompt(60, seed=40)
    whole = LLM(path, max_model_len=128).generate([tokens], SamplingParams(max_tokens=10, **GREEDY))
    chunked = LLM(path, max_model_len=128, max_num_batched_tokens=7).generate(
        [tokens], SamplingParams(max_tokens=10, **GREEDY)
    )
    assert whole[0].outputs[0].token_ids == chunked[0].outputs[0].token_ids


def test_seed_reproduces_and_is_independent_of_the_batch(gemma_llm):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=1234)
    first = gemma_llm.generate(["abc"], params)[0].outputs[0].token_ids
    again = gemma_llm.generate(["abc"], params)[0].outputs[0].token_ids
    mixed = (
        gemma_llm.generate(
            ["zzz", "abc", "qq"],
            [
                SamplingParams(temperature=1.0, max_tokens=12),
                params,
                SamplingParams(temperature=0.5, max_tokens=5, seed=9),
            ],
        )[1]
        .outputs[0]
        .token_ids
    )
    other = gemma_llm.generate(["abc"], SamplingParams(temperature=1.0, max_tokens=12, seed=4321))
    assert first == again == mixed
    assert other[0].outputs[0].token_ids != first


def test_stop_string_spanning_tokens(gemma_llm):
    full = gemma_llm.generate(["hello"], SamplingParams(max_tokens=16, **GREEDY))[0].outputs[0]
    # Byte-level tokenizer: every character is its own token, so a 3-character stop spans 3 tokens.
    stop = full.text[5:8]
    assert len(stop) == 3 and full.text.find(stop) == 5
    cut = gemma_llm.generate(["hello"], SamplingParams(max_tokens=16, stop=[stop], **GREEDY))[0].outputs[0]
    assert cut.text == full.text[:5]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = gemma_llm.generate(
        ["hello"], SamplingParams(max_tokens=16, stop=stop, include_stop_str_in_output=True, **GREEDY)
    )[0].outputs[0]
    assert kept.text == full.text[:8]


def test_detokenize_false_gives_the_same_tokens_and_no_text(gemma_llm):
    full = gemma_llm.generate(["hello"], SamplingParams(max_tokens=12, logprobs=1, **GREEDY))[0].outputs[0]
    stop_id = full.token_ids[7]
    for params in (
        SamplingParams(max_tokens=12, logprobs=1, detokenize=False, **GREEDY),
        SamplingParams(max_tokens=12, logprobs=1, detokenize=False, stop_token_ids=[stop_id], **GREEDY),
    ):
        bare = gemma_llm.generate(["hello"], params)[0].outputs[0]
        assert full.text and bare.text == ""
        end = full.token_ids.index(stop_id) + 1 if params.stop_token_ids else len(full.token_ids)  # kept, as vLLM
        assert bare.token_ids == full.token_ids[:end] and bare.logprobs == full.logprobs[:end]
    deltas = list(gemma_llm.stream("hello", SamplingParams(max_tokens=12, detokenize=False, **GREEDY)))
    assert [t for d in deltas for t in d.token_ids] == full.token_ids and not any(d.text for d in deltas)


def test_stream_never_shows_a_stop_string(gemma_llm):
    full = gemma_llm.generate(["hello"], SamplingParams(max_tokens=16, **GREEDY))[0].outputs[0]
    stop = full.text[6:9]
    deltas = list(gemma_llm.stream("hello", SamplingParams(max_tokens=16, stop=[stop], **GREEDY)))
    streamed = "".join(d.text for d in deltas)
    assert streamed == full.text[:6]
    assert deltas[-1].finished and deltas[-1].output.outputs[0].text == streamed


def test_stream_concatenates_to_the_final_text(gemma_llm):
    deltas = list(gemma_llm.stream("hello", SamplingParams(max_tokens=10, **GREEDY)))
    final = deltas[-1].output.outputs[0]
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids


def test_stop_token_ids_eos_and_ignore_eos(gemma_llm):
    full = gemma_llm.generate(["hello"], SamplingParams(max_tokens=12, **GREEDY))[0].outputs[0].token_ids
    stop_id = full[4]
    first = full.index(stop_id)
    out = gemma_llm.generate(["hello"], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_id]))
    assert out[0].outputs[0].token_ids == full[: first + 1]
    assert out[0].outputs[0].finish_reason == "stop" and out[0].outputs[0].stop_reason == stop_id
    # Treat that token as the model's EOS: generation stops there unless ignore_eos.
    gemma_llm.engine.eos_token_ids.append(stop_id)
    try:
        for req_params, expected in [(dict(temperature=0), full[: first + 1]), (GREEDY, full)]:
            got = gemma_llm.generate(["hello"], SamplingParams(max_tokens=12, **req_params))[0].outputs[0]
            assert got.token_ids == expected
        got = gemma_llm.generate(["hello"], SamplingParams(max_tokens=12, temperature=0, min_tokens=first + 2))
        assert stop_id not in got[0].outputs[0].token_ids[: first + 2]
    finally:
        gemma_llm.engine.eos_token_ids.remove(stop_id)


def test_logprobs_are_the_raw_log_softmax(tiny_checkpoints, gemma_llm):
    tokens = prompt(8, seed=50)
    out = gemma_llm.generate([tokens], SamplingParams(max_tokens=3, logprobs=3, **GREEDY))[0].outputs[0]
    with torch.no_grad():
        ref = reference_model(tiny_checkpoints["gemma3"])(torch.tensor([tokens + out.token_ids])).logits[0]
    ref_logprobs = torch.log_softmax(ref.float(), -1)
    assert len(out.logprobs) == 3
    for step, entry in enumerate(out.logprobs):
        row = ref_logprobs[len(tokens) - 1 + step]
        assert entry.token_id == out.token_ids[step]
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
        assert [t.token_id for t in entry.top] == row.topk(3).indices.tolist()
    assert out.cumulative_logprob == pytest.approx(sum(e.logprob for e in out.logprobs))


def test_abort_frees_the_slot(gemma_llm):
    engine = gemma_llm.engine
    ids = [engine.add_request(prompt=text, params=SamplingParams(max_tokens=50, **GREEDY)) for text in "abc"]
    engine.step()
    engine.step()
    assert engine.cache.num_free_slots == 1
    assert engine.abort_request(ids[1])
    assert engine.cache.num_free_slots == 2
    assert not engine.abort_request(ids[1])
    assert engine.get_request(ids[1]).to_output().outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.cache.num_free_slots == 4
    for request_id in ids:
        engine.release(request_id)


def test_metrics_are_filled(gemma_llm):
    out = gemma_llm.generate(["hello"], SamplingParams(max_tokens=5, **GREEDY))[0]
    m = out.metrics
    assert m.num_prompt_tokens == len(out.prompt_token_ids) and m.num_generation_tokens == 5
    assert 0 < m.ttft <= m.e2e and m.tpot >= 0


def test_max_model_len_ends_with_length(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["qwen2"]), max_model_len=20)
    out = llm.generate([prompt(15, seed=3)], SamplingParams(max_tokens=100, **GREEDY))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_chat_uses_the_template_and_errors_without_one(tiny_checkpoints, gemma_llm):
    llm = LLM(str(tiny_checkpoints["qwen3"]), max_model_len=128)
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, SamplingParams(max_tokens=3, **GREEDY))[0]
    expected = llm.tokenizer.encode("<s><|user|>hi\n<|assistant|>", add_special_tokens=False)
    assert out.prompt_token_ids == expected
    with pytest.raises(ValueError, match="chat template"):
        gemma_llm.chat(messages)
    custom = gemma_llm.chat(
        messages, SamplingParams(max_tokens=2, **GREEDY), chat_template="{{ messages[0]['content'] }}!"
    )
    assert custom[0].prompt == "hi!"


def test_chat_continues_an_open_final_message(gemma_llm):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}<end>{% endfor %}"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon "}]
    params = SamplingParams(max_tokens=3, **GREEDY)
    opened = gemma_llm.chat(
        messages, params, chat_template=template, add_generation_prompt=False, continue_final_message=True
    )[0]
    assert opened.prompt == "[user] hi<end>[assistant] Once upon"
    with pytest.raises(ValueError, match="continue_final_message needs add_generation_prompt"):
        gemma_llm.chat(messages, params, chat_template=template, continue_final_message=True)


# ---- bad input ---------------------------------------------------------------------------


def test_prompt_longer_than_context_is_rejected(gemma_llm):
    with pytest.raises(ValueError, match="max_model_len"):
        gemma_llm.generate([[5] * 300], SamplingParams(max_tokens=2))


def test_bad_prompt_does_not_leave_others_running(gemma_llm):
    with pytest.raises(ValueError, match=r"must be integers in \[0, 320\), got \[99999\]"):
        gemma_llm.generate(["fine", [1, 2, 99999]], SamplingParams(max_tokens=2))
    for bad in ([5, True], [5, 6.0]):  # a bool is an int to Python, never a token id
        with pytest.raises(ValueError, match=r"must be integers in \[0, 320\), got \["):
            gemma_llm.generate([bad], SamplingParams(max_tokens=2))
    assert not gemma_llm.engine.has_unfinished_requests()
    assert gemma_llm.engine.cache.num_free_slots == 4


def test_invalid_arguments(gemma_llm):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="sampling_params"):
        gemma_llm.generate(["a", "b"], [SamplingParams()])
    with pytest.raises(ValueError, match="empty"):
        gemma_llm.generate([[]])


def test_missing_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture(tiny_checkpoints, tmp_path):
    bad = tmp_path / "gpt2"
    shutil.copytree(tiny_checkpoints["llama"], bad)
    config = json.loads((bad / "config.json").read_text())
    config["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported architecture.*gpt2"):
        LLM(str(bad))


def test_corrupt_weights(tiny_checkpoints, tmp_path):
    bad = tmp_path / "corrupt"
    shutil.copytree(tiny_checkpoints["llama"], bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        LLM(str(bad))


def test_bad_dtype_and_device(tiny_checkpoints):
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(tiny_checkpoints["llama"]), dtype="float16x")
    with pytest.raises(ValueError, match="device"):
        LLM(str(tiny_checkpoints["llama"]), device="tpu")


def test_bfloat16_engine_runs(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["gemma3"]), dtype="bfloat16", max_model_len=64)
    out = llm.generate(["hello"], SamplingParams(max_tokens=6, **GREEDY))[0].outputs[0]
    assert len(out.token_ids) == 6


def test_truncate_prompt_tokens_keeps_the_last_ones(gemma_llm):
    long = prompt(300, seed=3)  # past max_model_len (256): refused unless truncated
    params = SamplingParams(temperature=0, max_tokens=5, truncate_prompt_tokens=60)
    kept = gemma_llm.generate([long], params)[0]
    alone = gemma_llm.generate([long[-60:]], SamplingParams(temperature=0, max_tokens=5))[0]
    assert kept.prompt_token_ids == long[-60:] and kept.outputs[0].token_ids == alone.outputs[0].token_ids
    with pytest.raises(ValueError, match="max_model_len"):
        gemma_llm.generate([long], SamplingParams(max_tokens=5, truncate_prompt_tokens=260))
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be >= 1"):
        SamplingParams(truncate_prompt_tokens=0)


def test_use_tqdm_shows_the_prompts_done(gemma_llm, capsys):
    params = SamplingParams(temperature=0, max_tokens=3, n=2)
    quiet = gemma_llm.generate(["a", "b"], params)
    assert "Processed prompts" not in capsys.readouterr().err
    shown = gemma_llm.generate(["a", "b"], params, use_tqdm=True)
    bar = capsys.readouterr().err
    assert "Processed prompts" in bar and "2/2" in bar  # prompts, not their 4 completions
    assert [[c.token_ids for c in o.outputs] for o in shown] == [[c.token_ids for c in o.outputs] for o in quiet]


def test_generate_without_params_samples_as_the_generation_config_says(tiny_checkpoints, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 6}))
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=128, generation_config=str(tmp_path))
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=6)
    prompts = ["Once upon", "The cat"]
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts)] == [o.outputs[0].token_ids for o in greedy]
    assert list(llm.stream("Once upon"))[-1].output.outputs[0].token_ids == greedy[0].outputs[0].token_ids
    ignored = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=128, generation_config="vllm")
    assert ignored.get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="override_generation_config: unknown keys"):
        LLM(str(tiny_checkpoints["gemma3"]), override_generation_config={"temp": 0})
