"""Per-request logits processors in the engine: applied to every verified row with that row's own
history, so every drafter (garbage included) returns exactly what plain decoding with the same
processors does; a processor that fails fails its request alone."""

from __future__ import annotations

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.verify.logits_processors import LogitsProcessorError
from tests.engine.test_speculative import EXACTNESS_CONFIGS, repetitive_prompts, speculative_llm

MAX_TOKENS = 30


def every_fifth(output, logits):
    """Position-dependent: a node deep in a tree must get its own path as history."""
    if len(output) % 5 == 4:
        logits = logits.clone()
        logits[int(logits.argmax())] -= 8.0
    return logits


def echo_prompt(prompt, output, logits):
    """Reads the prompt (the three-argument form): its token at the output's position gains."""
    logits = logits.clone()
    logits[prompt[len(output) % len(prompt)]] += 4.0
    return logits


@pytest.fixture(scope="module")
def target(tiny_checkpoints) -> str:
    return str(tiny_checkpoints["gemma3"])


def outputs(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(repetitive_prompts(), params)]


def test_processors_change_plain_decoding_as_asked(target):
    llm = LLM(target, max_model_len=256)
    seen: list[list[int]] = []

    def record(output, logits):
        seen.append(list(output))
        return logits

    banned = outputs(llm, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0][3]

    def ban(output, logits):
        logits[banned] = float("-inf")
        return logits

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logits_processors=[record, ban])
    (tokens,) = [o.outputs[0].token_ids for o in llm.generate([repetitive_prompts()[0]], params)]
    assert banned not in tokens
    # plain decoding calls it once a token, with the output so far
    assert seen == [tokens[:k] for k in range(len(tokens))]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("config", EXACTNESS_CONFIGS)
def test_speculation_with_processors_equals_plain(target, config, temperature):
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=temperature, seed=3, logits_processors=[every_fifth, echo_prompt]
    )
    plain = outputs(LLM(target, max_model_len=256), params)
    unprocessed = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=3)
    assert plain != outputs(LLM(target, max_model_len=256), unprocessed)
    llm = speculative_llm(target, config, max_model_len=256)
    assert outputs(llm, params) == plain
    metrics = llm.get_metrics()
    assert metrics.num_draft_tokens > 0
    if temperature == 0.0 and not config.get("garbage"):  # drafts accepted past the root: nodes' own histories mattered
        assert metrics.num_accepted_tokens > 20


def fails_at(position: int):
    def processor(output, logits):
        if len(output) == position:
            raise KeyError("boom")
        return logits

    return processor


@pytest.mark.parametrize("config", [None, {"method": "ngram", "num_speculative_tokens": 4}])
def test_a_failing_processor_fails_its_request_alone(target, config):
    llm = LLM(target, max_model_len=256, speculative_config=config)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    prompts = repetitive_prompts()
    expected = outputs(LLM(target, max_model_len=256), greedy)
    engine = llm.engine
    failing = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logits_processors=[fails_at(5)])
    ids = [engine.add_request(prompt_token_ids=p, params=failing if i == 1 else greedy) for i, p in enumerate(prompts)]
    while engine.has_unfinished_requests():
        engine.step()
    requests = [engine.get_request(request_id) for request_id in ids]
    assert requests[1].finish_reason == "error" and isinstance(requests[1].error, LogitsProcessorError)
    assert "KeyError: 'boom'" in str(requests[1].error) and len(requests[1].output_token_ids) == 5
    others = [k for k in range(len(prompts)) if k != 1]
    assert [requests[k].output_token_ids for k in others] == [expected[k] for k in others]


def test_generate_raises_the_processor_s_error_and_leaves_nothing_running(target):
    llm = LLM(target, max_model_len=256)
    bad = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logits_processors=[fails_at(2)])
    good = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    with pytest.raises(LogitsProcessorError, match=r"logits_processors\[0\] \(.*processor\) raised KeyError"):
        llm.generate(repetitive_prompts(), [good, bad, good, good])
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(repetitive_prompts()[:1], good)[0].outputs[0].token_ids) == MAX_TOKENS
    with pytest.raises(LogitsProcessorError):
        list(llm.stream(repetitive_prompts()[0], bad))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("config", EXACTNESS_CONFIGS[1:])
def test_a_processor_failing_only_off_the_plain_path_never_fails_the_request(target, config):
    """Rows of rejected branches go through the processor too; its failures there do not count."""
    prompt = repetitive_prompts()[0]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    expected = LLM(target, max_model_len=256).generate([prompt], greedy)[0].outputs[0].token_ids
    calls = {"off the path": 0}

    def only_the_plain_path(output, logits):
        if output != expected[: len(output)]:
            calls["off the path"] += 1
            raise ValueError("a history plain decoding never has")
        return logits

    # every node's row computed in the forward (none left for the walks to ask for): rows off the path too
    llm = speculative_llm(target, config, max_model_len=256, lazy_logits_rows=0)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logits_processors=[only_the_plain_path])
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == expected
    assert calls["off the path"] > 0  # rejected branches were processed, and failed, without consequence


def test_n_completions_share_the_processors_and_stay_exact(target):
    params = SamplingParams(
        n=3, max_tokens=MAX_TOKENS, temperature=0.9, seed=11, logits_processors=[every_fifth, echo_prompt]
    )
    prompt = repetitive_prompts()[0]
    plain = LLM(target, max_model_len=256).generate([prompt], params)[0].outputs
    spec = speculative_llm(target, EXACTNESS_CONFIGS[1], max_model_len=256).generate([prompt], params)[0].outputs
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert len({tuple(c.token_ids) for c in plain}) == 3  # seeds seed + i: three different samples
