"""Recursive rejection sampling over proposal trees: exact tables and losslessness statistics."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch
from scipy import stats

from quickdraft.drafters.base import AcceptedPath, Proposal
from quickdraft.verify import rejection
from quickdraft.verify.rejection import verify_proposal
from quickdraft.verify.sampler import make_generator, sample_from_probs


def rows(*probs) -> torch.Tensor:  # hand-built target rows -> [num_nodes, V] float32
    return torch.tensor(probs, dtype=torch.float32)


def one_hot(token: int, vocab: int) -> list[float]:
    out = [0.0] * vocab
    out[token] = 1.0
    return out


class ScriptedUniforms:
    """Replaces the module's uniform draw: returns the scripted values, counts the calls."""

    def __init__(self, values=()):
        self.values = list(values)
        self.calls = 0

    def __call__(self, generator, device) -> float:
        if self.calls >= len(self.values):
            raise AssertionError(f"uniform #{self.calls + 1} drawn, {len(self.values)} scripted")
        self.calls += 1
        return self.values[self.calls - 1]


@pytest.fixture
def uniforms(monkeypatch) -> Callable[..., ScriptedUniforms]:
    def script(*values: float) -> ScriptedUniforms:
        scripted = ScriptedUniforms(values)
        monkeypatch.setattr(rejection, "_draw_uniform", scripted)
        return scripted

    return script


def verify(proposal, target_probs, *, seed=0, max_new_tokens=None) -> AcceptedPath:
    return verify_proposal(
        proposal=proposal,
        target_probs=target_probs,
        generator=make_generator(seed),
        max_new_tokens=max_new_tokens,
    )


def assert_path(path: AcceptedPath, *, nodes, committed, bonus) -> None:
    assert path.nodes == nodes
    assert path.num_accepted == len(nodes) - 1
    assert path.committed_token_ids == committed
    assert path.bonus is bonus


# ------------------------------------------------------------------------------------
# exact tables (deterministic proposals)
# ------------------------------------------------------------------------------------


def test_perfect_match_accepts_all_and_draws_bonus_from_leaf_row(uniforms):
    scripted = uniforms(0.1, 0.2)
    target = rows(
        [0.5, 0.5, 0, 0, 0, 0],  # after root: draft 1 accepted (0.1 < 0.5)
        [0, 0, 0.6, 0.4, 0, 0],  # after node 1: draft 2 accepted (0.2 < 0.6)
        one_hot(4, 6),  # after node 2 (leaf): bonus 4
    )
    path = verify(Proposal.chain(root=5, draft=[1, 2]), target)
    assert_path(path, nodes=[0, 1, 2], committed=[1, 2, 4], bonus=True)
    assert scripted.calls == 2


def test_first_token_rejected_recovers_from_residual(uniforms):
    uniforms(0.9)  # 0.9 >= 0.7: reject token 1; the residual is the point mass at 2
    target = rows([0, 0.7, 0.3, 0, 0], one_hot(3, 5), one_hot(3, 5))
    path = verify(Proposal.chain(root=0, draft=[1, 3]), target)
    assert_path(path, nodes=[0], committed=[2], bonus=False)


def test_rejection_after_an_accepted_token(uniforms):
    uniforms(0.3, 0.8)  # accept 1 (0.3 < 0.5), reject 2 (0.8 >= 0.75)
    target = rows([0.5, 0.5, 0, 0], [0, 0, 0.75, 0.25], one_hot(0, 4))
    path = verify(Proposal.chain(root=0, draft=[1, 2]), target)
    assert_path(path, nodes=[0, 1], committed=[1, 3], bonus=False)


def test_root_only_proposal_is_plain_decoding():
    target = rows([0.2, 0.3, 0.5])
    for seed in range(5):
        path = verify(Proposal(token_ids=[1], parents=[-1]), target, seed=seed)
        plain = sample_from_probs(target, [make_generator(seed)])
        assert_path(path, nodes=[0], committed=[int(plain[0])], bonus=True)


