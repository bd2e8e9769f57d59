"""Medusa drafting: K heads on the target's last hidden state fill a static tree in one pass.

The newest target feature (of the token before the root, the one whose hidden state the
target turned into the root) goes through the K heads; head k's candidates fill depth k of
the tree: a node at depth k with candidate rank r gets head k's r-th best token, whatever
its parent (Medusa's Cartesian tree, given as paths in the ``medusa_choices`` form).
Proposals are top-k picks, so point masses (``draft_probs=None``): exact for greedy and
sampled requests alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quickdraft.drafters.base import AcceptedPath, Drafter, DraftRequest, Proposal, TargetInfo
from quickdraft.drafters.keyed import KeyedDraw, check_coupling, coupled_order
from quickdraft.drafters.tree import StaticTree, default_medusa_paths
from quickdraft.heads import drafting_options, head_precision, resolve_head_dir
from quickdraft.models.layers import default_linear_fn
from quickdraft.models.medusa import MedusaHeads


@dataclass
class _MedusaState:
    last_feature: torch.Tensor | None = None  # [D] feature of the newest cached token
    num_features: int = 0  # target features observed (= tokens in the target's cache)


class MedusaDrafter(Drafter):
    def __init__(
        self,
        *,
        target: TargetInfo,
        head: str | None = None,
        head_dtype: str | None = None,
        num_speculative_tokens: int | None = None,
        tree: str | list | None = None,
        top_k: int | None = None,
        coupling: str = "top_k",
    ):
        """tree, top_k: None takes the heads' recommended value (a shipped head's manifest says
        what was measured best for it), else "default" and 3."""
        self.coupling = check_coupling(coupling)  # sampled requests' rank-0 tokens (drafters/keyed.py)
        self.vocab_size = target.vocab_size
        if target.model is None:
            raise ValueError("the medusa drafter needs the target model (TargetInfo.model)")
        directory = resolve_head_dir(head, method="medusa", model=target.model)
        options = drafting_options(directory, tree=(tree, "default"), top_k=(top_k, 3))
        tree, top_k = options["tree"], options["top_k"]
        dtype, quantization = head_precision(head_dtype, target=target)
        self.heads = MedusaHeads.load(directory, dtype=dtype, device=target.device)
        c = self.heads.config
        if c.hidden_size != target.model.config.hidden_size:
            raise ValueError(
                f"medusa heads' hidden size {c.hidden_size} does not match the target's "
                f"{target.model.config.hidden_size}"
            )
        if c.feature_layer != target.model.config.num_layers - 1:
            raise ValueError(
                f"medusa heads read layer {c.feature_layer}; the target's last layer is "
                f"{target.model.config.num_layers - 1}"
            )
        if int(self.heads.d2t.max()) >= target.vocab_size:
            raise ValueError("the medusa heads' draft vocabulary maps to ids outside the target's vocabulary")
        depth = c.num_heads if num_speculative_tokens is None else num_speculative_tokens
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {depth!r}")
        depth = min(depth, c.num_heads)  # the heads draft no deeper than their count
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
        if tree == "default":
            tree = default_medusa_paths(depth=depth, top_k=top_k)
        elif not isinstance(tree, (list, tuple)):
            raise ValueError(f"tree must be 'default' or a list of paths (medusa_choices form), got {tree!r}")
        self.tree = StaticTree.from_paths(tree)
        if self.tree.max_depth > c.num_heads:
            raise ValueError(f"tree is {self.tree.max_depth} deep; the heads draft {c.num_heads} depths")
        self.heads.attach_target(target.model)
        self.heads.linear = default_linear_fn(target.device)
        if quantization:
            self.heads.quantize_for_drafting(quantization)
        self.feature_layers = self.heads.feature_layers
        self._states: dict[str, _MedusaState] = {}

    def begin(self, request: DraftRequest) -> None:
        self._states[request.request_id] = _MedusaState()

    def finish(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def observe(self, request: DraftRequest, features: torch.Tensor) -> None:  # features [n, D]
        state = self._states[request.request_id]
        state.last_feature = features[-1]
        state.num_features += features.shape[0]

    def accept(self, request: DraftRequest, accepted: AcceptedPath) -> None:
        pass  # the accepted tokens' features arrive through observe

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Proposal | None]:
        ready = [r for r in requests if self._is_ready(r)]
        proposals: dict[str, Proposal | None] = {r.request_id: None for r in requests}
        if ready:
            features = torch.stack([self._last_feature(r) for r in ready])  # [B, D]
            logits = self.heads(features)  # [K, B, Vd]
            width = min(self.tree.max_rank + 1, logits.shape[-1])  # one spare for a keyed draw
            top = torch.topk(logits, width, dim=-1).indices.tolist()  # [K][B][width] columns
            for row, request in enumerate(ready):
                keyed = KeyedDraw.of(request) if self.coupling == "keyed" else None
                candidates = []  # [K][ranks] target ids: head k's tokens for depth k + 1
                for k, head_top in enumerate(top):
                    order = head_top[row]
                    if keyed is not None:
                        order = coupled_order(
                            logits[k, row],
                            self.heads.d2t,
                            order,
                            noise_key=keyed.key(k + 1),
                            temperature=keyed.temperature,
                        )
                    candidates.append(self.heads.d2t[order[: self.tree.max_rank]].tolist())
                proposals[request.request_id] = self._fill_tree(request, candidates)
        return [proposals[r.request_id] for r in requests]

    def _last_feature(self, request: DraftRequest) -> torch.Tensor:  # [D] of a ready request
        feature = self._states[request.request_id].last_feature
        assert feature is not None  # _is_ready
        return feature

    def _is_ready(self, request: DraftRequest) -> bool:
        state = self._states[request.request_id]
        return state.last_feature is not None and state.num_features == len(request.token_ids) - 1

    def _fill_tree(self, request: DraftRequest, candidates: list[list[int]]) -> Proposal | None:
        # candidates [K][ranks]: head k's best tokens
        tree = self.tree.truncated(max_draft_nodes=request.budget, max_depth=request.max_depth)
        if tree is None:
            return None
        tokens = [request.token_ids[-1]] + [
            candidates[depth - 1][rank] for depth, rank in zip(tree.depths[1:], tree.ranks[1:])
        ]
        return Proposal(token_ids=tokens, parents=list(tree.parents))
