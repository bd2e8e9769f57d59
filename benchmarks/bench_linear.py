"""Micro-benchmark: F.linear vs quickdraft.kernels.skinny_linear on CPU.

For the linear shapes of Gemma 3 270M and M (rows / tokens) in 1..64, prints
the median time and the achieved weight-read bandwidth of both, for float32
and bfloat16 weights, next to the machine's measured read bandwidth
(``W.sum()`` over a 671 MB tensor).

By default every call reads a different copy of the weight (enough copies to
exceed the last-level cache several times), as in real decoding where each
layer's weights come from DRAM.  ``--hot`` reuses one copy instead (small
layers then run from L3 and show more than the DRAM bandwidth).

    python benchmarks/bench_linear.py                 # full table
    python benchmarks/bench_linear.py --quick         # M in {1, 8}, 2 shapes
    python benchmarks/bench_linear.py --threads 1 --dtypes bf16 --ms 1 2 4
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quickdraft.kernels import cpu_linear

# name -> (N, K) of the nn.Linear weight [N, K] (Gemma 3 270M: d_model 640,
# 4 query heads + 1 kv head of 256, MLP 2048, vocabulary 262144).
SHAPES = {
    "qkv": (1536, 640),
    "o_proj": (640, 1024),
    "gate_up": (4096, 640),
    "down": (640, 2048),
    "lm_head": (262144, 640),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _time_calls(fn, n_copies: int, min_reps: int, min_seconds: float) -> list[float]:
    """Per-call seconds; fn(i) must use copy i % n_copies."""
    for i in range(min(n_copies, 3)):  # warm up (page faults, thread pool)
        fn(i)
    times: list[float] = []
    start = time.perf_counter()
    i = 0
    while len(times) < min_reps or (time.perf_counter() - start < min_seconds and len(times) < 2000):
        t0 = time.perf_counter()
        fn(i % n_copies)
        times.append(time.perf_counter() - t0)
        i += 1
    return times


def read_bandwidth(reps: int) -> tuple[float, float]:
    """(median, best) GB/s of W.sum() over a 671 MB float32 tensor."""
    w = torch.randn(262144, 640)
    ts = _time_calls(lambda i: w.sum(), 1, reps, 0.0)
    nbytes = w.numel() * w.element_size()
    return nbytes / statistics.median(ts) / 1e9, nbytes / min(ts) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--reps", type=int, default=7, help="minimum timed calls per cell")
    ap.add_argument("--min-seconds", type=float, default=0.25, help="keep timing a cell at least this long")
    ap.add_argument("--hot", action="store_true", help="reuse one weight copy (cache-resident small layers)")
    ap.add_argument("--cold-bytes", type=float, default=256e6, help="bytes of weight copies to cycle through")
    ap.add_argument("--quick", action="store_true", help="M in {1, 8}; qkv and lm_head only")
    ap.add_argument(
        "--force-kernel",
        action="store_true",
        help="call the C++ kernel even above the M threshold (to measure the crossover)",
    )
    args = ap.parse_args()
    if args.quick:
        args.ms, args.shapes = [1, 8], ["qkv", "lm_head"]
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    t0 = time.perf_counter()
    avail = cpu_linear.kernel_available()
    build_s = time.perf_counter() - t0
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}, "
        f"load average {os.getloadavg()[0]:.2f} (other processes distort the numbers)"
    )
    print(
        f"skinny_linear kernel available: {avail} (load/build {build_s:.1f} s); "
        f"used for M <= {cpu_linear.max_rows(torch.float32)} (fp32), "
        f"{cpu_linear.max_rows(torch.bfloat16)} (bf16), F.linear above"
    )
    skinny = cpu_linear.skinny_linear
    if args.force_kernel:
        if not avail:
            sys.exit("--force-kernel: the kernel is not available")
        skinny = cpu_linear._extension().skinny_linear
    bw_med, bw_best = read_bandwidth(max(args.reps, 10))
    print(f"read bandwidth, W.sum() over 671 MB fp32: median {bw_med:.1f} GB/s, best {bw_best:.1f} GB/s")
    print(f"weights: {'hot (one copy, may be cache resident)' if args.hot else 'cold (cycling copies > LLC)'}")
    print("times are medians; GB/s = weight bytes / time; 'sum GB/s' = W.sum() over the same weight bytes\n")

    hdr = (
        f"{'dtype':5} {'layer':8} {'N x K':>13} {'M':>3} | {'sum GB/s':>8} | {'F.linear ms':>11} {'GB/s':>6} | "
        f"{'skinny ms':>9} {'GB/s':>6} | {'speedup':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    with torch.inference_mode():
        for dname in args.dtypes:
            dtype = DTYPES[dname]
            for sname in args.shapes:
                N, K = SHAPES[sname]
                nbytes = N * K * torch.finfo(dtype).bits // 8
                n_copies = 1 if args.hot else max(1, math.ceil(args.cold_bytes / nbytes))
                base = torch.randn(N, K, dtype=torch.float32).to(dtype)
                weights = [base] + [base.clone() for _ in range(n_copies - 1)]
                # Read bandwidth on exactly these bytes (bf16 viewed as fp32 pairs).
                flat = [w.view(torch.float32) for w in weights]
                t_sum = statistics.median(
                    _time_calls(lambda i, flat=flat: flat[i].sum(), n_copies, args.reps, args.min_seconds)
                )
                for M in args.ms:
                    x = torch.randn(M, K, dtype=torch.float32).to(dtype)
                    ref = F.linear(x, base)
                    got = skinny(x, base)
                    tol = 1e-3 if dtype == torch.float32 else 3e-2
                    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
                    t_ref = statistics.median(
                        _time_calls(lambda i, x=x, w=weights: F.linear(x, w[i]), n_copies, args.reps, args.min_seconds)
                    )
                    t_new = statistics.median(
                        _time_calls(lambda i, x=x, w=weights: skinny(x, w[i]), n_copies, args.reps, args.min_seconds)
                    )
                    flag = "" if err < tol else f"  MISMATCH rel err {err:.2e}"
                    print(
                        f"{dname:5} {sname:8} {f'{N}x{K}':>13} {M:3d} | {nbytes / t_sum / 1e9:8.1f} | "
                        f"{t_ref * 1e3:11.3f} "
                        f"{nbytes / t_ref / 1e9:6.1f} | {t_new * 1e3:9.3f} {nbytes / t_new / 1e9:6.1f} | "
                        f"{t_ref / t_new:6.2f}x{flag}",
                        flush=True,
                    )
                del weights, flat, base
            print()
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
