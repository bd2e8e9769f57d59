"""Structured outputs in the engine: outputs match their constraint, and speculation stays exact.

Constrained greedy speculative output equals constrained greedy plain output for every drafter
(garbage ones included: what the grammar forbids is cut before the forward); seeded sampling
is reproducible across drafters; sampled output has the constrained target distribution.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from quickdraft import LLM, SamplingParams
from tests.drafters.test_eagle import random_head
from tests.drafters.test_layer_skip import random_self_head
from tests.drafters.test_medusa import random_heads
from tests.engine.test_speculative import GarbageDrafter
from tests.models.test_decoder import prompt
from tests.stats_checks import count_outputs, same_distribution_p_value

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{3}-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma delta"]
LARK = 'start: "sum(" NUM "," NUM ")"\nNUM: /[0-9]{1,3}/'
CONSTRAINTS = [{"json": SCHEMA}, {"regex": REGEX}, {"choice": CHOICES}, {"grammar": LARK}, {"json_object": True}]


def prompts() -> list[list[int]]:
    base = prompt(6, seed=80)
    return [base * 3, prompt(12, seed=81), (prompt(4, seed=82) * 4)[:15], prompt(20, seed=83), base * 2]


def params(**options) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=48, structured_outputs=c, **options) for c in CONSTRAINTS]


def check_matches(outputs) -> None:
    json_out, regex_out, choice_out, lark_out, object_out = (o.outputs[0] for o in outputs)
    for out in (json_out, regex_out, choice_out, lark_out):
        assert out.finish_reason == "stop", out
    document = json.loads(json_out.text)
    assert set(document) == {"name", "n", "ok"} and len(document["name"]) <= 6
    assert isinstance(document["n"], int) and 0 <= document["n"] <= 99 and isinstance(document["ok"], bool)
    assert re.fullmatch(REGEX, regex_out.text)
    assert choice_out.text in CHOICES
    assert re.fullmatch(r"sum\([0-9]{1,3},[0-9]{1,3}\)", lark_out.text)
    if object_out.finish_reason == "stop":
        assert isinstance(json.loads(object_out.text), dict)
    else:  # a random model may fill max_tokens first: then it is a prefix of an object
        assert object_out.finish_reason == "length" and object_out.text.startswith("{")


@pytest.fixture(scope="module")
def target(tiny_checkpoints) -> str:
    return str(tiny_checkpoints["gemma3"])


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured_heads")
    return {
        "eagle3": random_head(root / "eagle3"),
        "medusa": random_heads(root / "medusa"),
        "self": random_self_head(root / "self"),
    }


@pytest.fixture(scope="module")
def plain(target):
    llm = LLM(target, max_model_len=256, max_num_seqs=8)
    greedy = llm.generate(prompts(), params(temperature=0.0))
    seeded = llm.generate(prompts(), [p for p in params(temperature=0.8, seed=7)])
    return greedy, seeded


def test_plain_outputs_match_their_constraints(plain):
    greedy, seeded = plain
    check_matches(greedy)
    check_matches(seeded)


def spec_configs(target: str, heads: dict) -> dict[str, dict]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 5},
        "suffix": {"method": "suffix", "num_speculative_tokens": 8},
        "grammar": {"method": "grammar"},
        "grammar+suffix": {"method": "hybrid", "drafters": [{"method": "grammar"}, {"method": "suffix"}]},
        "draft_model": {"method": "draft_model", "model": target, "num_speculative_tokens": 3},
        "eagle3": {"method": "eagle3", "head": str(heads["eagle3"]), "num_speculative_tokens": 3, "top_k": 3},
        "medusa": {"method": "medusa", "head": str(heads["medusa"])},
        "self": {"method": "self", "head": str(heads["self"])},
    }


@pytest.mark.parametrize(
    "name", ["ngram", "suffix", "grammar", "grammar+suffix", "draft_model", "eagle3", "medusa", "self", "garbage"]
)
def test_constrained_speculation_equals_constrained_plain(target, heads, plain, name):
    greedy, seeded = plain
    spec = spec_configs(target, heads).get(name, {"method": "ngram", "num_speculative_tokens": 6})
    llm = LLM(target, max_model_len=256, max_num_seqs=8, speculative_config=spec)
    if name == "garbage":  # random trees: most nodes are forbidden and cut
        llm.engine.speculator.drafter = GarbageDrafter(vocab_size=320, tree=True)
    outs = llm.generate(prompts(), params(temperature=0.0))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in greedy]
    check_matches(outs)
    assert llm.get_metrics().num_draft_tokens > 0
    if name != "draft_model":  # its sampled chains are checked by distribution below
        outs = llm.generate(prompts(), params(temperature=0.8, seed=7))
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in seeded]


@pytest.mark.parametrize("name", ["suffix", "grammar+suffix", "eagle3", "garbage"])
def test_constrained_rows_computed_when_the_walks_reach_them_change_nothing(target, heads, plain, name):
    """lazy_logits_rows=1: a row computed late is masked like one the forward computed."""
    greedy, seeded = plain
    spec = spec_configs(target, heads).get(name, {"method": "ngram", "num_speculative_tokens": 6})
    llm = LLM(target, max_model_len=256, max_num_seqs=8, speculative_config=spec, lazy_logits_rows=1)
    if name == "garbage":
        llm.engine.speculator.drafter = GarbageDrafter(vocab_size=320, tree=True)
    outs = llm.generate(prompts(), params(temperature=0.0))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in greedy]
    check_matches(outs)
    outs = llm.generate(prompts(), params(temperature=0.8, seed=7))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in seeded]
    assert llm.get_metrics().num_draft_tokens > 0


def test_forced_tokens_save_forwards(target, plain):
    greedy, _ = plain
    llm = LLM(target, max_model_len=256, max_num_seqs=8, speculative_config={"method": "grammar"})
    outs = llm.generate(prompts()[:1], params(temperature=0.0)[:1])
    assert outs[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    # '{"name": "' and the later keys are forced: many tokens per forward on the JSON request.
    assert outs[0].metrics.num_target_forwards < 0.7 * len(outs[0].outputs[0].token_ids)


def test_sampled_constrained_tokens_have_the_masked_distribution(target):
    """One constrained position: counts of 1500 draws against the masked target's probabilities
    (the logprobs of the allowed tokens, which the engine computes from the masked row)."""
    from scipy import stats

    llm = LLM(target, max_model_len=64, max_num_seqs=8)
    constraint = {"regex": "[a-e]"}
    probe = llm.generate(
        [prompt(5, seed=90)], SamplingParams(max_tokens=1, temperature=0.0, logprobs=8, structured_outputs=constraint)
    )
    top = probe[0].outputs[0].logprobs[0].top
    probabilities = {entry.token_id: math.exp(entry.logprob) for entry in top if entry.logprob > -math.inf}
    assert len(probabilities) == 5 and abs(sum(probabilities.values()) - 1.0) < 1e-4
    draws = [SamplingParams(max_tokens=1, temperature=1.0, seed=s, structured_outputs=constraint) for s in range(1500)]
    counts = count_outputs(llm, prompt(5, seed=90), draws)
    observed = [counts.get((token,), 0) for token in probabilities]
    assert sum(observed) == 1500  # nothing outside the allowed tokens
    total = sum(probabilities.values())
    expected = [1500 * p / total for p in probabilities.values()]
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_sampled_draft_model_chains_keep_the_constrained_distribution(target):
    """A draft model's sampled chains (rejection with max(p - q, 0)) under a grammar that forbids
    most of what the unconstrained draft proposes: same distribution as constrained plain."""
    constraint = {"regex": "[a-e]{2}x"}
    draws = [SamplingParams(max_tokens=4, temperature=1.0, seed=s, structured_outputs=constraint) for s in range(1200)]
    plain_llm = LLM(target, max_model_len=64, max_num_seqs=8)
    spec_llm = LLM(
        target,
        max_model_len=64,
        max_num_seqs=8,
        speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 3},
    )
    reference = count_outputs(plain_llm, prompt(5, seed=91), draws)
    speculative = count_outputs(spec_llm, prompt(5, seed=91), draws)
    assert spec_llm.get_metrics().num_draft_tokens > 500
    assert same_distribution_p_value(reference, speculative) > 1e-3


def test_a_constraint_cut_short_by_max_tokens_ends_with_length(target):
    llm = LLM(target, max_model_len=64, max_num_seqs=2, speculative_config={"method": "grammar"})
    out = llm.generate(
        [prompt(5, seed=92)], SamplingParams(max_tokens=4, temperature=0.0, structured_outputs={"json": SCHEMA})
    )
    assert out[0].outputs[0].finish_reason == "length"
    assert out[0].outputs[0].text == '{"na'


def test_narrow_rows_computed_alone_give_the_whole_lm_heads_choices(target, plain, monkeypatch):
    """Rows that allow few tokens get only those logits (dot products on the LM-head rows); with
    that off (every row through the whole LM head) the tokens are the same, and the values agree."""
    import torch

    from quickdraft.structured import grammar

    greedy, _ = plain
    monkeypatch.setattr(grammar, "SPARSE_ROW_LIMIT", 0)
    llm = LLM(target, max_model_len=256, max_num_seqs=8, speculative_config={"method": "grammar"})
    outs = llm.generate(prompts(), params(temperature=0.0))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in greedy]
    model = llm.engine.model
    hidden = torch.randn(3, model.config.hidden_size)
    whole = model.compute_logits(hidden)
    ids = [[0, 5, 319], [7], list(range(40, 60))]
    for row, (values, tokens) in enumerate(zip(model.logits_of_tokens(hidden, ids), ids)):
        torch.testing.assert_close(values, whole[row, tokens], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", [None, {"method": "grammar"}])
def test_a_grammar_that_must_stop_wins_over_min_tokens_and_ignore_eos(target, spec):
    llm = LLM(target, max_model_len=64, max_num_seqs=2, speculative_config=spec)
    constraint = {"choice": ["ab"]}
    out = llm.generate(
        [prompt(5, seed=93)], SamplingParams(max_tokens=8, min_tokens=5, temperature=0.0, structured_outputs=constraint)
    )
    assert (out[0].outputs[0].text, out[0].outputs[0].finish_reason) == ("ab", "stop")
    # ignore_eos: EOS does not end the request; the finished grammar allows nothing else.
    out = llm.generate(
        [prompt(5, seed=93)],
        SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0, structured_outputs=constraint),
    )
    assert out[0].outputs[0].finish_reason == "length" and out[0].outputs[0].text.startswith("ab")


@pytest.mark.parametrize("name", ["suffix", "garbage"])
def test_drafts_past_the_eos_of_a_request_that_ignores_it_stay_exact(target, name):
    """With ignore_eos a request goes on after the EOS its finished grammar leaves it, so a tree's
    nodes after an EOS are verified: masked by the ended grammar (only EOS), which records no
    token for them (a walk rolled back what it had not consumed, and the commit then failed)."""
    constraints = [{"choice": ["ab", "b"]}, {"regex": "[0-9]{2}"}, {"json_object": True}]
    requests = [
        SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, structured_outputs=c) for c in constraints
    ]
    inputs = [prompt(5, seed=94), prompt(9, seed=95), prompt(6, seed=96) * 2]
    plain = LLM(target, max_model_len=64, max_num_seqs=4).generate(inputs, requests)
    spec = {"method": "suffix", "num_speculative_tokens": 6}
    llm = LLM(target, max_model_len=64, max_num_seqs=4, speculative_config=spec)
    eos = llm.engine.eos_token_ids[0]
    if name == "garbage":  # trees thick with EOS nodes, and other tokens after them
        llm.engine.speculator.drafter = GarbageDrafter(vocab_size=320, tree=True, choices=[eos, eos, eos, 5, 40])
    outs = llm.generate(inputs, requests)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert eos in outs[0].outputs[0].token_ids and llm.get_metrics().num_accepted_tokens > 0
