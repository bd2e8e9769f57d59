"""EngineConfig.logprobs_mode (vLLM's): raw or processed, as logprobs or logits; the same under
speculation as in plain decoding, every path position with its own history."""

from __future__ import annotations

import math

import pytest

from quickdraft import LLM, SamplingParams
from tests.engine.test_speculative import OracleDrafter
from tests.models.test_decoder import prompt

MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@pytest.fixture(scope="module")
def llms(tiny_checkpoints):
    path = str(tiny_checkpoints["gemma3"])
    return {mode: LLM(path, max_model_len=128, max_num_seqs=4, logprobs_mode=mode) for mode in MODES}


def completion(llm: LLM, tokens: list[int], params: SamplingParams):
    return llm.generate([tokens], params)[0].outputs[0]


def test_raw_logits_are_the_logprobs_before_normalizing(llms):
    tokens = prompt(9, seed=80)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=4)
    logprobs = completion(llms["raw_logprobs"], tokens, params)
    logits = completion(llms["raw_logits"], tokens, params)
    assert logits.token_ids == logprobs.token_ids
    for as_logprobs, as_logits in zip(logprobs.logprobs, logits.logprobs):
        assert [t.token_id for t in as_logits.top] == [t.token_id for t in as_logprobs.top]
        # a row's log_softmax is its logits less one constant (their logsumexp)
        pairs = [(a.logprob, b.logprob) for a, b in zip(as_logits.top, as_logprobs.top)]
        shifts = [logit - logprob for logit, logprob in [*pairs, (as_logits.logprob, as_logprobs.logprob)]]
        assert max(shifts) - min(shifts) < 1e-4 and max(shifts) > 0.1
        assert as_logits.rank == as_logprobs.rank == 1  # greedy, nothing processed: the argmax


def test_processed_logprobs_are_what_each_token_was_sampled_from(llms):
    tokens = prompt(7, seed=81)
    params = SamplingParams(max_tokens=8, temperature=0.7, top_k=3, seed=5, ignore_eos=True, logprobs=5)
    raw_logits = completion(llms["raw_logits"], tokens, params)
    processed = completion(llms["processed_logprobs"], tokens, params)
    processed_logits = completion(llms["processed_logits"], tokens, params)
    assert processed.token_ids == raw_logits.token_ids == processed_logits.token_ids  # the mode changes no draw
    for raw, lp, lg in zip(raw_logits.logprobs, processed.logprobs, processed_logits.logprobs):
        kept = [t.logprob / 0.7 for t in raw.top[:3]]  # top_k 3 of the logits / temperature
        normalizer = math.log(sum(math.exp(v) for v in kept))
        assert [t.logprob for t in lp.top[:3]] == pytest.approx([v - normalizer for v in kept], abs=1e-4)
        assert [t.logprob for t in lp.top[3:]] == [-math.inf, -math.inf]  # dropped by top_k
        assert [t.logprob for t in lg.top[:3]] == pytest.approx(kept, abs=1e-4)
        assert [t.logprob for t in lg.top[3:]] == [-math.inf, -math.inf]
        assert lp.rank in (1, 2, 3) and lp.logprob == next(t.logprob for t in lp.top if t.token_id == lp.token_id)


def test_processed_logprobs_of_a_greedy_request_carry_its_penalties(llms):
    tokens = prompt(5, seed=82) * 3
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2, repetition_penalty=2.0)
    raw = completion(llms["raw_logprobs"], tokens, params)
    processed = completion(llms["processed_logprobs"], tokens, params)
    assert raw.token_ids == processed.token_ids
    assert all(entry.rank == 1 for entry in processed.logprobs)  # greedy takes the processed argmax
    assert any(entry.rank != 1 for entry in raw.logprobs)  # which the penalty moved somewhere


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0, repetition_penalty=1.6, frequency_penalty=0.4),
        dict(temperature=0.8, top_p=0.9, presence_penalty=0.5, seed=3),
    ],
)
def test_speculation_returns_plain_decodings_processed_logprobs(tiny_checkpoints, llms, mode, sampling):
    """Each accepted token's row is processed with the tokens before it on its path: an oracle's
    long accepted chains give the same values as decoding one token at a time."""
    prompts = [prompt(6, seed=83) * 2, prompt(11, seed=84)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3, **sampling)
    plain = [out.outputs[0] for out in llms[mode].generate(prompts, params)]
    llm = LLM(
        str(tiny_checkpoints["gemma3"]),
        max_model_len=128,
        max_num_seqs=4,
        logprobs_mode=mode,
        speculative_config={"method": "ngram", "num_speculative_tokens": 5},
    )
    continuations = {tuple(p): c.token_ids for p, c in zip(prompts, plain)}
    llm.engine.speculator.drafter = OracleDrafter(continuations=continuations, corrupt=0.15, seed=1)
    speculative = [out.outputs[0] for out in llm.generate(prompts, params)]
    assert [c.token_ids for c in speculative] == [c.token_ids for c in plain]
    assert [c.logprobs for c in speculative] == [c.logprobs for c in plain]
    metrics = llm.get_metrics()
    assert metrics.num_accepted_tokens > 2 * metrics.num_drafts  # long paths were verified


def test_rankings_by_logprobs_refuse_logits(llms):
    from quickdraft.engine.beam_search import BeamSearchParams

    with pytest.raises(ValueError, match=r"beam search ranks by summed logprobs.*'raw_logits'"):
        llms["raw_logits"].beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match=r"best_of ranks by summed logprobs.*'processed_logits'"):
        llms["processed_logits"].generate([[5, 6]], SamplingParams(n=1, best_of=2, temperature=1.0, max_tokens=2))
    assert llms["processed_logprobs"].beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=2))


def test_an_unknown_mode_is_refused(tiny_checkpoints):
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        LLM(str(tiny_checkpoints["gemma3"]), logprobs_mode="logits")


def test_max_logprobs_caps_what_a_request_may_ask(tiny_checkpoints, llms):
    """vLLM's max_logprobs: 20 by default; -1 lifts it, and a request's -1 is every token."""
    with pytest.raises(ValueError, match=r"logprobs must be <= 20 \(the engine's max_logprobs"):
        llms["raw_logprobs"].generate([[5, 6]], SamplingParams(max_tokens=1, logprobs=21))
    with pytest.raises(ValueError, match=r"prompt_logprobs must be <= 20 .* got -1"):
        llms["raw_logprobs"].generate([[5, 6]], SamplingParams(max_tokens=1, prompt_logprobs=-1))
    assert not llms["raw_logprobs"].engine.has_unfinished_requests()
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=64, max_logprobs=-1)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0, logprobs=-1, prompt_logprobs=-1))[0]
    vocab = llm.engine.model_config.vocab_size
    for entry in [*out.outputs[0].logprobs, *out.prompt_logprobs[1:]]:
        assert len(entry.top) == vocab
        assert math.fsum(math.exp(t.logprob) for t in entry.top) == pytest.approx(1.0, abs=1e-4)
    wide = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0, logprobs=50))[0].outputs[0]
    assert [len(entry.top) for entry in wide.logprobs] == [50, 50]
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= -1"):
        LLM(str(tiny_checkpoints["gemma3"]), max_logprobs=-2)