def test_accepted_path_on_a_later_branch(uniforms):
    # root -> node 1 (token 3) -> node 3 (token 0); root -> node 2 (token 1) -> node 4 (token 2)
    proposal = Proposal(token_ids=[9, 3, 1, 0, 2], parents=[-1, 0, 0, 1, 2])
    target = rows(
        [0, 0.5, 0, 0.5, 0, 0, 0, 0, 0, 0],
        one_hot(0, 10),
        [0, 0, 0.25, 0, 0, 0.75, 0, 0, 0, 0],
        one_hot(7, 10),
        one_hot(8, 10),
    )
    # Reject token 3 (0.9 >= 0.5): the residual is the point mass at 1, so node 2 is accepted
    # without a draw; then token 2 is accepted (0.1 < 0.25) and the bonus comes from row 4.
    scripted = uniforms(0.9, 0.1)
    path = verify(proposal, target)
    assert_path(path, nodes=[0, 2, 4], committed=[1, 2, 8], bonus=True)
    assert scripted.calls == 2


def test_rejected_token_is_never_recovered():
    target = rows([0.3, 0.4, 0.3, 0.0], one_hot(0, 4))
    recovered = Counter()
    for seed in range(300):
        path = verify(Proposal.chain(root=0, draft=[1]), target, seed=seed)
        if path.num_accepted == 0:
            recovered[path.committed_token_ids[0]] += 1
    assert set(recovered) == {0, 2}  # never the rejected 1, never the impossible 3
    assert sum(recovered.values()) > 100


def test_point_mass_residual_deterministic(uniforms):
    uniforms(0.99)
    path = verify(Proposal.chain(root=0, draft=[1]), rows([0, 0.5, 0.5, 0], one_hot(0, 4)))
    assert_path(path, nodes=[0], committed=[2], bonus=False)


def test_point_mass_residual_sampled(uniforms):
    # p = [.25, .25, .5], q = [.25, .75, 0]: accept 1 w.p. 1/3; residual max(p - q, 0) = [0, 0, .5].
    uniforms(0.5)
    draft_probs = rows([1, 0, 0], [0.25, 0.75, 0.0])
    proposal = Proposal.chain(root=0, draft=[1], draft_probs=draft_probs)
    path = verify(proposal, rows([0.25, 0.25, 0.5], one_hot(0, 3)))
    assert_path(path, nodes=[0], committed=[2], bonus=False)


def test_sampled_acceptance_ratio_uses_min_one(uniforms):
    # p[1] = .5 > q[1] = .25: accepted without a draw; then p[2] / q[2] = .5 / .75.
    scripted = uniforms(0.6)
    draft_probs = rows([1, 0, 0], [0.25, 0.25, 0.5], [0, 0.25, 0.75])
    proposal = Proposal.chain(root=0, draft=[1, 2], draft_probs=draft_probs)
    target = rows([0.25, 0.5, 0.25], [0.5, 0, 0.5], one_hot(0, 3))
    path = verify(proposal, target)
    assert_path(path, nodes=[0, 1, 2], committed=[1, 2, 0], bonus=True)
    assert scripted.calls == 1
    scripted = uniforms(0.7)  # 0.7 >= 2/3: rejected; residual max(p - q, 0) = [.5, 0, 0]
    path = verify(proposal, target)
    assert_path(path, nodes=[0, 1], committed=[1, 0], bonus=False)


def test_duplicate_siblings_deterministic(uniforms):
    # Children 1, 1, 2: the duplicate has residual probability 0 (no draw), then 2 is certain.
    scripted = uniforms(0.9)
    proposal = Proposal(token_ids=[0, 1, 1, 2], parents=[-1, 0, 0, 0])
    target = rows([0, 0.5, 0.5], one_hot(0, 3), one_hot(0, 3), one_hot(1, 3))
    path = verify(proposal, target)
    assert_path(path, nodes=[0, 3], committed=[2, 1], bonus=True)
    assert scripted.calls == 1


def test_zero_probability_draft_token_never_accepted():
    target = rows([0.5, 0.0, 0.5, 0.0], one_hot(1, 4))
    for seed in range(100):
        path = verify(Proposal.chain(root=0, draft=[1]), target, seed=seed)
        assert path.num_accepted == 0 and path.committed_token_ids[0] in (0, 2)
        # Out-of-vocabulary ids (a drafter with a larger vocabulary) have probability 0 too.
        path = verify(Proposal.chain(root=0, draft=[7]), target, seed=seed)
        assert path.num_accepted == 0
        path = verify(Proposal.chain(root=0, draft=[-1]), target, seed=seed)
        assert path.num_accepted == 0
    draft_probs = rows([1, 0, 0, 0], [0.1, 0.7, 0.1, 0.1])
    for seed in range(100):
        sampled = Proposal.chain(root=0, draft=[1], draft_probs=draft_probs)
        path = verify(sampled, target, seed=seed)
        assert path.num_accepted == 0 and path.committed_token_ids[0] in (0, 2)


