"""What each GGUF format costs on the quantized kernels: one linear layer's time by rows.

Random blocks of every format the loader keeps quantized, for a weight shaped like a 1B model's
MLP matrix, cycled through enough copies to stream from DRAM as decoding does.  Printed per format:
the stored bits per weight (the GGUF file's), the bits the kernel reads (its packed tiles), and
the median milliseconds per call for each row count with the packed bytes' read rate.

    python benchmarks/gguf_formats.py --rows 1 4 16 --out results.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quickdraft.kernels.quant_linear import active_isa, quant_linear
from quickdraft.models.quantized import GGUF_BLOCK, SUPPORTED_FORMATS, QuantizedWeight, decode_gguf
from tests.kernels.test_quant_linear import random_gguf


def time_format(fmt: str, *, n: int, k: int, rows: list[int], cold_bytes: float, repeats: int) -> dict:
    first = QuantizedWeight.from_parts([decode_gguf(fmt, random_gguf(fmt, n, k, seed=0), rows=n, cols=k)])
    copies = max(1, int(cold_bytes // first.nbytes))
    weights = [first] + [
        QuantizedWeight.from_parts([decode_gguf(fmt, random_gguf(fmt, n, k, seed=i), rows=n, cols=k)])
        for i in range(1, copies)
    ]
    block_bytes, block_values = GGUF_BLOCK[fmt]
    result = {
        "stored_bits_per_weight": 8 * block_bytes / block_values,
        "read_bits_per_weight": 8 * first.nbytes / (n * k),
        "copies": copies,
        "ms": {},
        "read_gbs": {},
    }
    for m in rows:
        x = torch.randn(m, k)
        for weight in weights[:3]:
            quant_linear(x, weight)
        times = []
        for i in range(repeats * copies):
            start = time.perf_counter()
            quant_linear(x, weights[i % copies])
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        result["ms"][m] = round(median * 1e3, 4)
        result["read_gbs"][m] = round(first.nbytes / median / 1e9, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=2, default=[8192, 2048], metavar=("N", "K"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--formats", nargs="+", default=list(SUPPORTED_FORMATS), choices=list(SUPPORTED_FORMATS))
    parser.add_argument("--cold-bytes", type=float, default=200e6, help="bytes of weight copies cycled through")
    parser.add_argument("--repeats", type=int, default=5, help="passes over the copies per row count")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    n, k = args.shape
    report = {
        "machine": platform.processor() or platform.machine(),
        "isa": active_isa(),
        "threads": torch.get_num_threads(),
        "shape": [n, k],
        "formats": {},
    }
    print(f"[{n}, {k}] weight, {active_isa()} kernels, {torch.get_num_threads()} threads")
    print(f"{'format':8} {'stored':>6} {'read':>6}  " + "  ".join(f"{f'M={m} ms (GB/s)':>17}" for m in args.rows))
    for fmt in args.formats:
        r = time_format(fmt, n=n, k=k, rows=args.rows, cold_bytes=args.cold_bytes, repeats=args.repeats)
        report["formats"][fmt] = r
        cells = "  ".join(f"{r['ms'][m]:>9.3f} ({r['read_gbs'][m]:>5.1f})" for m in args.rows)
        bits = f"{r['stored_bits_per_weight']:>6.2f} {r['read_bits_per_weight']:>6.2f}"
        print(f"{fmt:8} {bits}  {cells}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
