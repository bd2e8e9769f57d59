"""Beam search: the rounds on a hand-made table of next-token logprobs (every candidate worked out
by hand), and LLM.beam_search on the tiny model against greedy decoding and teacher forcing."""

from __future__ import annotations

import math

import pytest

from quickdraft import LLM, BeamSearchParams, SamplingParams
from quickdraft.engine.beam_search import BeamSearch
from quickdraft.outputs import Logprob
from tests.engine.test_speculative import repetitive_prompts

EOS = 0
UNIFORM = {token: math.log(0.25) for token in range(4)}
# next-token logprobs after each generated prefix (vocabulary: EOS, 1, 2, 3)
TABLE = {
    (): {1: -0.5, 2: -1.0, 3: -2.0, EOS: -3.0},
    (1,): {EOS: -0.1, 1: -3.0, 2: -3.5, 3: -4.0},
    (2,): {3: -0.2, 1: -2.0, 2: -2.5, EOS: -5.0},
    (2, 3): {1: -0.3, EOS: -1.5, 2: -2.5, 3: -3.0},
}
PROMPT = [7, 8]


def run(params: BeamSearchParams, *, max_model_len: int = 100):
    search = BeamSearch([PROMPT], params, eos_token_ids=[EOS], max_model_len=max_model_len)
    expanded = []
    while not search.done:
        pending = search.pending()
        expanded.append([tuple(tokens[len(PROMPT) :]) for tokens in pending])
        tops = []
        for tokens in pending:
            row = TABLE.get(tuple(tokens[len(PROMPT) :]), UNIFORM)
            ranked = sorted(row.items(), key=lambda item: -item[1])[: 2 * params.beam_width]
            tops.append([Logprob(token_id=t, logprob=lp) for t, lp in ranked])
        search.advance(tops)
    (output,) = search.results(decode=lambda ids: " ".join(map(str, ids)))
    return output.sequences, expanded


def test_rounds_keep_the_best_candidates_and_set_finished_ones_aside():
    sequences, expanded = run(BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=1.0))
    # round 1 expands the empty beam; [0] ends; round 2 keeps [1] and [2]; [1, 0] ends, [2, 3]
    # (-1.2) and [2, 1] (-3.0) go on; round 3 ends at max_tokens with [2, 3, 1] (-1.5) and [2, 3, 2]
    assert expanded == [[()], [(1,), (2,)], [(2, 3), (2, 1)]]
    # scores: [2, 3, 1] -1.5 / 3 = -0.5; [1, EOS] -0.6 / 1 (the EOS is not length); [2, 3, 2] -3.7 / 3
    assert [s.output_token_ids for s in sequences] == [[2, 3, 1], [1, EOS]]
    assert [s.finish_reason for s in sequences] == ["length", "stop"]
    assert [round(s.cum_logprob, 6) for s in sequences] == [-1.5, -0.6]
    assert [round(s.score, 6) for s in sequences] == [-0.5, -0.6]
    assert sequences[0].tokens == PROMPT + [2, 3, 1] and sequences[0].text == "7 8 2 3 1"
    assert sequences[0].output_text == "2 3 1"
    assert [sorted(row) for row in sequences[0].logprobs] == [[0, 1, 2, 3]] * 3  # each round's top 4


def test_length_penalty_zero_ranks_by_summed_logprob():
    sequences, _ = run(BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0))
    assert [s.output_token_ids for s in sequences] == [[1, EOS], [2, 3, 1]]


def test_ignore_eos_keeps_eos_candidates_as_beams():
    sequences, expanded = run(BeamSearchParams(beam_width=2, max_tokens=2, ignore_eos=True))
    assert expanded == [[()], [(1,), (2,)]]
    assert [s.output_token_ids for s in sequences] == [[1, EOS], [2, 3]]
    assert {s.finish_reason for s in sequences} == {"length"}


def test_a_full_context_ends_the_beams():
    sequences, expanded = run(BeamSearchParams(beam_width=2, max_tokens=10), max_model_len=len(PROMPT) + 2)
    assert len(expanded) == 2 and all(len(s.output_token_ids) <= 2 for s in sequences)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"beam_width": 0}, r"^beam_width must be an int in \[1, 10\]"),
        ({"beam_width": 11}, r"^beam_width must be an int in \[1, 10\]"),
        ({"max_tokens": 0}, r"^max_tokens must be an int >= 1"),
        ({"length_penalty": float("nan")}, r"^length_penalty must be finite"),
        ({"temperature": 0.7}, r"^temperature must be 0"),
    ],
)
def test_bad_params_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**fields)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints) -> LLM:
    return LLM(str(tiny_checkpoints["gemma3"]), max_model_len=256)


def test_width_one_is_greedy_decoding(llm):
    prompts = [{"prompt_token_ids": p} for p in repetitive_prompts()]
    greedy = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, logprobs=0))
    beams = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True))
    for plain, beam in zip(greedy, beams):
        (sequence,) = beam.sequences
        assert sequence.output_token_ids == plain.outputs[0].token_ids
        assert sequence.cum_logprob == pytest.approx(sum(lp.logprob for lp in plain.outputs[0].logprobs), abs=1e-4)


def test_beams_are_distinct_ranked_and_scored_as_teacher_forcing_scores_them(llm):
    prompt = repetitive_prompts()[1]
    (result,) = llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=8, length_penalty=0.0))
    sequences = result.sequences
    assert len(sequences) == 4 and len({tuple(s.output_token_ids) for s in sequences}) == 4
    assert [s.cum_logprob for s in sequences] == sorted((s.cum_logprob for s in sequences), reverse=True)
    # each beam's summed logprob is what the model gives its tokens after the prompt
    for sequence in sequences:
        scored = llm.generate(
            [{"prompt_token_ids": prompt + sequence.output_token_ids}],
            SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
        )[0].prompt_logprobs
        teacher = sum(entry.logprob for entry in scored[len(prompt) :])
        assert sequence.cum_logprob == pytest.approx(teacher, abs=1e-3)
    assert not llm.engine.has_unfinished_requests()
