"""A smaller model with the target's vocabulary drafts a chain of K tokens per step.

The draft model has its own KV cache, one slot per request, kept in step with the target:

- before drafting, every committed token it has not seen yet (the previous step's
  recovered/bonus token, plus the last draft token after a full accept) is fed as one
  catch-up chunk; the last of them is the root, whose logits give the first draft;
- drafting feeds draft tokens 1..K-1, one forward per depth for all requests at once;
- after verification the cache keeps only what was accepted: a length rollback, no copy.

Greedy requests draft the draft model's argmax (point masses, ``draft_probs=None``).
Sampled requests draw from the draft model's distribution q after the request's own sampling
parameters, in one of two ways (``coupling``):

- ``"keyed"`` (default): with the noise of the drafted token's own output position
  (``sampler.draw_keyed``), the very noise the target's draw at that position uses.  The
  draft is then a point mass that equals the target's draw whenever the two Gumbel races
  agree, and verification follows the target's draws, so a seeded run returns plain
  decoding's tokens.  Measured against the other rule in docs/performance-log.md.
- ``"rejection"``: from a generator of the drafter's own, returning the rows as
  ``draft_probs``, so the rejection sampler accepts with min(1, p/q) and resamples from the
  residual (the acceptance-optimal rule for one sample; exact, but a seeded run's tokens
  then depend on what was drafted).

With ``num_branches > 1`` the proposal is a tree: at every depth the next
``num_branches - 1`` most likely tokens of the draft distribution (other than the chain's
token) become leaf siblings tried after it, at no extra draft forward.  Such top-k picks are
not samples, so a tree proposal is verified as point masses (``draft_probs=None``), which
is exact for any proposal chosen without the verifier's randomness.

A draft model with a reduced vocabulary (``quickdraft train-head --method draft`` writes
one: its directory holds ``draft_vocab.safetensors``) reads the target's tokens mapped into
its vocabulary (tokens outside it share one "other" id) and its logits are spread back over
the target's vocabulary (-inf outside it), so everything downstream works on target ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quickdraft.drafters.base import AcceptedPath, Drafter, DraftRequest, Proposal, TargetInfo
from quickdraft.engine.runner import ModelRunner, SequenceWork
from quickdraft.kv.cache import KVCache
from quickdraft.models.loader import load_decoder, read_draft_vocab, resolve_model_dir
from quickdraft.verify.sampler import (
    RowContext,
    draw_keyed,
    logits_to_probs,
    make_generator,
    position_key,
    sample_from_probs,
)

# Room past max_model_len for the drafted tokens that are fed before verification.
DRAFT_HEADROOM = 64


@dataclass
class _DraftState:
    slot: int
    generator: torch.Generator | None
    context_len: int = 0  # committed tokens when the last proposal was made
    fed_drafts: int = 0  # draft tokens fed into the cache by that proposal
    chain_nodes: list[int] = field(default_factory=list)  # proposal nodes of the fed chain, by depth


class DraftModelDrafter(Drafter):
    def __init__(
        self,
        *,
        num_speculative_tokens: int = 5,
        model: str | None = None,
        target: TargetInfo,
        num_branches: int = 1,
        seed: int = 0,
        coupling: str = "keyed",
    ):
        if not model:
            raise ValueError("method 'draft_model' needs a draft 'model' (HF directory or .gguf file)")
        if not isinstance(num_branches, int) or isinstance(num_branches, bool) or num_branches < 1:
            raise ValueError(f"num_branches must be a positive integer, got {num_branches!r}")
        if coupling not in ("keyed", "rejection"):
            raise ValueError(f"coupling must be 'keyed' or 'rejection', got {coupling!r}")
        self.coupling = coupling
        self.num_speculative_tokens = num_speculative_tokens
        self.num_branches = num_branches
        self.device = target.device
        max_len = target.max_model_len + DRAFT_HEADROOM
        model_dir = resolve_model_dir(model)
        self.model, config = load_decoder(model_dir, dtype=target.dtype, device=target.device, max_len=max_len)
        self.target_vocab_size = target.vocab_size
        self.d2t = read_draft_vocab(model_dir)  # [Vd] or None
        self.t2d: list[int] | None = None
        if self.d2t is not None:
            if config.vocab_size != self.d2t.shape[0] + 1 or int(self.d2t.max()) >= target.vocab_size:
                raise ValueError(
                    f"the draft model's vocabulary ({config.vocab_size} ids) does not match its "
                    f"draft_vocab map ({self.d2t.shape[0]} ids + one for other tokens) and the "
                    f"target's {target.vocab_size}"
                )
            t2d = torch.full((target.vocab_size,), config.vocab_size - 1, dtype=torch.long)
            t2d[self.d2t] = torch.arange(self.d2t.shape[0])
            self.t2d = t2d.tolist()
            self.d2t = self.d2t.to(target.device)
        elif config.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({config.vocab_size} tokens) differs from the "
                f"target's ({target.vocab_size}): a draft model must share the target's tokenizer"
            )
        self.cache = KVCache(
            num_layers=config.num_layers,
            num_slots=target.max_num_seqs,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            max_len=max_len,
            dtype=target.dtype,
            device=target.device,
        )
        self.runner = ModelRunner(model=self.model, cache=self.cache, device=target.device)
        self.seed = seed
        self._states: dict[str, _DraftState] = {}

    # ---- lifecycle --------------------------------------------------------------------
    def begin(self, request: DraftRequest) -> None:
        self._state(request)

    def _state(self, request: DraftRequest) -> _DraftState:
        state = self._states.get(request.request_id)
        if state is None:
            params = request.params
            seed = params.seed if params is not None and params.seed is not None else self.seed + len(self._states)
            # A generator of its own: drafting must not shift the request's target-side draws.
            state = _DraftState(slot=self.cache.allocate(), generator=make_generator(seed + 7919, self.device))
            self._states[request.request_id] = state
        return state

    def finish(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.cache.free(state.slot)

    def catch_up_rows(self, request: DraftRequest) -> int:
        state = self._states.get(request.request_id)  # none yet: its first draft feeds the whole context
        return len(request.token_ids) - (0 if state is None else self.cache.lengths[state.slot])

    def accept(self, request: DraftRequest, accepted: AcceptedPath) -> None:
        state = self._states.get(request.request_id)
        if state is None:
            return
        # Fed: every committed token up to the root, then the chain's drafts 1..fed_drafts;
        # keep those on the accepted path (a path may leave the chain at a side leaf).
        on_chain = 0
        for node, chain_node in zip(accepted.nodes[1:], state.chain_nodes[: state.fed_drafts]):
            if node != chain_node:
                break
            on_chain += 1
        keep = state.context_len + on_chain
        self.cache.commit(state.slot, min(keep, self.cache.lengths[state.slot]))
        state.fed_drafts = 0

    # ---- propose ----------------------------------------------------------------------
    def propose(self, requests: list[DraftRequest]) -> list[Proposal | None]:
        lengths = [self._chain_length(r) for r in requests]
        active = [i for i, k in enumerate(lengths) if k >= 1]
        drafts: dict[int, list[int]] = {i: [] for i in active}
        rows: dict[int, list[torch.Tensor | None]] = {i: [] for i in active}
        side_tokens: dict[int, list[list[int]]] = {i: [] for i in active}
        feed = {i: self._catch_up_tokens(requests[i]) for i in active}
        for depth in range(max(lengths, default=0)):
            active = [i for i in active if depth < lengths[i]]
            if not active:
                break
            logits = self._forward(requests, active, feed)  # [len(active), V]
            for row, i in enumerate(active):
                token, probs = self._choose(requests[i], drafts[i], logits[row : row + 1])
                drafts[i].append(token)
                rows[i].append(probs)
                side_tokens[i].append(self._side_tokens(logits[row], token))
                feed[i] = [token]
        proposals: list[Proposal | None] = []
        for i, request in enumerate(requests):
            if not drafts.get(i):
                proposals.append(None)
                continue
            state = self._states[request.request_id]
            state.context_len = len(request.prompt_token_ids) + len(request.output_token_ids)
            state.fed_drafts = len(drafts[i]) - 1
            self.cache.commit(state.slot, state.context_len + state.fed_drafts)
            proposal, state.chain_nodes = self._build_proposal(request, drafts[i], rows[i], side_tokens[i])
            proposals.append(proposal)
        return proposals

    def _chain_length(self, request: DraftRequest) -> int:
        # A tree spends budget on side leaves: the chain keeps what the budget allows.
        per_depth = self.num_branches
        return min(self.num_speculative_tokens, request.max_depth, request.budget // per_depth)

    def _side_tokens(self, logits: torch.Tensor, chosen: int) -> list[int]:
        # logits [V] -> the next most likely tokens besides the chain's own
        if self.num_branches == 1:
            return []
        top = torch.topk(logits, self.num_branches).indices.tolist()
        return [t for t in top if t != chosen][: self.num_branches - 1]

    def _build_proposal(self, request: DraftRequest, chain: list[int], rows, side_tokens) -> tuple[Proposal, list[int]]:
        """The proposal and the node index of each chain token (the ones the cache holds)."""
        root = request.token_ids[-1]
        if self.num_branches == 1:
            return Proposal.chain(root, chain, draft_probs=self._draft_probs(rows)), list(range(1, len(chain) + 1))
        tokens, parents, chain_nodes = [root], [-1], list[int]()
        for token, sides in zip(chain, side_tokens):
            parent = chain_nodes[-1] if chain_nodes else 0
            chain_nodes.append(len(tokens))
            tokens.append(token)
            parents.append(parent)
            for side in sides:  # leaves tried after the chain's token at this depth
                tokens.append(side)
                parents.append(parent)
        return Proposal(token_ids=tokens, parents=parents), chain_nodes

    def _catch_up_tokens(self, request: DraftRequest) -> list[int]:
        state = self._state(request)
        tokens = request.token_ids
        return tokens[self.cache.lengths[state.slot] :]

    def _forward(self, requests: list[DraftRequest], active: list[int], feed: dict[int, list[int]]) -> torch.Tensor:
        work = []
        for i in active:
            state = self._states[requests[i].request_id]
            tokens = feed[i]
            if self.t2d is not None:
                tokens = [self.t2d[t] for t in tokens]
            work.append(
                SequenceWork(
                    slot=state.slot,
                    cache_len=self.cache.lengths[state.slot],
                    token_ids=tokens,
                    logits_nodes=[len(tokens) - 1],
                )
            )
        out = self.runner.forward(work)
        for item in work:
            self.cache.commit(item.slot, item.cache_len + len(item.token_ids))
        assert out.logits is not None  # every item asks for logits
        return self._target_vocab_logits(out.logits)

    def _target_vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        # logits [M, Vd + 1] -> [M, V]: -inf outside the draft vocabulary ("other" is never drafted)
        if self.d2t is None:
            return logits
        full = logits.new_full((logits.shape[0], self.target_vocab_size), float("-inf"))
        full[:, self.d2t] = logits[:, : self.d2t.shape[0]]
        return full

    def _choose(self, request: DraftRequest, drafted: list[int], logits: torch.Tensor):
        # logits [1, V] -> (token, draft distribution row [V] or None for a greedy point mass)
        params = request.params
        if params is None or params.is_greedy:
            return int(logits[0].argmax()), None
        row = RowContext(
            params=params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids + drafted,
        )
        if self.coupling == "keyed":
            seed = request.seed if request.seed is not None else self.seed
            key = position_key(seed, len(request.output_token_ids) + len(drafted))
            return int(draw_keyed(logits, [row], [key])[0]), None
        probs = logits_to_probs(logits, [row])  # [1, V]
        token = int(sample_from_probs(probs, [self._states[request.request_id].generator])[0])
        return token, probs[0]

    @staticmethod
    def _draft_probs(rows: list[torch.Tensor | None]) -> torch.Tensor | None:
        """[K + 1, V] with an unused root row, or None when the drafts are point masses."""
        present = [row for row in rows if row is not None]
        if not present:
            return None
        assert len(present) == len(rows)  # a chain is drawn one way: all rows or none
        return torch.cat([torch.zeros_like(present[0])[None], torch.stack(present)])
