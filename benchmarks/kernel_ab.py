"""The quantized CPU kernels of another git revision against this tree's, in one process.

Builds `csrc/quant_linear.cpp` (and its headers) of `--base` under a module name of its own,
then times, switching `quickdraft.kernels.quant_linear`'s extension between the two builds:
- per kernel: the embedded model's LM head and layer-0 matrices at several row counts
  (medians over alternated rounds; the layer weights are hot in cache, the LM head is not);
- the forward curve: one sequence with 300 tokens of context (`--context`) verifying T tokens,
  logits for all;
  prompt prefill of 300 and 1,000 tokens;
- end to end: Spec-Bench first turns (`--per-category` of each category), greedy, plain and
  speculative configs, one LLM per build and config (a suffix drafter learns from earlier
  answers and a prefix cache remembers prompts: one engine serving both builds would favour
  the second), the two builds alternating per prompt; outputs must be identical.

Both builds must compute the same bits (the kernel tests check each against the reference);
this measures only time.  Build flags are the AVX2 build's unless --isa avx512.

    python benchmarks/kernel_ab.py --base HEAD~3 --per-category 2
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from forward_curve import time_forward, time_prefill  # run from benchmarks/: its folder is on the path
from torch.utils import cpp_extension

from quickdraft import LLM, SamplingParams
from quickdraft.kernels import quant_linear as ql

ROOT = Path(__file__).resolve().parents[1]
CSRC = "quickdraft/kernels/csrc"
QUESTIONS = ROOT.parent / "shared/data/specbench/questions.dev.jsonl"
CONFIGS = {"plain": None, "suffix": {"method": "suffix"}, "eagle3": {"method": "eagle3"}}


def build_base(revision: str | None, isa: str, *, source: str = "quant_linear.cpp"):
    """The kernel module `source` of a git revision (None: this tree), built from a copy of its
    csrc folder in a temporary folder under a module name of its own."""
    folder = Path(tempfile.mkdtemp(prefix="qd-kernel-ab-"))
    if revision is None:
        shutil.copytree(ROOT / CSRC, folder, dirs_exist_ok=True)
    else:
        names = subprocess.run(
            ["git", "ls-tree", "--name-only", f"{revision}:{CSRC}"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        for name in names:
            data = subprocess.run(
                ["git", "show", f"{revision}:{CSRC}/{name}"], cwd=ROOT, check=True, capture_output=True
            )
            (folder / name).write_bytes(data.stdout)
    flags = ["-O3", "-fopenmp", "-DNDEBUG", "-ffp-contract=off"] + (["-DQD_ISA_AVX2"] if isa == "avx2" else [])
    return cpp_extension.load(
        name=f"qd_kernel_ab_{Path(source).stem}_{isa}_{abs(hash((revision, str(folder)))) % 10**8}",
        sources=[str(folder / source)],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        verbose=False,
    )


def use(ext) -> None:
    ql._extension = lambda: ext


def per_kernel(model, builds: dict, rows: list[int], rounds: int) -> dict:
    layer = model.layers[0]
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    weights = {"lm_head": model.lm_head_weight} | {name: getattr(layer, name) for name in names}
    times = collections.defaultdict(list)
    for _ in range(rounds):
        for name, weight in weights.items():
            n, k = weight.shape
            for m in rows:
                x, out = torch.randn(m, k), torch.empty(m, n)
                repeats = 7 if name == "lm_head" else 200
                for tag, ext in builds.items():
                    use(ext)
                    for _ in range(2):
                        ql.quant_linear(x, weight, out=out)
                    samples = []
                    for _ in range(repeats):
                        started = time.perf_counter()
                        ql.quant_linear(x, weight, out=out)
                        samples.append(time.perf_counter() - started)
                    times[f"{name} M={m} {tag}"].append(statistics.median(samples))
    return {key: statistics.median(values) * 1e3 for key, values in times.items()}


def forward_curve(engine, builds: dict, rounds: int, contexts: list[int]) -> dict:
    times = collections.defaultdict(list)
    for _ in range(rounds):
        for tag, ext in builds.items():
            use(ext)
            for context in contexts:
                where = "" if contexts == [300] else f"context {context} "
                for width in (1, 2, 4, 8, 16, 32, 64):
                    times[f"{where}T={width} {tag}"].append(
                        time_forward(engine, context=context, width=width, repeats=5)
                    )
            for prompt in (300, 1000):
                times[f"prefill {prompt} {tag}"].append(time_prefill(engine, prompt=prompt, repeats=2))
    return {key: statistics.median(values) * 1e3 for key, values in times.items()}


def end_to_end(builds: dict, per_category: int, max_tokens: int) -> dict:
    by_category = collections.defaultdict(list)
    for line in QUESTIONS.read_text().splitlines():
        item = json.loads(line)
        by_category[item["category"]].append(item["turns"][0])
    prompts = [p for questions in by_category.values() for p in questions[:per_category]]
    llms = {}
    for name, config in CONFIGS.items():
        for tag, ext in builds.items():
            use(ext)
            llms[name, tag] = LLM(speculative_config=config)
            llms[name, tag].generate(["Hello there, how are"], SamplingParams(temperature=0, max_tokens=8))
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    seconds, tokens, outputs = collections.Counter(), collections.Counter(), collections.defaultdict(set)
    for i, prompt in enumerate(prompts):
        for name in CONFIGS:
            for tag in builds if i % 2 == 0 else reversed(builds):
                use(builds[tag])
                started = time.perf_counter()
                ids = llms[name, tag].generate([prompt], params)[0].outputs[0].token_ids
                seconds[name, tag] += time.perf_counter() - started
                tokens[name, tag] += len(ids)
                outputs[name, i].add(tuple(ids))
    return {
        "prompts": len(prompts),
        "identical": all(len(v) == 1 for v in outputs.values()),
        "tok/s": {f"{name} {tag}": tokens[name, tag] / seconds[name, tag] for name in CONFIGS for tag in builds},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD~1", help="the git revision to compare with")
    parser.add_argument("--isa", choices=("avx2", "avx512"), default=ql.active_isa())
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--context", type=int, nargs="+", default=[300], help="the curve's context lengths")
    parser.add_argument("--skip", nargs="*", default=[], choices=("kernels", "curve", "e2e"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    builds = {"base": build_base(args.base, args.isa), "tree": ql._extension()}
    result: dict = {"base": args.base, "isa": args.isa}
    if "kernels" not in args.skip or "curve" not in args.skip:
        llm = LLM(max_model_len=2048)
        if "kernels" not in args.skip:
            result["kernels_ms"] = per_kernel(llm.engine.runner.model, builds, args.rows, args.rounds)
        if "curve" not in args.skip:
            result["forward_ms"] = forward_curve(llm.engine, builds, args.rounds, args.context)
        llm.close()
    if "e2e" not in args.skip:
        result["end_to_end"] = end_to_end(builds, args.per_category, args.max_tokens)
    for section in ("kernels_ms", "forward_ms"):
        for key, base in result.get(section, {}).items():
            if key.endswith(" base"):
                label, tree = key[: -len(" base")], result[section][key[: -len("base")] + "tree"]
                print(f"{label:24s} base {base:8.3f} ms  tree {tree:8.3f} ms  tree/base {tree / base:.3f}")
    if "end_to_end" in result:
        e2e = result["end_to_end"]
        print(f"end to end: {e2e['prompts']} prompts, outputs identical across builds: {e2e['identical']}")
        for name in CONFIGS:
            base, tree = e2e["tok/s"][f"{name} base"], e2e["tok/s"][f"{name} tree"]
            print(f"{name:8s} base {base:6.1f} tok/s  tree {tree:6.1f} tok/s  tree/base {tree / base:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
