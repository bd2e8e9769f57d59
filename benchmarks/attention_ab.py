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
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parents[1]
CSRC = "quickdraft/kernels/csrc"
SOURCES = ("attention.cpp", "attention_row.h", "attention_row_avx2.h", "attention_row_body.h")
CASES = ((300, 1), (300, 5), (300, 9), (300, 17), (300, 64), (1000, 9), (1000, 17))


def build(revision: str | None, isa: str):
    """The attention module of `revision` (None: this tree), sources copied to a temporary folder."""
    folder = Path(tempfile.mkdtemp(prefix="qd-attention-ab-"))
    for name in SOURCES:
        if revision is None:
            data = (ROOT / CSRC / name).read_bytes()
        else:
            data = subprocess.run(
                ["git", "show", f"{revision}:{CSRC}/{name}"], cwd=ROOT, check=True, capture_output=True
            ).stdout
        (folder / name).write_bytes(data)
    flags = ["-O3", "-fopenmp", "-DNDEBUG", "-ffp-contract=off"] + (["-DQD_ISA_AVX2"] if isa == "avx2" else [])
    return cpp_extension.load(
        name=f"qd_attention_ab_{isa}_{abs(hash((revision, str(folder)))) % 10**8}",
        sources=[str(folder / "attention.cpp")],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        verbose=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD~1", help="the git revision to compare with")
    parser.add_argument("--isa", choices=("avx2", "avx512"), default="avx2")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    builds = {"base": build(args.base, args.isa), "tree": build(None, args.isa)}
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
