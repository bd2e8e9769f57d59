"""Predicted outputs: the request's expected text is the draft (drafters/prediction.py), from its
start, in step with the output, found again after an edit; the output is plain decoding's
whatever the prediction says."""

from __future__ import annotations

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.drafters.base import AcceptedPath, DraftRequest
from quickdraft.drafters.prediction import PredictionDrafter

PREDICTION = [10, 11, 12, 13, 14, 15, 20, 21, 12, 13, 16, 17]


def request(output: list[int], *, budget: int = 4) -> DraftRequest:
    return DraftRequest(
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        output_token_ids=output,
        budget=budget,
        prediction_token_ids=PREDICTION,
    )


def drafted(drafter: PredictionDrafter, output: list[int], *, budget: int = 4) -> list[int] | None:
    proposal = drafter.propose([request(output, budget=budget)])[0]
    return None if proposal is None else proposal.token_ids[1:]


def accept(drafter: PredictionDrafter, output: list[int], *, num_accepted: int) -> None:
    nodes = list(range(num_accepted + 1))
    drafter.accept(
        request(output), AcceptedPath(nodes=nodes, num_accepted=num_accepted, committed_token_ids=[], bonus=False)
    )


def test_the_prediction_is_drafted_in_step_with_chains_that_follow_what_was_accepted():
    drafter = PredictionDrafter()
    drafter.begin(request([]))
    assert drafter.propose([request([])])[0].token_ids == [3, 10, 11, 12, 13]  # root: the prompt's last token
    assert drafted(drafter, [10]) == [11, 12, 13, 14]  # the first token (sampled with the prompt) is the prediction's
    accept(drafter, [10], num_accepted=2)  # 11, 12, then the target's own 13
    assert drafted(drafter, [10, 11, 12, 13], budget=8) == [14, 15, 20]  # in step; a miss: 2 accepted + 1
    accept(drafter, [10, 11, 12, 13], num_accepted=3)  # the whole chain: the next one twice as long
    assert drafted(drafter, [10, 11, 12, 13, 14, 15, 20, 21], budget=8) == [12, 13, 16, 17]  # to the end
    accept(drafter, [10, 11, 12, 13, 14, 15, 20, 21], num_accepted=0)  # the target's 99: an edit
    assert drafted(drafter, [10, 11, 12, 13, 14, 15, 20, 21, 99]) is None  # 99 is nowhere in the prediction


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ([10, 11, 12, 13], [14, 15, 20, 21]),
        ([5, 20, 21], [12, 13, 16, 17]),  # found again after an edit (a run of 2: at most 4 tokens)
        ([10, 11, 12, 13, 14, 15, 20, 21, 12, 13], [16, 17]),  # the second "12 13": the longer run wins
        ([7, 12, 13], [14, 15, 20, 21]),  # equal runs: the one nearest past where the output last was
        ([16, 17], None),  # the prediction's end: nothing left
        ([99, 13], None),  # a run of one token says too little: the engine's drafter drafts instead
    ],
)
def test_the_output_is_found_again_in_the_prediction(output, expected):
    drafter = PredictionDrafter()
    drafter.begin(request([]))
    assert drafted(drafter, output) == expected


def test_budget_bounds_the_chain_and_requests_without_a_prediction_get_none():
    drafter = PredictionDrafter()
    drafter.begin(request([]))
    assert drafted(drafter, [], budget=2) == [10, 11]
    other = DraftRequest(request_id="o", prompt_token_ids=[1], output_token_ids=[], budget=4)
    drafter.begin(other)
    assert drafter.propose([other]) == [None]
    drafter.finish("r")
    assert drafter.propose([request([])]) == [None]


# ---- the engine: exact whatever the prediction, faster where it is right ---------------------------

LETTERS = "abcdefghijklmnopqrstuvwxyz "


