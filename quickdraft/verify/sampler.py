"""Target logits -> per-row probabilities -> tokens.

``logits_to_probs`` is the single definition of "the distribution we sample from" for a
row. Plain decoding samples from it, and the rejection sampler (lossless speculative
decoding) compares draft probabilities against it, so both must see exactly the same
numbers. A *row* is one position to sample: during speculation several rows of one
request sit at different tree positions and therefore have different token histories,
which is why penalties take the history per row (``RowContext``), not per request.

Order of processing in ``logits_to_probs`` (all in float32 on a copy of the logits):

0. ``allowed_token_ids``: every other token gets ``-inf`` (a row where that would leave nothing
   -- a structured output's grammar allowing none of them -- keeps the grammar's tokens: the
   constraint wins); ``bad_words``: the last token of a word whose other tokens end the row's
   history gets ``-inf`` (the same exception); then ``logit_bias`` adds each listed token's
   bias (vLLM's order: these before the penalties).
1. Penalties on the raw logits (rows that use them):
   a. repetition penalty (vLLM / HF): for every distinct token in prompt + output, a
      positive logit is divided by the penalty, a negative one multiplied by it;
   b. frequency and presence penalties (OpenAI), over output tokens only:
      ``logit -= frequency * count + presence * (count > 0)``.
2. ``min_tokens``: while ``len(output) < min_tokens``, ``stop_token_ids`` and the EOS ids
   (unless ``ignore_eos``, as in vLLM: then EOS does not stop anyway) get ``-inf`` -- except in a
   row where nothing else is left (a structured output's grammar that only allows stopping).
3. Greedy rows (temperature 0) become an exact one-hot of the argmax (ties -> lowest
   index, as ``torch.argmax``). top_k / top_p / min_p do not apply to them.
4. Other rows: weights ``exp(z - max z)``, ``z = logits / temperature``, in float32 by a fixed
   polynomial (``exp_nonpositive``: the same bits on every CPU, GPU and in the C++ keyed draw),
   then
   a. top_k: keep tokens whose weight is >= the k-th largest (ties at the boundary
      are all kept, as in vLLM and HF); top_k >= V is off;
   b. top_p: on the weights left by top_k, keep the smallest prefix of the sorted
      distribution whose mass reaches ``top_p * kept mass`` (float64 sums: the kept mass as eight
      interleaved running sums, the prefix in sorted order); the most likely token is always kept and
      tokens tied with the last kept one are kept too (a value threshold, so the result does
      not depend on how a sort orders ties);
   c. min_p: drop tokens with ``weight < min_p * max weight`` (the ratio is unchanged by the
      renormalisations, so this equals vLLM's min_p-first order);
   d. ``logits_to_probs`` divides by the sum; a keyed draw races the weights as they are.

Rows that use no penalty and no filter take a fast path: no sort. top_k alone
uses ``torch.topk``; top_p reuses the top-k values when top_k is set, otherwise looks at the
top 1024 values first and sorts the whole vocabulary only for rows whose nucleus is larger.
Work is vectorised over the rows that use a stage, with per-row parameter tensors; Python
loops run over rows and over token histories, never over the vocabulary.

Position-keyed draws (``draw_keyed``: plain sampled decoding and the verification of sampled
requests) race the weights against a counter-based Exp(1) noise of (key, token id); on the CPU
``kernels/csrc/keyed_draw.cpp`` does all of step 4 and the race in one pass, with the bits of
``sampling_weights`` + ``sample_keyed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quickdraft.kernels.argmax import argmax_rows
from quickdraft.kernels.keyed_draw import keyed_draw_rows, row_logprobs, sampling_weights_rows
from quickdraft.sampling_params import SamplingParams

# Tests set this to True to push every row through every stage (with the stage's "off"
# value), checking that the fast path computes the same distribution as the slow one.
_ALWAYS_SLOW = False


@dataclass(frozen=True)
class RowContext:
    params: SamplingParams
    prompt_token_ids: Sequence[int]  # the request's prompt
    output_token_ids: Sequence[int]  # generated so far for this row (committed + drafted ancestors)


# --------------------------------------------------------------------------------------
# logits -> probabilities
# --------------------------------------------------------------------------------------


def logits_to_probs(
    logits: torch.Tensor,  # [R, V], any float dtype
    rows: Sequence[RowContext],
    *,
    eos_token_ids: Sequence[int] = (),
) -> torch.Tensor:  # [R, V] float32
    if logits.dim() != 2:
        raise ValueError(f"logits must be [R, V], got shape {tuple(logits.shape)}")
    num_rows, vocab = logits.shape
    if len(rows) != num_rows:
        raise ValueError(f"got {len(rows)} RowContexts for {num_rows} logit rows")

    logits = _penalized_logits(logits, rows, eos_token_ids=eos_token_ids)
    greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
    if len(greedy) == num_rows:
        return _one_hot_argmax(logits)

    probs = torch.zeros(num_rows, vocab, dtype=torch.float32, device=logits.device)  # [R, V]
    if greedy:
        greedy_idx = _index(greedy, logits.device)
        probs[greedy_idx] = _one_hot_argmax(logits[greedy_idx])

    sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    sampled_params = [rows[i].params for i in sampled]
    all_sampled = len(sampled) == num_rows
    sampled_idx = _index(sampled, logits.device)
    x = logits if all_sampled else logits[sampled_idx]  # [N, V]
    weights = sampling_weights(x, sampled_params)  # [N, V]
    sampled_probs = weights / weights.sum(dim=-1, keepdim=True)  # [N, V] float32
    if all_sampled:
        return sampled_probs
    probs[sampled_idx] = sampled_probs
    return probs


def _penalized_logits(
    logits: torch.Tensor,  # [R, V] any float dtype
    rows: Sequence[RowContext],  # [R]
    *,
    eos_token_ids: Sequence[int],
) -> torch.Tensor:  # [R, V] float32
    """Steps 0 to 2 (allowed tokens and biases, penalties, min_tokens), on a copy only for rows
    that need them."""
    logits = logits.to(torch.float32)
    if any(_modifies_logits(row) for row in rows):
        # .to() returns the caller's tensor when it is already float32; never write into it.
        logits = logits.clone().contiguous()
        _apply_allowed_tokens(logits, rows)
        _apply_bad_words(logits, rows)
        _apply_logit_bias(logits, rows)
        _apply_penalties(logits, rows)
        _apply_min_tokens(logits, rows, eos_token_ids=eos_token_ids)
    return logits


def sampling_weights(
    logits: torch.Tensor,  # [N, V] float32 (penalties applied), rows that sample
    params: Sequence[SamplingParams],  # [N], temperature > 0
) -> torch.Tensor:  # [N, V] float32, the largest of each row exactly 1
    """A sampled row's distribution, unnormalised: ``exp(z - max z)`` with ``z = logits / T``,
    then top_k, top_p and min_p.  ``logits_to_probs`` divides it by its sum, keyed draws race
    it as it is, and ``kernels/csrc/keyed_draw.cpp`` computes the very same bits in one pass."""
    if bool((~torch.isfinite(logits).any(dim=-1)).any()) or bool(torch.isnan(logits).any()):
        raise ValueError("every sampled row needs a finite logit and no NaN")
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)  # [N]
    z = logits / temps.unsqueeze(1)  # [N, V]
    weights = exp_nonpositive(z - z.amax(dim=-1, keepdim=True))
    _apply_filters(weights, params)
    return weights


# exp by Cephes' expf polynomial in float32 operations, one rounding each: torch's own exp
# differs between CPUs, builds and devices, and the C++ keyed draw must compute the same bits.
_EXP_CUTOFF = -86.0  # below: weight 0 (< 5e-38 of the top token; the result stays a normal float)
_LOG2E = 1.44269504088896341
_LN2_HI = 0.693359375
_LN2_LO = -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def exp_nonpositive(d: torch.Tensor) -> torch.Tensor:  # [..] float32 <= 0 (or -inf) -> exp(d), float32
    dc = d.clamp(min=_EXP_CUTOFF)
    n = torch.floor(dc * _LOG2E + 0.5)
    r = dc - n * _LN2_HI
    r = r - n * _LN2_LO
    rr = r * r
    p = r * _EXP_POLY[0] + _EXP_POLY[1]
    for coefficient in _EXP_POLY[2:]:
        p = p * r + coefficient
    p = p * rr + r
    p = p + 1.0
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)  # 2^n, n >= -124
    return torch.where(d >= _EXP_CUTOFF, p * scale, torch.zeros((), dtype=torch.float32, device=d.device))


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:  # [N, V] -> [N, V] float32
    out = torch.zeros_like(logits, dtype=torch.float32)
    out.scatter_(1, argmax_rows(logits)[:, None], 1.0)  # argmax ties -> lowest index
    return out


def _index(rows: Sequence[int], device: torch.device) -> torch.Tensor:  # [N] int64
    return torch.tensor(rows, dtype=torch.long, device=device)


# ---- penalties and min_tokens (step 1 and 2) -----------------------------------------


def _uses_repetition(params: SamplingParams) -> bool:
    return _ALWAYS_SLOW or params.repetition_penalty != 1.0


def _uses_output_penalties(params: SamplingParams) -> bool:
    return _ALWAYS_SLOW or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def _blocks_stops(row: RowContext) -> bool:
    return len(row.output_token_ids) < row.params.min_tokens


def _modifies_logits(row: RowContext) -> bool:
    p = row.params
    return (
        _uses_repetition(p)
        or _uses_output_penalties(p)
        or _blocks_stops(row)
        or bool(p.logit_bias)
        or p.allowed_token_ids is not None
        or bool(p.bad_words_token_ids)
    )


def modifies_logits(params: SamplingParams, *, num_output_tokens: int) -> bool:
    """Whether penalties or min_tokens change the logits of a row with this many outputs."""
    return _modifies_logits(RowContext(params=params, prompt_token_ids=(), output_token_ids=range(num_output_tokens)))


def samples_by_argmax(params: SamplingParams, *, num_output_tokens: int) -> bool:
    """Greedy with raw logits: the row's distribution is a one-hot of ``logits.argmax()``, so
    callers may take the argmax without building it."""
    return params.is_greedy and not modifies_logits(params, num_output_tokens=num_output_tokens)


def _flat_keys(
    per_row_ids: Sequence[tuple[int, Sequence[int] | torch.Tensor]],  # (row, token ids) pairs
    vocab: int,
    device: torch.device,
) -> torch.Tensor:  # [T] int64: row * V + token, an index into logits.view(-1)
    """Flattened (row, token) indices, so one gather/scatter serves all rows at once."""
    parts = []
    for row, ids in per_row_ids:
        ids_t = _as_ids(ids)
        if ids_t.numel() == 0:
            continue
        lo, hi = int(ids_t.min()), int(ids_t.max())
        if lo < 0 or hi >= vocab:
            # An out-of-range id would silently land in a neighbouring row.
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} out of range for vocabulary size {vocab}")
        parts.append(ids_t + row * vocab)
    if not parts:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.cat(parts).to(device)  # one host-to-device copy for all rows


def _apply_penalties(logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
    """In place on contiguous float32 ``logits`` [R, V]."""
    vocab = logits.shape[1]
    flat = logits.view(-1)  # [R * V]
    device = logits.device

    rep_rows = [i for i, row in enumerate(rows) if _uses_repetition(row.params)]
    if rep_rows:
        keys = _flat_keys(
            [(i, _history_ids(rows[i])) for i in rep_rows],
            vocab,
            device,
        )
        keys = torch.unique(keys)  # each distinct token is penalised once
        penalty = _per_row_values(rows, lambda p: p.repetition_penalty, device)[keys // vocab]
        vals = flat[keys]
        flat[keys] = torch.where(vals > 0, vals / penalty, vals * penalty)

    out_rows = [i for i, row in enumerate(rows) if _uses_output_penalties(row.params)]
    if out_rows:
        keys = _flat_keys([(i, rows[i].output_token_ids) for i in out_rows], vocab, device)
        keys, counts = torch.unique(keys, return_counts=True)  # counts >= 1 by construction
        row_of_key = keys // vocab
        freq = _per_row_values(rows, lambda p: p.frequency_penalty, device)[row_of_key]
        pres = _per_row_values(rows, lambda p: p.presence_penalty, device)[row_of_key]
        flat[keys] -= freq * counts.to(torch.float32) + pres


def _apply_allowed_tokens(logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
    """In place: -inf outside each row's allowed_token_ids, unless nothing finite would be left."""
    limited = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None]
    if not limited:
        return
    vocab = logits.shape[1]  # a drafter's vocabulary may be smaller than the target's
    # keys into the limited rows only ([L, V]), the j-th of them being row limited[j]
    allowed = [(j, [t for t in rows[i].params.allowed_token_ids or () if t < vocab]) for j, i in enumerate(limited)]
    keep = torch.full((len(limited), vocab), float("-inf"), device=logits.device)  # [L, V]
    keep.view(-1)[_flat_keys(allowed, vocab, logits.device)] = 0.0
    index = _index(limited, logits.device)
    limited_logits = logits[index]  # [L, V]
    masked = limited_logits + keep
    alive = torch.isfinite(masked).any(dim=1, keepdim=True)  # [L, 1]
    logits[index] = torch.where(alive, masked, limited_logits)


