"""What Gemma 2's attention soft cap costs in the CPU attention kernel: the same call with the cap
off and at 50.0, alternating, on one query-head group of 4 over a key head of 256 (Gemma 3 270M's
shape; Gemma 2's heads are the same width), T query rows over S keys, causal mask; medians.

    python benchmarks/softcap_cost.py
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

from quickdraft.kernels.attention import attention

CASES = ((300, 1), (300, 9), (1000, 1), (1000, 9), (1000, 64))


def _median_us(call, repeats: int = 40) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    torch.manual_seed(0)
    for keys, rows in CASES:
        q = torch.randn(rows, 4, 256)
        k, v = torch.randn(1, keys, 256), torch.randn(1, keys, 256)
        mask = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)
        plain, capped = [], []
        for _ in range(5):
            plain.append(_median_us(functools.partial(attention, q, k, v, mask=mask, scale=0.0625)))
            capped.append(_median_us(functools.partial(attention, q, k, v, mask=mask, scale=0.0625, softcap=50.0)))
        p, c = statistics.median(plain), statistics.median(capped)
        print(f"S={keys:5d} T={rows:3d}  no cap {p:8.1f} us  cap 50 {c:8.1f} us  ratio {c / p:.3f}")


if __name__ == "__main__":
    main()