def test_greedy_one_hot_rows(uniforms):
    scripted = uniforms()  # no uniform may be drawn
    target = rows(one_hot(2, 5), one_hot(4, 5), one_hot(1, 5), one_hot(0, 5))
    path = verify(Proposal.chain(root=0, draft=[2, 4, 3]), target)
    assert_path(path, nodes=[0, 1, 2], committed=[2, 4, 1], bonus=False)
    path = verify(Proposal.chain(root=0, draft=[2, 4, 1]), target)
    assert_path(path, nodes=[0, 1, 2, 3], committed=[2, 4, 1, 0], bonus=True)
    path = verify(Proposal.chain(root=0, draft=[3, 4, 1]), target)
    assert_path(path, nodes=[0], committed=[2], bonus=False)
    # A tree: the argmax is the second child.
    tree = Proposal(token_ids=[0, 3, 2, 4], parents=[-1, 0, 0, 2])
    tree_target = rows(one_hot(2, 5), one_hot(0, 5), one_hot(4, 5), one_hot(1, 5))
    path = verify(tree, tree_target)
    assert_path(path, nodes=[0, 2, 3], committed=[2, 4, 1], bonus=True)
    assert scripted.calls == 0


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("sampled", [True, False])
def test_greedy_consumes_no_randomness(monkeypatch, fast, sampled):
    monkeypatch.setattr(rejection, "_POINT_MASS_FAST_PATH", fast)
    target = rows(one_hot(2, 5), one_hot(4, 5), one_hot(1, 5))
    draft_probs = torch.full((3, 5), 0.2) if sampled else None
    gen = make_generator(7)
    before = gen.get_state()
    path = verify_proposal(
        proposal=Proposal.chain(root=0, draft=[2, 3], draft_probs=draft_probs),
        target_probs=target,
        generator=gen,
    )
    assert path.committed_token_ids == [2, 4]
    assert torch.equal(gen.get_state(), before)


def test_max_new_tokens_cut(uniforms):
    target = rows(one_hot(1, 4), one_hot(2, 4), one_hot(3, 4))
    proposal = Proposal.chain(root=0, draft=[1, 2])
    assert_path(verify(proposal, target), nodes=[0, 1, 2], committed=[1, 2, 3], bonus=True)
    path = verify(proposal, target, max_new_tokens=3)
    assert_path(path, nodes=[0, 1, 2], committed=[1, 2, 3], bonus=True)
    path = verify(proposal, target, max_new_tokens=2)  # node 1 has a child: not a bonus
    assert_path(path, nodes=[0, 1], committed=[1, 2], bonus=False)
    assert_path(verify(proposal, target, max_new_tokens=1), nodes=[0], committed=[1], bonus=False)
    with pytest.raises(ValueError, match="max_new_tokens"):
        verify(proposal, target, max_new_tokens=0)


def test_max_new_tokens_draws_from_the_unmodified_row():
    # Capped at one token, the draft is not tried: the rejected-residual rule does not apply,
    # so the draft token 1 can come out (it could not as a recovered token).
    target = rows([0, 0.5, 0.5], one_hot(0, 3))
    seen = Counter(
        verify(Proposal.chain(root=0, draft=[1]), target, seed=seed, max_new_tokens=1).committed_token_ids[0]
        for seed in range(200)
    )
    assert set(seen) == {1, 2}


def test_invalid_inputs():
    proposal = Proposal.chain(root=0, draft=[1])
    with pytest.raises(ValueError, match="target_probs"):
        verify(proposal, rows([0.5, 0.5]))
    with pytest.raises(ValueError, match="no positive probability"):
        verify(proposal, rows([0.0, 0.0], [0.5, 0.5]))
    sampled = Proposal.chain(root=0, draft=[1], draft_probs=rows([1, 0, 0], [1, 0, 0]))
    with pytest.raises(ValueError, match="draft probability 0"):
        verify(sampled, rows([0.5, 0.5, 0], [0.5, 0.5, 0]))
    sampled = Proposal.chain(root=0, draft=[1], draft_probs=rows([1, 0], [0.5, 0.5]))
    with pytest.raises(ValueError, match="draft_probs"):
        verify(sampled, rows([0.5, 0.5, 0], [0.5, 0.5, 0]))
    sampled = Proposal.chain(root=0, draft=[3], draft_probs=rows([1, 0, 0], [0.5, 0.5, 0]))
    with pytest.raises(ValueError, match="out of range"):
        verify(sampled, rows([0.5, 0.5, 0], [0.5, 0.5, 0]))