@pytest.fixture(scope="module")
def setting(tiny_checkpoints):
    """A tiny model held to single-byte letter tokens, so that its output's text tokenizes back
    into the same tokens (a prediction is text)."""
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=256, max_num_seqs=4)
    letters = llm.tokenizer.encode(LETTERS, add_special_tokens=False)
    greedy = dict(temperature=0.0, max_tokens=80, ignore_eos=True, allowed_token_ids=letters)
    plain = llm.generate(["Once upon a time"], SamplingParams(**greedy))[0].outputs[0]
    assert llm.tokenizer.encode(plain.text, add_special_tokens=False) == plain.token_ids
    return llm, greedy, plain


def test_a_right_prediction_cuts_the_forwards_and_changes_no_token(setting):
    llm, greedy, plain = setting
    out = llm.generate(["Once upon a time"], SamplingParams(**greedy, prediction=plain.text))[0]
    assert out.outputs[0].token_ids == plain.token_ids
    assert out.metrics.num_target_forwards <= 80 // 16 + 2 and out.metrics.num_accepted_tokens >= 70


@pytest.mark.parametrize(
    "edit",
    [
        lambda text: text[:30] + "zzzz" + text[34:],  # an edit in the middle
        lambda text: text[40:],  # the first half missing
        lambda text: "qqqq " * 20,  # wrong
        lambda text: text[:20] + text[20:40] * 3 + text[40:],  # a repeated stretch
    ],
)
def test_a_wrong_or_edited_prediction_changes_no_token(setting, edit):
    llm, greedy, plain = setting
    out = llm.generate(["Once upon a time"], SamplingParams(**greedy, prediction=edit(plain.text)))[0]
    assert out.outputs[0].token_ids == plain.token_ids


def test_sampled_requests_n_and_other_drafters_stay_exact(setting, tiny_checkpoints):
    llm, greedy, plain = setting
    sampled = dict(greedy, temperature=0.9, seed=5, n=2)
    expected = [c.token_ids for c in llm.generate(["Once upon a time"], SamplingParams(**sampled))[0].outputs]
    predicted = llm.generate(["Once upon a time"], SamplingParams(**sampled, prediction=plain.text))[0]
    assert [c.token_ids for c in predicted.outputs] == expected  # position-keyed draws: the same tokens
    suffix = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=256, speculative_config={"method": "suffix"})
    both = suffix.generate(
        ["Once upon a time", "Once upon a time"],
        [SamplingParams(**greedy, prediction=plain.text), SamplingParams(**greedy)],
    )
    assert [o.outputs[0].token_ids for o in both] == [plain.token_ids] * 2
    assert both[0].metrics.num_accepted_tokens >= 70  # the prediction drafted, not suffix
    with pytest.raises(ValueError, match="prediction must be a non-empty string"):
        SamplingParams(prediction="")


class DepthSpy:
    """Proposes nothing; records the depth the engine offered it per request."""

    feature_layers: tuple[int, ...] = ()
    scores_paths = False

    def __init__(self):
        self.depths: list[int] = []

    def begin(self, request):
        pass

    def observe(self, request, features):
        pass

    def propose(self, requests):
        self.depths += [request.max_depth for request in requests]
        return [None] * len(requests)

    def accept(self, request, accepted):
        pass

    def finish(self, request_id):
        pass


def test_the_engine_s_drafter_drafts_at_its_own_length_where_the_prediction_is_lost(setting):
    llm, greedy, plain = setting
    spy = DepthSpy()
    llm.engine.set_drafter(spy, num_speculative_tokens=3)
    try:
        right = llm.generate(["Once upon a time"], SamplingParams(**greedy, prediction=plain.text))[0]
        assert right.metrics.num_accepted_tokens >= 70  # chains of up to 16, past the drafter's 3
        lost = llm.generate(["Once upon a time"], SamplingParams(**greedy, prediction="zz " * 30))[0]
        assert lost.outputs[0].token_ids == plain.token_ids
        assert spy.depths and max(spy.depths) == 3  # (less only where max_tokens is near)
    finally:
        llm.engine.set_speculative_config(None)
