"""A chi-square check that two samplers draw from the same distribution (shared by tests)."""

from __future__ import annotations


def same_distribution_p_value(reference: dict, observed: dict, *, min_count: int = 15) -> float:
    """Chi-square test of homogeneity over the outcomes seen >= min_count times in
    `reference`, the rarer ones pooled into one column (dropped when empty in both)."""
    from scipy import stats

    keys = [k for k in reference if reference[k] >= min_count]
    rest = [sum(v for k, v in counts.items() if k not in keys) for counts in (reference, observed)]
    table = [[counts.get(k, 0) for k in keys] for counts in (reference, observed)]
    if any(rest):
        table = [row + [extra] for row, extra in zip(table, rest)]
    return stats.chi2_contingency(table)[1]


def count_outputs(llm, prompt, params_list) -> dict[tuple[int, ...], int]:
    """How often each generated token sequence came out, one request per SamplingParams."""
    counts: dict[tuple[int, ...], int] = {}
    for out in llm.generate([prompt] * len(params_list), params_list):
        key = tuple(out.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


def assert_speculation_keeps_sampling(
    target: str,
    spec: dict,
    *,
    prompt: list[int],
    draws: int = 1200,
    min_draft_tokens: int = 1000,
    top_k: int = 3,
    require_accepts: bool = True,
) -> None:
    """`draws` seeded 3-token samples (temperature 1, top-k) come out with the same distribution
    plainly and with `spec`, which must have drafted at least `min_draft_tokens` tokens (and had
    some accepted, unless `require_accepts` is off: a random head sees only the few contexts of
    this prompt and may never hit the target's top-k, leaving only the rejection path tested)."""
    from quickdraft import LLM, SamplingParams

    params = [SamplingParams(max_tokens=3, seed=s, temperature=1.0, top_k=top_k) for s in range(draws)]
    plain = count_outputs(LLM(target, max_model_len=64, max_num_seqs=8), prompt, params)
    spec_llm = LLM(target, max_model_len=64, max_num_seqs=8, speculative_config=spec)
    speculative = count_outputs(spec_llm, prompt, params)
    metrics = spec_llm.get_metrics()
    assert metrics.num_draft_tokens >= min_draft_tokens
    assert metrics.num_accepted_tokens > 0 or not require_accepts
    assert same_distribution_p_value(plain, speculative) > 1e-3