def test_large_vocabulary_greedy_and_sampled():
    vocab = 262144
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=gen)
    argmax = logits.argmax(dim=-1).tolist()
    greedy = torch.zeros(3, vocab).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    path = verify(Proposal.chain(root=0, draft=argmax[:2]), greedy)
    assert_path(path, nodes=[0, 1, 2], committed=argmax, bonus=True)
    probs = torch.softmax(logits * 5, dim=-1)
    path = verify(Proposal.chain(root=0, draft=[vocab - 1, 3], draft_probs=probs.flip(0)), probs)
    assert 1 <= len(path.committed_token_ids) <= 3


# ------------------------------------------------------------------------------------
# greedy fast path == general path
# ------------------------------------------------------------------------------------


def random_tree(*, num_nodes: int, gen: torch.Generator) -> list[int]:  # parents
    return [-1] + [int(torch.randint(0, node, (1,), generator=gen)) for node in range(1, num_nodes)]


@pytest.mark.parametrize("sampled", [False, True])
def test_point_mass_fast_path_equals_general_path(monkeypatch, sampled):
    vocab = 7
    gen = torch.Generator().manual_seed(11)
    for _ in range(150):
        num_nodes = int(torch.randint(1, 10, (1,), generator=gen))
        parents = random_tree(num_nodes=num_nodes, gen=gen)
        argmax = torch.randint(0, vocab, (num_nodes,), generator=gen)
        target = torch.nn.functional.one_hot(argmax, vocab).float()  # [num_nodes, V]
        # Tokens: the parent's argmax half of the time, else random (duplicates included).
        tokens = [0] + [
            int(argmax[parents[n]])
            if torch.rand(1, generator=gen) < 0.5
            else int(torch.randint(0, vocab, (1,), generator=gen))
            for n in range(1, num_nodes)
        ]
        draft_probs = None
        if sampled:
            draft_probs = torch.rand(num_nodes, vocab, generator=gen) + 0.01
        proposal = Proposal(token_ids=tokens, parents=parents, draft_probs=draft_probs)
        cap = int(torch.randint(1, 4, (1,), generator=gen))
        cap = None if torch.rand(1, generator=gen) < 0.5 else cap
        results = []
        for fast in (True, False):
            monkeypatch.setattr(rejection, "_POINT_MASS_FAST_PATH", fast)
            results.append(verify(proposal, target, max_new_tokens=cap))
        assert results[0] == results[1]
        # and the greedy answer: follow the argmax as long as a child proposes it
        node, expected = 0, []
        while cap is None or len(expected) + 1 < cap:
            nxt = [c for c in range(1, num_nodes) if parents[c] == node and tokens[c] == argmax[node]]
            if not nxt:
                break
            node = nxt[0]
            expected.append(tokens[node])
        assert results[0].committed_token_ids == expected + [int(argmax[node])]


# ------------------------------------------------------------------------------------
# statistical losslessness
# ------------------------------------------------------------------------------------

VOCAB = 6
NUM_TOKENS = 3  # the joint of the first 3 committed tokens is compared
PROMPT = [4, 1]
RUNS = 4000


def dirichlet(shape, *, alpha: float, seed: int) -> torch.Tensor:  # [..., V] float64
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.dirichlet([alpha] * shape[-1], size=shape[:-1]))


def make_target(seed: int) -> torch.Tensor:  # [V, V, V]: next-token distribution given the last two
    gen = torch.Generator().manual_seed(seed)
    table = dirichlet((VOCAB, VOCAB, VOCAB), alpha=1.0, seed=seed)
    # A few impossible tokens per row, so zero-probability handling is exercised.
    zero = torch.rand(VOCAB, VOCAB, VOCAB, generator=gen) < 0.2
    zero[..., 0] = False
    table = table.masked_fill(zero, 0.0)
    return (table / table.sum(dim=-1, keepdim=True)).float()


TARGET = make_target(0)
MARGINAL = TARGET.double().mean(dim=0)  # [V, V] the target averaged over the older token


