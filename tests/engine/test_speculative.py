"""Speculative decoding in the engine: lossless for every drafter, metrics that add up."""

from __future__ import annotations

import random

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.drafters.base import Proposal
from tests.models.test_decoder import prompt
from tests.stats_checks import count_outputs, same_distribution_p_value

GREEDY = dict(temperature=0.0, ignore_eos=True)


class GarbageDrafter:
    """Proposes random tokens (a chain or a random tree): accepts little, must stay exact."""

    def __init__(self, *, vocab_size: int, tree: bool, seed: int = 0, choices: list[int] | None = None):
        self.tree, self.rng = tree, random.Random(seed)
        self.choices = choices if choices is not None else list(range(vocab_size))

    def begin(self, request):
        pass

    def propose(self, requests):
        proposals = []
        for req in requests:
            root = req.token_ids[-1]
            size = self.rng.randint(1, min(req.budget, req.max_depth))
            tokens = [root] + [self.rng.choice(self.choices) for _ in range(size)]
            parents = [-1] + [self.rng.randrange(i) if self.tree else i - 1 for i in range(1, size + 1)]
            proposals.append(Proposal(token_ids=tokens, parents=parents))
        return proposals

    def accept(self, request, accepted):
        pass

    def finish(self, request_id):
        pass


class OracleDrafter(GarbageDrafter):
    """Proposes the known greedy continuation, sometimes corrupted: exercises long accepts."""

    def __init__(self, *, continuations: dict[tuple, list[int]], corrupt: float, seed: int = 0):
        super().__init__(vocab_size=300, tree=False, seed=seed)
        self.continuations, self.corrupt = continuations, corrupt

    def propose(self, requests):
        proposals = []
        for req in requests:
            future = self.continuations[tuple(req.prompt_token_ids)][len(req.output_token_ids) :]
            draft = [t if self.rng.random() > self.corrupt else 7 for t in future[: req.budget]]
            proposals.append(Proposal.chain(req.token_ids[-1], draft) if draft else None)
        return proposals


class PositionalDrafter(GarbageDrafter):
    """Random trees whose tokens at output position i come from `choices[i]`."""

    def __init__(self, *, choices: dict[int, list[int]], seed: int = 0):
        super().__init__(vocab_size=1, tree=True, seed=seed)
        self.choices_at = choices

    def propose(self, requests):
        proposals = []
        for req in requests:
            size = self.rng.randint(1, min(req.budget, req.max_depth))
            tokens, parents, depths = [req.token_ids[-1]], [-1], [0]
            for node in range(1, size + 1):
                parent = self.rng.randrange(node)
                position = len(req.output_token_ids) + depths[parent]
                tokens.append(self.rng.choice(self.choices_at.get(position, [0])))
                parents.append(parent)
                depths.append(depths[parent] + 1)
            proposals.append(Proposal(token_ids=tokens, parents=parents))
        return proposals


# The drafters each exactness test of a sampling feature runs: two real ones and random trees.
EXACTNESS_CONFIGS = [
    {"method": "ngram", "num_speculative_tokens": 4},
    {"method": "suffix", "num_speculative_tokens": 6},
    {"method": "ngram", "num_speculative_tokens": 6, "garbage": True},
]


def speculative_llm(target: str, config: dict, **kwargs) -> LLM:
    """An LLM drafting as `config` says; with "garbage": True a GarbageDrafter's random trees."""
    config = dict(config)
    garbage = config.pop("garbage", False)
    llm = LLM(target, speculative_config=config, **kwargs)
    if garbage:
        llm.engine.speculator.drafter = GarbageDrafter(vocab_size=320, tree=True, seed=7)
    return llm


def repetitive_prompts() -> list[list[int]]:
    base = prompt(6, seed=70)
    return [base * 3, prompt(10, seed=71), (prompt(4, seed=72) * 5)[:17], prompt(25, seed=73)]