def _apply_bad_words(logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
    """In place: -inf at the last token of each bad word whose other tokens end the row's
    history (a one-token word: always), unless nothing finite would be left."""
    vocab = logits.shape[1]  # a drafter's vocabulary may be smaller than the target's
    for i, row in enumerate(rows):
        words = row.params.bad_words_token_ids
        if not words:
            continue
        history = row.output_token_ids
        banned = [
            word[-1]
            for word in words
            if word[-1] < vocab
            and len(word) - 1 <= len(history)
            and list(history[len(history) - len(word) + 1 :]) == word[:-1]
        ]
        if not banned:
            continue
        masked = logits[i].clone()  # [V]
        masked[torch.tensor(banned, device=logits.device)] = float("-inf")
        if torch.isfinite(masked).any():
            logits[i] = masked


def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
    """In place: each row's logit_bias added to its tokens' logits."""
    vocab = logits.shape[1]  # a drafter's vocabulary may be smaller than the target's
    biased = [
        (i, {t: v for t, v in (row.params.logit_bias or {}).items() if t < vocab})
        for i, row in enumerate(rows)
        if row.params.logit_bias
    ]
    if not biased:
        return
    keys = _flat_keys([(i, list(bias)) for i, bias in biased], vocab, logits.device)
    values = torch.tensor([v for _, bias in biased for v in bias.values()], dtype=torch.float32)
    logits.view(-1)[keys] += values.to(logits.device)


def _apply_min_tokens(logits: torch.Tensor, rows: Sequence[RowContext], *, eos_token_ids: Sequence[int]) -> None:
    """In place: forbid stopping tokens while a row has fewer than min_tokens outputs."""
    blocked = []
    for i, row in enumerate(rows):
        if not _blocks_stops(row):
            continue
        ids = list(row.params.stop_token_ids or [])
        if not row.params.ignore_eos:
            ids += list(eos_token_ids)
        blocked.append((i, ids))
    if blocked:
        keys = _flat_keys(blocked, logits.shape[1], logits.device)
        saved = logits.view(-1)[keys]
        logits.view(-1)[keys] = float("-inf")
        # A row left with no finite logit (a grammar that allows only stopping here) keeps its
        # stopping tokens: the constraint wins over min_tokens, rather than a row with no token.
        dead = ~torch.isfinite(logits[_index([i for i, _ in blocked], logits.device)]).any(dim=1)  # [B]
        if bool(dead.any()):
            dead_rows = {blocked[j][0] for j in dead.nonzero().flatten().tolist()}
            restore = torch.tensor([int(key) // logits.shape[1] in dead_rows for key in keys.tolist()])
            logits.view(-1)[keys[restore.to(keys.device)]] = saved[restore.to(saved.device)]


def _as_ids(ids: Sequence[int] | torch.Tensor) -> torch.Tensor:  # [T] int64 on the CPU
    return torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu()


def _history_ids(row: RowContext) -> torch.Tensor:  # [prompt + output] int64
    return torch.cat([_as_ids(row.prompt_token_ids), _as_ids(row.output_token_ids)])


def _per_row_values(rows: Sequence[RowContext], get, device: torch.device) -> torch.Tensor:  # [R]
    values = [float(get(row.params)) for row in rows]
    return torch.tensor(values, dtype=torch.float32, device=device)


# ---- top_k / top_p / min_p (step 4) ---------------------------------------------------


def _effective_top_k(params: SamplingParams, vocab: int) -> int:
    """top_k as a count in [1, V]; V means off (0, -1 and k >= V all keep everything)."""
    return params.top_k if 0 < params.top_k < vocab else vocab


def _uses_top_k(params: SamplingParams, vocab: int) -> bool:
    return _ALWAYS_SLOW or _effective_top_k(params, vocab) < vocab


def _uses_top_p(params: SamplingParams) -> bool:
    return _ALWAYS_SLOW or params.top_p < 1.0


def _filter_weights(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:  # [F, V] -> [F, V]
    """sampling_weights' bits; on the CPU from the C++ keyed draw's pass (~10x faster)."""
    weights = sampling_weights_rows(logits, **_kernel_row_params(params, logits.shape[1]))
    return weights if weights is not None else sampling_weights(logits, params)


def _kernel_row_params(params: Sequence[SamplingParams], vocab: int) -> dict[str, list]:
    """The per-row settings the C++ keyed-draw kernel takes (kernels/keyed_draw.py)."""
    return {
        "temperature": [p.temperature for p in params],
        "top_k": [_effective_top_k(p, vocab) for p in params],
        "top_p": [p.top_p for p in params],
        "min_p": [p.min_p for p in params],
    }


def _uses_filters(params: SamplingParams, vocab: int) -> bool:
    return _uses_top_k(params, vocab) or _uses_top_p(params) or _uses_min_p(params)


def _uses_min_p(params: SamplingParams) -> bool:
    return _ALWAYS_SLOW or params.min_p > 0.0


def _apply_filters(probs: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """In place on ``probs`` [N, V] (weights, one row per params entry; not renormalised)."""
    vocab = probs.shape[1]
    device = probs.device
    k_rows = [i for i, p in enumerate(params) if _uses_top_k(p, vocab)]
    p_rows = [i for i, p in enumerate(params) if _uses_top_p(p)]
    m_rows = [i for i, p in enumerate(params) if _uses_min_p(p)]
    if not (k_rows or p_rows or m_rows):
        return  # fast path: nothing to filter

    # Sorted top-k values of the top_k rows, reused by top_p (no full-vocabulary sort).
    topk_prefix: _TopKPrefix | None = None
    if k_rows:
        idx = _index(k_rows, device)
        ks = torch.tensor([_effective_top_k(params[i], vocab) for i in k_rows], device=device)
        kept, sorted_vals, kth = top_k_filter(probs[idx], ks)
        probs[idx] = kept
        topk_prefix = _TopKPrefix(position={row: j for j, row in enumerate(k_rows)}, sorted_vals=sorted_vals, kth=kth)

    if p_rows:
        _apply_top_p_rows(probs, params, p_rows, topk_prefix)

    if m_rows:
        idx = _index(m_rows, device)
        min_p = torch.tensor([params[i].min_p for i in m_rows], dtype=torch.float32, device=device)
        probs[idx] = min_p_filter(probs[idx], min_p)


@dataclass
class _TopKPrefix:
    position: dict[int, int]  # row of probs -> row of sorted_vals / kth
    sorted_vals: torch.Tensor  # [K, max k] descending kept values (zeros past a row's cut)
    kth: torch.Tensor  # [K] k-th largest value per row


def _apply_top_p_rows(
    probs: torch.Tensor,  # [N, V], modified in place
    params: Sequence[SamplingParams],
    p_rows: Sequence[int],
    topk_prefix: _TopKPrefix | None,
) -> None:
    device = probs.device
    position = topk_prefix.position if topk_prefix is not None else {}
    with_k = [i for i in p_rows if i in position]
    without_k = [i for i in p_rows if i not in position]

    if without_k:
        idx = _index(without_k, device)
        top_p = torch.tensor([params[i].top_p for i in without_k], dtype=torch.float64, device=device)
        probs[idx] = top_p_filter(probs[idx], top_p)

    if with_k:
        assert topk_prefix is not None  # with_k rows are the prefix's
        # After top_k a row keeps its sorted top-k values plus, possibly, ties equal to the
        # k-th value beyond them; so the top-k prefix stands in for the full sort, and if
        # top_p is not reached inside it the cut is the k-th value itself.
        pos = _index([position[i] for i in with_k], device)
        idx = _index(with_k, device)
        sub = probs[idx]  # [M, V], already top-k filtered
        top_p = torch.tensor([params[i].top_p for i in with_k], dtype=torch.float64, device=device)
        threshold, reached = _top_p_cut(topk_prefix.sorted_vals[pos], total=_lane_sum(sub), top_p=top_p)
        threshold = torch.where(reached, threshold, topk_prefix.kth[pos])
        probs[idx] = sub.masked_fill(sub < threshold.unsqueeze(1), 0.0)


def top_k_filter(
    probs: torch.Tensor,  # [N, V]
    top_k: torch.Tensor,  # [N] int64 in [1, V]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero every token below the k-th largest probability (ties with it are kept).

    Returns (filtered probs [N, V], sorted kept top values [N, max k] with entries past a
    row's own cut zeroed, k-th value per row [N]).
    """
    k_max = int(top_k.max())
    values = torch.topk(probs, k_max, dim=-1, sorted=True).values  # [N, k_max], descending
    kth = values.gather(1, (top_k - 1).unsqueeze(1))  # [N, 1]
    filtered = probs.masked_fill(probs < kth, 0.0)
    values = values.masked_fill(values < kth, 0.0)
    return filtered, values, kth.squeeze(1)


# top_p first looks at this many top values; usually the nucleus is inside, and the full
# vocabulary sort is only needed for the rows where it is not.
_TOP_P_PROBE = 1024


def top_p_filter(
    probs: torch.Tensor,  # [N, V], non-negative (need not sum to 1)
    top_p: torch.Tensor,  # [N] in (0, 1]
) -> torch.Tensor:  # [N, V]
    """Keep the smallest most-likely prefix whose mass reaches ``top_p`` of the row's mass."""
    _num_rows, vocab = probs.shape
    total = _lane_sum(probs)  # [N]
    probe = min(vocab, _TOP_P_PROBE)
    prefix = torch.topk(probs, probe, dim=-1, sorted=True).values  # [N, probe] descending
    threshold, reached = _top_p_cut(prefix, total=total, top_p=top_p)
    if probe < vocab and not bool(reached.all()):
        rest = (~reached).nonzero().flatten()  # [M]
        full = torch.sort(probs[rest], dim=-1, descending=True).values  # [M, V]
        rest_threshold, rest_reached = _top_p_cut(full, total=total[rest], top_p=top_p[rest])
        threshold[rest] = rest_threshold
        reached[rest] = rest_reached
    # Only float rounding (cum[-1] vs total, top_p = 1) can leave a full sort short of the
    # target; the whole row is then the nucleus.
    threshold = torch.where(reached, threshold, torch.zeros_like(threshold))
    return probs.masked_fill(probs < threshold.unsqueeze(1), 0.0)


def _lane_sum(values: torch.Tensor) -> torch.Tensor:  # [N, V] -> [N] float64
    """Each row's float64 sum as the C++ keyed draw adds it: eight running sums over the entries
    i = l (mod 8), then added in lane order (a CPU cumsum is one running sum; torch.sum groups the
    terms its own way)."""
    x = values.double()
    pad = -x.shape[1] % 8
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))  # adding 0.0 changes no sum
    lanes = x.view(x.shape[0], -1, 8).cumsum(dim=1)[:, -1, :]  # [N, 8]
    return lanes.cumsum(dim=1)[:, -1]


def _top_p_cut(
    sorted_vals: torch.Tensor,  # [N, L] descending prefix of each row's values
    *,
    total: torch.Tensor,  # [N] float64 mass of the whole row
    top_p: torch.Tensor,  # [N]
) -> tuple[torch.Tensor, torch.Tensor]:  # threshold [N] (keep prob >= it), reached [N] bool
    """Value of the entry where the running mass first reaches ``top_p * total``.

    float64 sums: the test "mass reaches top_p" is then exact for exactly representable
    inputs, and float32 rounding over 262144 terms would move the boundary.
    """
    cum = sorted_vals.double().cumsum(dim=-1)  # [N, L], non-decreasing
    target = (top_p.double() * total).unsqueeze(1)  # [N, 1]
    # cum is monotone, so the first index with cum >= target is the count of cum < target.
    first = (cum < target).sum(dim=-1)  # [N] in [0, L]
    reached = first < sorted_vals.shape[1]
    at_cut = sorted_vals.gather(1, first.clamp(max=sorted_vals.shape[1] - 1).unsqueeze(1))
    return at_cut.squeeze(1), reached


def min_p_filter(
    probs: torch.Tensor,  # [N, V]
    min_p: torch.Tensor,  # [N] in [0, 1]
) -> torch.Tensor:  # [N, V]
    """Zero tokens with probability < min_p * (max probability of the row)."""
    cutoff = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [N, 1]
    return probs.masked_fill(probs < cutoff, 0.0)


# --------------------------------------------------------------------------------------
# randomness
# --------------------------------------------------------------------------------------


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded for one request, or None (use the global RNG) when unseeded."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def sample_from_probs(
    probs: torch.Tensor,  # [R, V] non-negative weights (need not be normalised)
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:  # [R] int64
    """One draw per row, each row from its own generator (None = the global RNG).

    Exponential race: ``argmax_i p_i / E_i`` with ``E_i ~ Exp(1)`` i.i.d. picks ``i`` with
    probability ``p_i / sum(p)`` exactly (this is also what ``torch.multinomial`` does for
    one sample). Each row consumes only its own generator, so a seeded row draws the same
    token whatever else is in the batch. A row with a single non-zero entry (greedy
    one-hot, or top_k=1) returns it without drawing, so its generator is not advanced.
    """
    if probs.dim() != 2:
        raise ValueError(f"probs must be [R, V], got shape {tuple(probs.shape)}")
    num_rows, vocab = probs.shape
    if len(generators) != num_rows:
        raise ValueError(f"got {len(generators)} generators for {num_rows} rows")

    nonzero = (probs > 0).sum(dim=-1)  # [R]
    if bool((nonzero == 0).any()):
        raise ValueError("every row of probs needs a positive entry")
    out = probs.argmax(dim=-1)  # [R]; final for deterministic rows
    random_rows = (nonzero > 1).nonzero().flatten().tolist()
    if not random_rows:
        return out

    # float64 weights (e.g. residual distributions) are raced in float64, so tiny weights
    # do not underflow to zero.
    dtype = torch.float64 if probs.dtype == torch.float64 else torch.float32
    race = torch.empty(len(random_rows), vocab, dtype=dtype, device=probs.device)  # [N, V]
    for j, r in enumerate(random_rows):
        race[j].exponential_(generator=generators[r])
    # Exp(1) draws are never 0 in current torch, but a 0 would make 0/0 = NaN win argmax.
    race.clamp_(min=torch.finfo(dtype).tiny)
    idx = _index(random_rows, probs.device)
    out[idx] = (probs[idx].to(dtype) / race).argmax(dim=-1)
    return out


def position_key(seed: int, position: int) -> int:
    """The noise key of output position `position` of a request seeded `seed`: splitmix64 of
    the pair, so a position's randomness depends on (seed, position) alone, never on what was
    drawn or drafted before it."""
    mask = (1 << 64) - 1

    def mix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    return mix(mix(seed & mask) ^ (position & mask))


_MASK32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:  # int64 holding uint32 values
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32  # int64 products wrap; their low 32 bits are the uint32 ones
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def keyed_uniform(key: int, token_ids: torch.Tensor) -> torch.Tensor:  # [C] int64 -> [C] float64 in (0, 1)
    """The uniform of each token id under `key`: a 32-bit hash of (key, id), ``(h + 0.5) / 2^32``.
    Counter-based, so any subset of the vocabulary costs only its own ids (as in the C++ draw)."""
    a = (token_ids * 0x9E3779B9 + (key & _MASK32)) & _MASK32
    h = _fmix32(_fmix32(a) ^ ((key >> 32) & _MASK32))
    return (h.double() + 0.5) * 2.0**-32


def keyed_noise(key: int, vocab: int, *, device: torch.device | str = "cpu") -> torch.Tensor:  # [V] float64
    """Exp(1) noise of one key over the vocabulary: ``-log U`` of ``keyed_uniform`` (never 0)."""
    return keyed_uniform(key, torch.arange(vocab, dtype=torch.long, device=device)).log_().neg_()


def sample_keyed(
    weights: torch.Tensor,  # [R, V] non-negative weights (need not be normalised)
    keys: Sequence[int],  # [R] position_key of each row
) -> torch.Tensor:  # [R] int64
    """Position-keyed draws: row r takes the first index of the largest ``w_i / E_i`` (float64),
    with the noise E of its key.

    A deterministic function of the distribution and the key: plain decoding draws output
    position t with key (seed, t), and verification computes the very same draw at every tree
    node of that position, so a seeded run gives the same tokens with or without speculation.
    Each row is exactly distributed as w / sum(w) (exponential race, as in ``sample_from_probs``).
    """
    if weights.dim() != 2 or len(keys) != weights.shape[0]:
        raise ValueError(
            f"weights must be [R, V] with one key per row, got {tuple(weights.shape)} and {len(keys)} keys"
        )
    if bool(((weights > 0).sum(dim=-1) == 0).any()):
        raise ValueError("every row of weights needs a positive entry")
    noise = torch.stack([keyed_noise(key, weights.shape[1], device=weights.device) for key in keys])  # [R, V]
    return (weights.double() / noise).argmax(dim=-1)  # first index of the largest


def draw_keyed(
    logits: torch.Tensor,  # [R, V] the target's (or a drafter's) logits, any float dtype
    rows: Sequence[RowContext],  # [R]
    keys: Sequence[int],  # [R] position_key of each row
    *,
    eos_token_ids: Sequence[int] = (),
) -> torch.Tensor:  # [R] int64
    """Each row's position-keyed token: ``sample_keyed`` of the row's distribution (penalties and
    min_tokens as in ``logits_to_probs``), the argmax for greedy rows.  On the CPU the sampled rows
    go through the C++ keyed draw (the same bits, ~10x faster on a 262k vocabulary)."""
    if logits.dim() != 2 or not len(rows) == len(keys) == logits.shape[0]:
        raise ValueError(f"logits must be [R, V] with one row context and key each, got {tuple(logits.shape)}")
    logits = _penalized_logits(logits, rows, eos_token_ids=eos_token_ids)
    out = torch.empty(len(rows), dtype=torch.long, device=logits.device)  # [R]
    greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
    if greedy:
        idx = _index(greedy, logits.device)
        out[idx] = argmax_rows(logits[idx])
    sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if sampled:
        idx = _index(sampled, logits.device)
        x = logits if len(sampled) == len(rows) else logits[idx]  # [N, V]
        params = [rows[i].params for i in sampled]
        row_keys = [keys[i] for i in sampled]
        tokens = keyed_draw_rows(x, **_kernel_row_params(params, x.shape[1]), keys=row_keys)
        if tokens is None:
            tokens = sample_keyed(sampling_weights(x, params), row_keys)
        elif bool((tokens < 0).any()):
            raise ValueError("every sampled row needs a finite logit and no NaN")
        out[idx] = tokens
    return out


def uniform(
    generators: Sequence[torch.Generator | None],
    counts: int | Sequence[int],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float64,
) -> list[torch.Tensor]:  # per row: [counts[r]] in [0, 1)
    """Uniform draws for each row from that row's generator (for acceptance tests).

    float64 by default so that ``u < p / q`` is not biased by float32 granularity.
    """
    if isinstance(counts, int):
        counts = [counts] * len(generators)
    if len(counts) != len(generators):
        raise ValueError(f"got {len(counts)} counts for {len(generators)} generators")
    return [torch.rand(n, generator=g, device=device, dtype=dtype) for g, n in zip(generators, counts)]


# --------------------------------------------------------------------------------------
# logprobs
# --------------------------------------------------------------------------------------


def compute_logprobs(
    logits: torch.Tensor,  # [R, V] the rows' values: raw logits, or processed_logits' output
    token_ids: torch.Tensor,  # [R] int64 sampled tokens
    num_top: int,
    *,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's log_softmax in float32 (vLLM's default, "raw_logprobs", of the model's logits),
    or with ``normalize=False`` the values themselves (its "_logits" modes).

    Returns (sampled token's value [R], top ids [R, num_top] int64, top values [R, num_top]);
    ``num_top == 0`` gives empty [R, 0] tensors.
    """
    if num_top < 0:
        raise ValueError(f"num_top must be >= 0, got {num_top}")
    values = logits.to(torch.float32)
    token_value = values.gather(1, token_ids.to(torch.long).unsqueeze(1)).squeeze(1)  # [R]
    num_top = min(num_top, values.shape[1])
    top_values, top_ids = torch.topk(values, num_top, dim=-1)  # [R, k] each
    if normalize:  # each value less its row's logsumexp: the log_softmax, without writing it out
        normalizer = torch.logsumexp(values, dim=-1)  # [R]
        token_value, top_values = token_value - normalizer, top_values - normalizer.unsqueeze(1)
    return token_value, top_ids, top_values


def token_logprobs(
    values: torch.Tensor,  # [R, V] raw logits, or processed_logits' output
    token_ids: torch.Tensor,  # [R] int64 the tokens each row chose
    num_top: int,
    *,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """compute_logprobs' (token's value, top ids, top values) and the token's rank (token_ranks):
    on the CPU in one read of each row and one pass of exp (C++), elsewhere in torch."""
    fused = row_logprobs(values, token_ids, num_top, normalize=normalize)
    if fused is not None:
        return fused
    token_value, top_ids, top_values = compute_logprobs(values, token_ids, num_top, normalize=normalize)
    return token_value, top_ids, top_values, token_ranks(values, token_ids)


def processed_logits(
    logits: torch.Tensor,  # [R, V] raw logits, any float dtype (not written)
    rows: Sequence[RowContext],  # [R]
    *,
    eos_token_ids: Sequence[int] = (),
) -> torch.Tensor:  # [R, V] float32
    """What each row samples from, as logits (vLLM's "processed" logprobs modes): steps 0-2
    (allowed tokens, bad words, biases, penalties, min_tokens); a sampled row's then divided by
    its temperature, with the tokens top_k / top_p / min_p drop at -inf.  A greedy row stays as
    penalized: its argmax is its token.  The log_softmax of a sampled row is the log of
    ``logits_to_probs``' row wherever that is above float32's underflow."""
    values = _penalized_logits(logits, rows, eos_token_ids=eos_token_ids)
    sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if not sampled:
        return values
    vocab = values.shape[1]
    # Only rows that filter need their weights (a pass of exp over the vocabulary each): which
    # tokens the sampler's own top_k / top_p / min_p drop, from the same penalized logits.
    filtering = [i for i in sampled if _uses_filters(rows[i].params, vocab)]
    filtered_index = _index(filtering, values.device)
    weights = _filter_weights(values[filtered_index], [rows[i].params for i in filtering]) if filtering else None
    # z = logits / T as sampling_weights scales them (a greedy row's divided by 1: unchanged)
    temps = [1.0 if row.params.is_greedy else row.params.temperature for row in rows]
    values = values / torch.tensor(temps, dtype=torch.float32, device=values.device).unsqueeze(1)
    if weights is not None:
        z = values[filtered_index]  # [F, V]
        dropped = (weights == 0) & (z - z.amax(dim=-1, keepdim=True) >= _EXP_CUTOFF)  # not an underflow
        values[filtered_index] = z.masked_fill(dropped, float("-inf"))
    return values


def token_ranks(
    logits: torch.Tensor,  # [R, V] raw logits
    token_ids: torch.Tensor,  # [R] int64
) -> torch.Tensor:  # [R] int64: 1 + the tokens of the row more likely than token_ids[r]
    """Each token's rank in its row (1: the most likely), as vLLM reports it with logprobs; ties
    share the better rank. The order of logits is the order of their log-softmax."""
    chosen = logits.gather(1, token_ids.to(torch.long).unsqueeze(1))  # [R, 1]
    # counted in float32 (exact below 2^24 tokens): twice as fast as summing the bools on the CPU
    return (logits > chosen).to(torch.float32).sum(dim=1).to(torch.int64) + 1