def target_row(history: list[int]) -> torch.Tensor:  # [V]
    return TARGET[history[-2], history[-1]]


def exact_joint(prefix: list[int]) -> dict[tuple[int, ...], float]:
    joint = {}
    for seq in itertools.product(range(VOCAB), repeat=NUM_TOKENS):
        history, prob = list(prefix), 1.0
        for token in seq:
            row = target_row(history).double()  # [V]
            prob *= float(row[token] / row.sum())
            history.append(token)
        joint[seq] = prob
    return joint


def target_probs_for(prefix: list[int], proposal: Proposal) -> torch.Tensor:  # [num_nodes, V]
    """Row i = the target after prefix + the tokens of node i's ancestors and node i."""
    histories: list[list[int]] = []
    for node, parent in enumerate(proposal.parents):
        if parent < 0:
            histories.append(list(prefix))
        else:
            histories.append(histories[parent] + [proposal.token_ids[node]])
    return torch.stack([target_row(h) for h in histories])


# ---- drafters: (prefix, generator) -> Proposal ----------------------------------------

Drafter = Callable[[list[int], torch.Generator], Proposal]


def sampled_tree(draft_table: torch.Tensor, widths: list[int]) -> Drafter:
    """Children of each node drawn i.i.d. from draft_table[node's token]; depth len(widths)."""

    def propose(prefix: list[int], gen: torch.Generator) -> Proposal:
        tokens, parents, rows_ = [prefix[-1]], [-1], [torch.full((VOCAB,), 1.0 / VOCAB)]
        level = [0]
        for width in widths:
            next_level = []
            for node in level:
                draft_row = draft_table[tokens[node]]
                drawn = torch.multinomial(draft_row, width, replacement=True, generator=gen)
                for token in drawn.tolist():
                    tokens.append(token)
                    parents.append(node)
                    rows_.append(draft_row)
                    next_level.append(len(tokens) - 1)
            level = next_level
        return Proposal(token_ids=tokens, parents=parents, draft_probs=torch.stack(rows_).float())

    return propose


Pick = Callable[[int, int, torch.Generator], list[int]]  # (token, width, generator) -> children


def deterministic_tree(pick: Pick, widths: list[int]) -> Drafter:
    """Children of each node = pick(node's token, width, generator); draft_probs None."""

    def propose(prefix: list[int], gen: torch.Generator) -> Proposal:
        tokens, parents = [prefix[-1]], [-1]
        level = [0]
        for width in widths:
            next_level = []
            for node in level:
                for token in pick(tokens[node], width, gen):
                    tokens.append(token)
                    parents.append(node)
                    next_level.append(len(tokens) - 1)
            level = next_level
        return Proposal(token_ids=tokens, parents=parents)

    return propose


def top_k_pick(draft_table: torch.Tensor) -> Pick:
    return lambda token, width, gen: torch.topk(draft_table[token], width).indices.tolist()


def garbage_pick(token: int, width: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, VOCAB, (width,), generator=gen).tolist()  # duplicates included


CLOSE = (0.8 * MARGINAL + 0.2 / VOCAB).float()  # near the target, mass on impossible tokens too
FAR = dirichlet((VOCAB, VOCAB), alpha=0.5, seed=1).float()
GREEDY_DRAFT = torch.nn.functional.one_hot(FAR.argmax(dim=-1), VOCAB).float()  # draft greedy


def simulate(
    drafter: Drafter,
    *,
    runs: int = RUNS,
    seed: int = 0,
    verifier: Callable[..., AcceptedPath] = verify_proposal,
) -> Counter:
    """Counts of the first NUM_TOKENS committed tokens over ``runs`` speculative generations."""
    gen = make_generator(seed)
    draft_gen = torch.Generator().manual_seed(seed + 1)
    counts: Counter = Counter()
    for _ in range(runs):
        prefix = list(PROMPT)
        while len(prefix) < len(PROMPT) + NUM_TOKENS:
            proposal = drafter(prefix, draft_gen)
            path = verifier(
                proposal=proposal,
                target_probs=target_probs_for(prefix, proposal),
                generator=gen,
                max_new_tokens=len(PROMPT) + NUM_TOKENS - len(prefix),
            )
            assert 1 <= len(path.committed_token_ids) <= len(PROMPT) + NUM_TOKENS - len(prefix)
            prefix += path.committed_token_ids
        counts[tuple(prefix[len(PROMPT) :])] += 1
    return counts


