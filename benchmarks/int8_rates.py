"""What one core's int8 instructions can do: the compute roof the quantized AVX2 kernels work under.

The forward curve (forward_curve.py) divides MACs by the best rate the kernels themselves reach;
this measures the instructions alone, in independent streams, so that the kernels' rate can be
read as a fraction of what the core allows.  Each pattern is what a kernel step issues per row
of x (csrc/quant_tiles_avx2.h): 8 rows, one 32-byte weight vector, x's 4 quants broadcast:

- `vpmaddubsw`: the multiply alone, 8 independent streams (the core's int8 peak);
- nibble step (Q4_0 / Q5_0 / K-quants): broadcast, vpmaddubsw, vpaddw (int16 sums);
- Q8_0 step (the LM head): broadcast, vpsignb (x takes w's sign), vpmaddubsw (|w|), vpmaddwd
  (pair sums to int32: two 8-bit products of 127 fill an int16), vpaddd;
- the Q8_0 step without vpsignb (not a kernel: what the sign costs).

32 MACs per vpmaddubsw.  Medians of --repeats runs, one thread; the kernels run one such stream
per core.  x86-64 with AVX2 and a C compiler (`cc`) only.

    python benchmarks/int8_rates.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

ROWS = 8
ITERATIONS = 20_000_000
CLOBBERS = ", ".join(f'"xmm{i}"' for i in range(1, 12))  # the tmp and accumulator registers below

# Each pattern: the asm of one step for row r (tmp register, accumulator register, x offset).
PATTERNS = {
    "vpmaddubsw alone": "vpmaddubsw %%ymm0, %%ymm14, {tmp}\\n",
    "nibble step (broadcast, vpmaddubsw, vpaddw)": (
        "vbroadcastss {off}(%0), {tmp}\\n vpmaddubsw {tmp}, %%ymm0, {tmp}\\n vpaddw {tmp}, {acc}, {acc}\\n"
    ),
    "Q8_0 step (broadcast, vpsignb, vpmaddubsw, vpmaddwd, vpaddd)": (
        "vbroadcastss {off}(%0), {tmp}\\n vpsignb %%ymm14, {tmp}, {tmp}\\n vpmaddubsw {tmp}, %%ymm0, {tmp}\\n"
        " vpmaddwd %%ymm15, {tmp}, {tmp}\\n vpaddd {tmp}, {acc}, {acc}\\n"
    ),
    "Q8_0 step without vpsignb": (
        "vbroadcastss {off}(%0), {tmp}\\n vpmaddubsw {tmp}, %%ymm0, {tmp}\\n"
        " vpmaddwd %%ymm15, {tmp}, {tmp}\\n vpaddd {tmp}, {acc}, {acc}\\n"
    ),
}


def c_source() -> str:
    functions = []
    for index, body in enumerate(PATTERNS.values()):
        steps = "".join(
            '"' + body.format(off=64 * r, tmp=f"%%ymm{6 + r % 6}", acc=f"%%ymm{1 + r % 5}") + '"\n' for r in range(ROWS)
        )
        functions.append(
            f"static double pattern{index}(const char* x) {{\n"
            f"  double start = now();\n"
            f"  for (long i = 0; i < {ITERATIONS}L; ++i) __asm__ volatile(\n{steps}"
            f'    :: "r"(x) : {CLOBBERS});\n'
            f"  return (double){ROWS} * {ITERATIONS}L / (now() - start) / 1e9;\n}}\n"
        )
    calls = " ".join(f'printf("%f\\n", pattern{i}(x));' for i in range(len(PATTERNS)))
    return (
        "#include <stdio.h>\n#include <stdlib.h>\n#include <time.h>\n"
        "static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);"
        " return t.tv_sec + t.tv_nsec * 1e-9; }\n"
        + "".join(functions)
        + "int main(void) { char* x = aligned_alloc(64, 4096); for (int i = 0; i < 4096; ++i) x[i] = (char)i;\n"
        f"  {calls} return 0; }}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qd-int8-rates-") as folder:
        source, binary = Path(folder) / "rates.c", Path(folder) / "rates"
        source.write_text(c_source())
        subprocess.run(["cc", "-O2", "-o", str(binary), str(source)], check=True)
        runs = [
            [float(v) for v in subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.split()]
            for _ in range(args.repeats)
        ]
    cores = len(os.sched_getaffinity(0))
    print(f"one core, median of {args.repeats} runs; {cores} cores here")
    for index, name in enumerate(PATTERNS):
        steps = statistics.median(run[index] for run in runs)
        print(f"{name:64s} {steps:5.2f} per ns = {32 * steps:5.0f} GMAC/s a core, {32 * steps * cores:5.0f} on {cores}")


if __name__ == "__main__":
    main()
