"""A request's grammar state: masks for every node of a step's tree, pruning, forced tokens.

Engine: llguidance, chosen by measurement (``benchmarks/grammar_mask_cost.py``, the embedded
262k-token tokenizer, this 2-core machine): a JSON-schema mask costs 28 us median (xgrammar
8 us), a regex mask 150 us (xgrammar 5 us), against a ~20 ms target forward, so either is
<= 1% of a step per tree node; llguidance needs no per-schema compile (1-2 ms vs xgrammar's
~90 ms for the schema), reads our tokenizer's JSON directly with the same Rust tokenizers
(no guess of the vocabulary's byte encoding), computes forced tokens (``compute_ff_tokens``)
and rolls back; it is a 8 MB wheel with no dependencies, where xgrammar requires triton
(1 GB installed) and transformers.  Both take ~5 s once to index a 262k vocabulary
(``GrammarCompiler`` does that lazily, once per engine).

A tree is walked depth first from the committed state: a node's mask is the grammar's
next-token mask after its path; a child whose token its parent's mask forbids is cut with its
subtree (never fed to the target); the matcher rolls back after each subtree, so the
committed state is untouched until ``accept_token`` commits.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import tokenizers
import torch

from quickdraft.drafters.base import Proposal
from quickdraft.kernels.token_mask import apply_token_bitmask
from quickdraft.models.heap import return_free_heap
from quickdraft.structured.params import StructuredOutputsParams


class GrammarCompiler:
    """Builds request matchers over one tokenizer (its llguidance index is made on first use)."""

    def __init__(self, *, tokenizer: tokenizers.Tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer = tokenizer  # serialized for llguidance only when first needed (~100 MB of temporaries)
        self.vocab_size = vocab_size  # the model's: ids past the tokenizer's are never allowed
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()  # one build, whichever thread asks first

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                self._ll_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
                return_free_heap()
            return self._ll_tokenizer

    def prepare_in_background(self) -> None:
        """Build the vocabulary index on a daemon thread (servers call this at start)."""
        threading.Thread(target=lambda: self.ll_tokenizer, name="grammar-index", daemon=True).start()

    def matcher_for(self, params: StructuredOutputsParams, *, ends_at_eos: bool = True) -> RequestGrammar:
        """`ends_at_eos` False: the request goes on after an EOS (ignore_eos), so a tree's nodes
        after one are drafted and masked like any other (the ended grammar allows only EOS)."""
        import llguidance

        matcher = llguidance.LLMatcher(self.ll_tokenizer, params.compiled, log_level=0)
        if matcher.is_error():  # checks that need the vocabulary (e.g. a literal no token can spell)
            raise ValueError(f"structured_outputs.{params.kind} is invalid: {matcher.get_error()}")
        return RequestGrammar(
            matcher=matcher,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids if ends_at_eos else [],
        )


@dataclass
class TreeMasks:
    """A step's tree after the grammar: the kept nodes and the mask after each of them."""

    proposal: Proposal  # the kept nodes, renumbered (parents precede children)
    kept: list[int]  # [num kept] the proposal's node of each kept node; -1 for an appended forced token
    bitmask: torch.Tensor  # [num kept, ceil(V / 32)] int32: bit t of row i = token t allowed after node i
    unmasked: list[int]  # kept nodes (new numbering) whose rows stay as they are: after EOS nothing
    # follows; a sampled chain's forbidden last node is never accepted, its row never read
    # Per kept node, the allowed token ids when there are at most SPARSE_ROW_LIMIT of them (a
    # schema's keys and punctuation): the engine then computes only those logits, not the
    # 262k-row LM head; None where the row is computed whole.
    sparse_tokens: list[list[int] | None] = field(default_factory=list)


# Rows that allow at most this many tokens get only those logits (a dot product each, on
# dequantized LM-head rows) instead of the whole LM head: in JSON extraction ~70% of the rows
# allow <= 64 tokens and ~40% exactly one (benchmarks/structured_outputs.py).
SPARSE_ROW_LIMIT = 256


def sparse_token_lists(bitmask: torch.Tensor, *, skip: set[int], limit: int) -> list[list[int] | None]:
    """Per row of bitmask [R, W] int32, its allowed token ids if there are at most `limit`."""
    nonzero_words = (bitmask != 0).sum(dim=1).tolist()  # [R]: a lower bound of the allowed count
    result: list[list[int] | None] = []
    for row, words in enumerate(nonzero_words):
        if row in skip or words > limit:  # most of a free position's vocabulary: skipped cheaply
            result.append(None)
            continue
        ids = []
        for word in bitmask[row].nonzero().flatten().tolist():
            bits = int(bitmask[row, word]) & 0xFFFFFFFF
            ids += [word * 32 + bit for bit in range(32) if (bits >> bit) & 1]
        result.append(ids if len(ids) <= limit else None)
    return result


@dataclass
class _Walk:
    """A walk's growing result, in the new numbering (node 0 = the root)."""

    proposal: Proposal
    masks: torch.Tensor  # [capacity, ceil(V / 32)] int32: row i = the mask after new node i
    sampled: bool  # draft_probs given: keep the first forbidden token (see walk)
    extend_left: int  # forced tokens that may still be appended at leaves
    max_depth: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    origin: list[int] = field(default_factory=list)  # the proposal's node, or -1 for an appended forced token
    unmasked: list[int] = field(default_factory=list)

    def add(self, token: int, *, parent: int, origin: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1 if parent >= 0 else 0)
        self.origin.append(origin)
        return len(self.tokens) - 1