def joint_fits(counts: Counter, exact: dict[tuple[int, ...], float], *, alpha: float = 1e-3) -> bool:
    """Chi-square goodness of fit of observed sequences to the exact joint; False = rejected.

    A sequence of probability 0 must never appear; cells with small expected counts are
    pooled so the chi-square approximation holds.
    """
    total = sum(counts.values())
    if any(exact.get(seq, 0.0) == 0.0 for seq in counts):
        return False
    obs, exp, pooled_obs, pooled_exp = [], [], 0.0, 0.0
    for seq, prob in exact.items():
        if prob == 0.0:
            continue
        if prob * total >= 5:
            obs.append(counts.get(seq, 0))
            exp.append(prob * total)
        else:
            pooled_obs += counts.get(seq, 0)
            pooled_exp += prob * total
    if pooled_exp > 0:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    scale = sum(obs) / sum(exp)  # exact sums to 1 up to rounding
    return stats.chisquare(obs, [e * scale for e in exp]).pvalue >= alpha


EXACT = exact_joint(PROMPT)

DRAFTERS: dict[str, Drafter] = {
    "chain_sampled_close": sampled_tree(CLOSE, [1, 1, 1]),
    "chain_sampled_far": sampled_tree(FAR, [1, 1, 1]),
    "tree_sampled_iid": sampled_tree(CLOSE, [3, 2]),
    "tree_deterministic_top_k": deterministic_tree(top_k_pick(CLOSE), [2, 2]),
    "tree_garbage": deterministic_tree(garbage_pick, [3, 2]),
    "tree_sampled_one_hot": sampled_tree(GREEDY_DRAFT, [2, 2]),
}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_speculation_is_lossless(name):
    counts = simulate(DRAFTERS[name], seed=sum(map(ord, name)))
    assert joint_fits(counts, EXACT)


def recover_from_target(**kwargs) -> AcceptedPath:
    """A wrong verifier: after a rejection it resamples from the target, not the residual."""
    path = verify_proposal(**kwargs)
    if path.bonus or len(path.committed_token_ids) == kwargs["max_new_tokens"]:
        return path
    row = kwargs["target_probs"][path.nodes[-1] : path.nodes[-1] + 1]
    token = int(sample_from_probs(row, [kwargs["generator"]])[0])
    committed = path.committed_token_ids[:-1] + [token]
    return AcceptedPath(path.nodes, path.num_accepted, committed, bonus=False)


def test_statistics_detect_a_wrong_residual():
    counts = simulate(DRAFTERS["chain_sampled_far"], seed=5, verifier=recover_from_target)
    assert not joint_fits(counts, EXACT)


def test_statistics_detect_mixed_conventions():
    """Greedy-drafted tokens verified against the draft model's softmax are biased."""

    def greedy_tokens_softmax_probs(prefix, gen):
        proposal = deterministic_tree(top_k_pick(FAR), [1, 1, 1])(prefix, gen)
        parent_tokens = [proposal.token_ids[p] for p in proposal.parents[1:]]
        draft_probs = torch.stack([FAR[0]] + [FAR[t] for t in parent_tokens])  # softmax rows
        return Proposal(proposal.token_ids, proposal.parents, draft_probs=draft_probs)

    counts = simulate(greedy_tokens_softmax_probs, seed=6)
    assert not joint_fits(counts, EXACT)


def test_verify_greedy_equals_one_hot_general_path():
    import random as _random

    from quickdraft.verify.rejection import verify_greedy

    rng = _random.Random(3)
    vocab = 5
    for _ in range(200):
        size = rng.randint(1, 8)
        parents = [-1] + [rng.randrange(i) for i in range(1, size)]
        tokens = [rng.randrange(vocab) for _ in range(size)]
        argmax = [rng.randrange(vocab) for _ in range(size)]
        cap = rng.choice([None, 1, 2, 3])
        proposal = Proposal(token_ids=tokens, parents=parents)
        one_hot = torch.nn.functional.one_hot(torch.tensor(argmax), vocab).float()
        expected = verify_proposal(proposal=proposal, target_probs=one_hot, generator=None, max_new_tokens=cap)
        assert verify_greedy(proposal=proposal, target_argmax=argmax, max_new_tokens=cap) == expected