@pytest.fixture(scope="module")
def plain_outputs(tiny_checkpoints):
    results = {}
    for arch in ("gemma3", "llama"):
        llm = LLM(str(tiny_checkpoints[arch]), max_model_len=256, max_num_seqs=4)
        outs = llm.generate(repetitive_prompts(), SamplingParams(max_tokens=40, **GREEDY))
        results[arch] = [o.outputs[0].token_ids for o in outs]
    return results


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 5},
        {"method": "ngram", "num_speculative_tokens": 4, "num_branches": 3},
        {"method": "suffix", "num_speculative_tokens": 8},
        {"method": "ngram", "num_speculative_tokens": 3, "dynamic_draft_length": True},
    ],
)
def test_greedy_speculation_equals_plain(tiny_checkpoints, plain_outputs, arch, spec):
    llm = LLM(str(tiny_checkpoints[arch]), max_model_len=256, max_num_seqs=4, speculative_config=spec)
    outs = llm.generate(repetitive_prompts(), SamplingParams(max_tokens=40, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs[arch]
    metrics = llm.get_metrics()
    assert metrics.num_drafts > 0 and metrics.num_accepted_tokens > 0  # the drafter did draft
    assert llm.engine.cache.num_free_slots == 4


@pytest.mark.parametrize("tree", [False, True])
def test_garbage_drafter_keeps_greedy_exact(tiny_checkpoints, plain_outputs, tree):
    llm = LLM(
        str(tiny_checkpoints["gemma3"]),
        max_model_len=256,
        max_num_seqs=4,
        speculative_config={"method": "ngram", "num_speculative_tokens": 6},
    )
    llm.engine.speculator.drafter = GarbageDrafter(vocab_size=320, tree=tree)
    outs = llm.generate(repetitive_prompts(), SamplingParams(max_tokens=40, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs["gemma3"]
    metrics = llm.get_metrics()
    assert metrics.num_draft_tokens > 100
    assert metrics.acceptance_rate < 0.2


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_greedy_speculation_in_bfloat16_equals_plain(tiny_checkpoints, arch):
    """bfloat16 weights round coarsely, so ties and near-ties are common: only a forward whose
    rows do not depend on the batch keeps speculation exact (it did not, before the float path's
    kernels were batch-invariant in bfloat16)."""
    path = str(tiny_checkpoints[arch])
    params = SamplingParams(max_tokens=40, **GREEDY)
    plain = LLM(path, dtype="bfloat16", max_model_len=256, max_num_seqs=4).generate(repetitive_prompts(), params)
    for spec in ({"method": "ngram", "num_speculative_tokens": 5}, {"method": "suffix", "num_speculative_tokens": 8}):
        llm = LLM(path, dtype="bfloat16", max_model_len=256, max_num_seqs=4, speculative_config=spec)
        outs = llm.generate(repetitive_prompts(), params)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain], spec
    llm.engine.speculator.drafter = GarbageDrafter(vocab_size=320, tree=True)
    outs = llm.generate(repetitive_prompts(), params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def oracle_llm(path, plain: list[list[int]], *, num_speculative_tokens: int, corrupt: float, **options) -> LLM:
    """An engine whose drafter proposes plain decoding's answers to repetitive_prompts()."""
    continuations = {tuple(p): out for p, out in zip(repetitive_prompts(), plain)}
    llm = LLM(
        str(path),
        max_model_len=256,
        speculative_config={"method": "ngram", "num_speculative_tokens": num_speculative_tokens},
        **options,
    )
    llm.engine.speculator.drafter = OracleDrafter(continuations=continuations, corrupt=corrupt)
    return llm


def test_long_accepts_metrics_and_max_tokens(tiny_checkpoints, plain_outputs):
    prompts = repetitive_prompts()
    llm = oracle_llm(
        tiny_checkpoints["gemma3"], plain_outputs["gemma3"], num_speculative_tokens=5, corrupt=0.15, max_num_seqs=4
    )
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs["gemma3"]
    for out in outs:
        m = out.metrics
        assert m.num_generation_tokens == 40
        assert m.acceptance_length == pytest.approx(40 / m.num_target_forwards)
        assert m.acceptance_length > 2.0
        assert m.num_accepted_tokens <= m.num_draft_tokens
        assert sum(m.accepted_per_position) == m.num_accepted_tokens
        assert m.accepted_per_position[0] <= m.drafted_per_position[0] == m.num_drafts
        # forwards = prefill + one per draft + plain steps; tokens = accepted + one per forward
        assert m.num_generation_tokens == m.num_accepted_tokens + m.num_target_forwards
    engine_metrics = llm.get_metrics()
    assert engine_metrics.num_generation_tokens == 160
    assert engine_metrics.num_accepted_tokens == sum(o.metrics.num_accepted_tokens for o in outs)
    assert engine_metrics.verify_seconds > 0 and engine_metrics.draft_seconds > 0


def test_stop_string_inside_an_accepted_run(tiny_checkpoints, plain_outputs):
    path = str(tiny_checkpoints["gemma3"])
    prompts = repetitive_prompts()
    plain_llm = LLM(path, max_model_len=256)
    full = plain_llm.generate([prompts[0]], SamplingParams(max_tokens=40, **GREEDY))[0].outputs[0]
    stop = full.text[10:13]
    expected = plain_llm.generate([prompts[0]], SamplingParams(max_tokens=40, stop=[stop], **GREEDY))[0].outputs[0]
    llm = oracle_llm(path, plain_outputs["gemma3"], num_speculative_tokens=8, corrupt=0.0)
    got = llm.generate([prompts[0]], SamplingParams(max_tokens=40, stop=[stop], **GREEDY))[0].outputs[0]
    assert got.text == expected.text and got.token_ids == expected.token_ids
    assert got.finish_reason == "stop"
    assert llm.engine.cache.num_free_slots == llm.engine.cache.num_slots


@pytest.mark.parametrize("lazy_logits_rows", [0, 1])
def test_logprobs_under_speculation_match_plain(tiny_checkpoints, lazy_logits_rows):
    path = str(tiny_checkpoints["llama"])
    params = SamplingParams(max_tokens=20, logprobs=2, **GREEDY)
    plain = LLM(path, max_model_len=128).generate([repetitive_prompts()[0]], params)[0].outputs[0]
    llm = LLM(path, max_model_len=128, speculative_config={"method": "ngram"}, lazy_logits_rows=lazy_logits_rows)
    assert llm.engine.lazy_logits_rows == lazy_logits_rows
    spec = llm.generate([repetitive_prompts()[0]], params)[0].outputs[0]
    assert [e.token_id for e in spec.logprobs] == plain.token_ids
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]


def test_seeded_sampling_under_speculation_is_reproducible(tiny_checkpoints):
    llm = LLM(
        str(tiny_checkpoints["gemma3"]),
        max_model_len=128,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    params = SamplingParams(temperature=0.7, top_k=20, max_tokens=30, seed=5)
    first = llm.generate([repetitive_prompts()[0]], params)[0].outputs[0].token_ids
    again = llm.generate([repetitive_prompts()[0]], params)[0].outputs[0].token_ids
    assert first == again and len(first) == 30


def test_bad_speculative_configs(tiny_checkpoints):
    path = str(tiny_checkpoints["llama"])
    with pytest.raises(ValueError, match="unknown speculative method 'nope'"):
        LLM(path, speculative_config={"method": "nope"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="bogus"):
        LLM(path, speculative_config={"method": "ngram", "bogus": 1})
    with pytest.raises(ValueError, match="method"):
        LLM(path, speculative_config={"num_speculative_tokens": 3})


def assert_random_trees_keep_sampling(path: str, **engine_options) -> None:
    """Chi-square: first three tokens under speculation (random trees over the tokens seen at
    each position, so accepts and rejects are both frequent) vs plain sampling."""
    base = prompt(5, seed=80)
    params = [SamplingParams(temperature=1.5, top_k=3, max_tokens=4, seed=s) for s in range(1500)]
    options = {"max_model_len": 64, "max_num_seqs": 8, **engine_options}
    plain = count_outputs(LLM(path, **options), base, params)
    spec_llm = LLM(path, **options, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    seen = {i: sorted({key[i] for key in plain}) for i in range(3)}
    spec_llm.engine.speculator.drafter = PositionalDrafter(choices=seen, seed=1)
    spec = count_outputs(spec_llm, base, params)
    metrics = spec_llm.get_metrics()
    assert metrics.num_accepted_tokens > 200 and metrics.acceptance_rate < 0.9
    assert same_distribution_p_value(plain, spec) > 1e-3


def test_sampled_first_tokens_have_the_target_distribution(tiny_checkpoints):
    assert_random_trees_keep_sampling(str(tiny_checkpoints["llama"]))


def _forward_widths(llm) -> list[int]:
    """Rows fed to each target forward from now on (recorded by wrapping the runner)."""
    widths: list[int] = []
    forward = llm.engine.runner.forward

    def recording_forward(work, **options):
        widths.append(sum(len(item.token_ids) for item in work))
        return forward(work, **options)

    llm.engine.runner.forward = recording_forward
    return widths


@pytest.mark.parametrize("tree", [False, True])
def test_draft_nodes_count_against_max_num_batched_tokens(tiny_checkpoints, plain_outputs, tree):
    """Tree nodes are tokens of the step: no forward feeds more than max_num_batched_tokens,
    drafts shrink to fit (still exact), and a prompt arriving beside decodes still prefills."""
    llm = LLM(
        str(tiny_checkpoints["gemma3"]),
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=14,
        speculative_config={"method": "ngram", "num_speculative_tokens": 6},
    )
    llm.engine.speculator.drafter = GarbageDrafter(vocab_size=320, tree=tree)
    widths = _forward_widths(llm)
    outs = llm.generate(repetitive_prompts(), SamplingParams(max_tokens=40, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs["gemma3"]
    assert max(widths) <= 14 and max(widths) >= 12  # the budget is used, never exceeded
    assert llm.get_metrics().num_draft_tokens > 100
    # a 25-token prompt admitted while three requests decode: it prefills in chunks beside them
    assert llm.engine.scheduler.draft_reserve == 6  # held back per decode: the draft length
    plan_sizes = []
    for request in repetitive_prompts()[:3]:
        llm.engine.add_request(prompt_token_ids=request, params=SamplingParams(max_tokens=30, **GREEDY))
    while not any(len(r.output_token_ids) for r in llm.engine.scheduler.running):
        llm.engine.step()
    llm.engine.add_request(prompt_token_ids=repetitive_prompts()[3], params=SamplingParams(max_tokens=5, **GREEDY))
    while llm.engine.has_unfinished_requests():
        plan_sizes.append([item.num_new_tokens for item in llm.engine.scheduler.schedule()])  # what step() runs
        llm.engine.step()
    assert any(max(sizes) > 1 and len(sizes) > 1 for sizes in plan_sizes)  # prefill chunks beside decodes


def test_step_that_finishes_a_request_inside_its_path_is_a_decode_step(tiny_checkpoints, plain_outputs):
    """The step cost model (adaptive speculation) hears "decode only" for a step of decodes, also when
    a request stops inside its accepted path (the check is made before the step commits)."""
    prompts = repetitive_prompts()
    llm = oracle_llm(
        tiny_checkpoints["gemma3"], plain_outputs["gemma3"], num_speculative_tokens=6, corrupt=0.0, max_num_seqs=4
    )
    steps = []
    observe_step = llm.engine.speculator.observe_step

    def recording(**kw):
        steps.append(kw)
        return observe_step(**kw)

    llm.engine.speculator.observe_step = recording
    expected = plain_outputs["gemma3"][1]
    # a stop token first met a few drafts in, inside a drafted run: the request ends mid-path
    stop = next(token for i, token in enumerate(expected) if i >= 4 and token not in expected[:i])
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=40, stop_token_ids=[stop], **GREEDY))[0]
    assert out.outputs[0].token_ids == expected[: expected.index(stop) + 1]
    drafted = [s for s in steps if s["num_drafted_requests"]]
    assert drafted and all(s["decode_only"] for s in drafted)
    assert llm.get_metrics().num_accepted_tokens > len(out.outputs[0].token_ids) // 2


def test_lazy_logits_rows_left_to_the_engine_is_measured_on_cpu(tiny_checkpoints):
    """None: measured at load on the CPU (rows that cost what one pass over the head costs), or
    0 where many rows cost less than two passes; either way a fixed value the engine reports."""
    llm = LLM(str(tiny_checkpoints["llama"]), max_model_len=128, speculative_config={"method": "ngram"})
    rows = llm.engine.lazy_logits_rows
    assert isinstance(rows, int) and rows >= 0
    assert llm.engine.lazy_logits_rows == rows