class RequestGrammar:
    """One request's matcher, advanced by the committed output tokens only."""

    def __init__(self, *, matcher, vocab_size: int, eos_token_ids: list[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.words = (vocab_size + 31) // 32

    def accept_token(self, token_id: int) -> None:
        """A committed output token; the masks allowed it, so a refusal is an engine bug."""
        if not self.matcher.consume_token(token_id):
            raise RuntimeError(f"the grammar refused committed token {token_id}: {self.matcher.get_error()}")

    def forced_tokens(self, limit: int) -> list[int]:
        """The tokens the grammar allows as the only continuation from the committed state."""
        return self.matcher.compute_ff_tokens()[:limit] if limit > 0 else []

    def walk(self, proposal: Proposal, *, extend: int = 0, max_depth: int = 1 << 30) -> TreeMasks:
        """Masks for the proposal's nodes, forbidden children cut with their subtrees; with
        `extend` > 0, up to that many forced tokens appended after the kept leaves (each leaf's
        path continued by what the grammar then allows alone), no node deeper than `max_depth`.

        A sampled proposal (``draft_probs``: a draft model's chain) keeps its first forbidden
        token as its last node: rejecting it updates the target's row to max(p - q, 0), which
        the exact rule needs; its probability under the masked row is 0, so it is never accepted.
        Sampled proposals are not extended (their nodes all carry a draft distribution).
        """
        sampled = proposal.draft_probs is not None
        extend = 0 if sampled else extend
        walk = _Walk(
            proposal=proposal,
            masks=torch.empty(proposal.tree.num_nodes + extend, self.words, dtype=torch.int32),
            sampled=sampled,
            extend_left=extend,
            max_depth=max_depth,
        )
        walk.add(proposal.token_ids[0], parent=-1, origin=0)
        self._fill(walk.masks[0])
        self._visit(walk, 0, 0)
        kept = torch.tensor(walk.origin)
        pruned = Proposal(
            token_ids=walk.tokens,
            parents=walk.parents,
            draft_probs=None if proposal.draft_probs is None else proposal.draft_probs[kept],
        )
        bitmask = walk.masks[: len(walk.tokens)]
        return TreeMasks(
            proposal=pruned,
            kept=walk.origin,
            bitmask=bitmask,
            unmasked=walk.unmasked,
            sparse_tokens=sparse_token_lists(bitmask, skip=set(walk.unmasked), limit=SPARSE_ROW_LIMIT),
        )

    def _visit(self, walk: _Walk, node: int, new: int) -> None:
        """Keeps the allowed children of the proposal's `node` (new node `new`, whose path the
        matcher holds) and their subtrees; a leaf gets the forced tokens after it."""
        proposal = walk.proposal
        kept_a_child = False
        for child in proposal.tree.children[node]:
            token = proposal.token_ids[child]
            allowed = bool((int(walk.masks[new, token // 32]) >> (token % 32)) & 1)
            if not allowed and not walk.sampled:
                continue
            kept_a_child = True
            child_new = walk.add(token, parent=new, origin=child)
            if not allowed:  # a sampled chain's first forbidden token: kept as its last node
                walk.unmasked.append(child_new)
                return
            if token in self.eos_token_ids:  # the request ends there: nothing after it is verified
                walk.unmasked.append(child_new)
                continue
            recorded = self._advance(token)
            self._fill(walk.masks[child_new])
            self._visit(walk, child, child_new)
            self.matcher.rollback(int(recorded))
        if not kept_a_child:
            self._extend(walk, new)

    def _extend(self, walk: _Walk, leaf: int) -> None:
        """Appends, after `leaf` (the matcher holds its path), the tokens the grammar forces."""
        room = min(walk.extend_left, walk.max_depth - walk.depths[leaf])
        if room <= 0:
            return
        forced = [t for t in self.matcher.compute_ff_tokens()[:room] if t not in self.eos_token_ids]
        parent, recorded = leaf, 0
        for token in forced:
            recorded += self._advance(token)
            parent = walk.add(token, parent=parent, origin=-1)
            self._fill(walk.masks[parent])
        walk.extend_left -= len(forced)
        self.matcher.rollback(recorded)

    def _advance(self, token: int) -> bool:
        """Consumes a token the mask allowed; False where the grammar had ended (its mask allows
        only EOS, which a request that ignores EOS goes on with): the matcher then records
        nothing, so there is nothing to roll back."""
        if self.matcher.is_stopped():
            return False
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token} its mask allowed: {self.matcher.get_error()}")
        return True

    def _fill(self, row: torch.Tensor) -> None:  # row [ceil(V / 32)] int32, contiguous
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


@torch.inference_mode()  # the target's logits are inference tensors
def apply_masks(
    logits: torch.Tensor,  # [N, V] the rows of one request's kept nodes (those of `nodes`), masked in place
    masks: TreeMasks,
    *,
    nodes: slice | None = None,  # which kept nodes the rows are; None: all of them
) -> None:
    """Forbidden tokens get -inf: every later use of the rows (argmax, keyed draws, rejection
    sampling, logprobs) sees the constrained distribution."""
    bitmask = masks.bitmask  # [num kept, ceil(V / 32)] int32
    if masks.unmasked:
        bitmask[torch.tensor(masks.unmasked)] = -1
    apply_token_bitmask(logits, bitmask if nodes is None else bitmask[nodes])
