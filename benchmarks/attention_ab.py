"""The CPU attention kernel (`csrc/attention.cpp` and its row headers) of another git revision
against this tree's, in one process, on the shapes of Gemma 3 270M (4 query heads on one key
head of 256): T query rows (a decode, a verified chain, a prefill chunk) over S keys under a
causal mask, the two builds alternating for `--rounds` rounds (medians of 40 calls each); the
outputs must be bit-identical.  The kernel alone, without a forward around it, so a change of a
fifth of attention's time is not lost in a forward's noise.

    python benchmarks/attention_ab.py --base HEAD~1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from kernel_ab import build_base  # run from benchmarks/: its folder is on the path

CASES = ((300, 1), (300, 5), (300, 9), (300, 17), (300, 64), (1000, 9), (1000, 17))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD~1", help="the git revision to compare with")
    parser.add_argument("--isa", choices=("avx2", "avx512"), default="avx2")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    builds = {"base": build_base(args.base, args.isa, source="attention.cpp")}
    builds["tree"] = build_base(None, args.isa, source="attention.cpp")
    generator = torch.Generator().manual_seed(0)
    inputs = {}
    for keys, rows in CASES:
        q, k, v = (torch.randn(n, h, 256, generator=generator) for n, h in ((rows, 4), (1, keys), (1, keys)))
        mask = torch.ones(rows, keys, dtype=torch.bool)
        for t in range(rows):
            mask[t, keys - rows + t + 1 :] = False
        inputs[keys, rows] = (q, k, v, mask)
    times: dict = {(tag, case): [] for tag in builds for case in CASES}
    outputs: dict = {}
    for _ in range(args.rounds):
        for case in CASES:
            for tag, module in builds.items():
                q, k, v, mask = inputs[case]
                outputs[tag, case] = module.attention(q, k, v, mask, 0.0625)
                samples = []
                for _ in range(40):
                    started = time.perf_counter()
                    module.attention(q, k, v, mask, 0.0625)
                    samples.append(time.perf_counter() - started)
                times[tag, case].append(statistics.median(samples))
    for case in CASES:
        base, tree = (statistics.median(times[tag, case]) * 1e6 for tag in builds)
        same = torch.equal(outputs["base", case], outputs["tree", case])
        print(
            f"S={case[0]:5d} T={case[1]:3d}  base {base:8.1f} us  tree {tree:8.1f} us  tree/base {tree / base:.3f}"
            f"  {'bits equal' if same else 'BITS DIFFER'}"
        )


if __name__ == "__main__":
    main()
