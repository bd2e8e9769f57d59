"""The LM head's activation quants at 127 vs 63 levels (narrow: quant_linear.py's
lm_head_activation_levels), in one process on the embedded model.

On AVX2 a Q8_0 head multiplies narrow quants without a sign flip; the arms differ only in the
levels the head's input is quantized to, so on AVX2 they are the old and the new instruction
stream (on AVX-512 both run the same instructions: only the precision differs).

- kernel: the LM head alone at 1..16 rows (medians of 5 x --rounds alternations, 3 calls each);
- curve: one sequence with 300 tokens of context verifying T tokens, logits for all;
- e2e: Spec-Bench first turns (`--per-category` of each), greedy, plain / suffix / eagle3, one LLM
  per arm and config, the arms alternating per prompt; each arm's speculative outputs must equal
  its plain outputs, and the arms' plain answers are compared token for token;
- precision: the head's final-norm inputs captured during the e2e plain runs, their top-1 under
  each arm against unquantized activations (float32 matmul with the dequantized head);
- agreement: each arm's plain answers against the same file dequantized to float32
  (`dtype="float32"`, no activation quants anywhere), prompt by prompt: answers identical and
  the mean common prefix (as benchmarks/token_agreement.py counts them).

    python benchmarks/lm_head_levels.py --per-category 4 --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import torch
from forward_curve import time_forward  # run from benchmarks/: its folder is on the path
from huge_pages import first_turns
from token_agreement import common_prefix

import quickdraft.models.decoder as decoder_module
from quickdraft import LLM, SamplingParams
from quickdraft.kernels import quant_linear as ql

CONFIGS = {"plain": None, "suffix": {"method": "suffix"}, "eagle3": {"method": "eagle3"}}
ARMS = (127, 63)


def use(levels: int) -> None:
    """Every target-logits path takes its levels from decoder.lm_head_activation_levels."""
    decoder_module.lm_head_activation_levels = lambda weight: levels


def per_kernel(weight, rows: list[int], alternations: int) -> dict:
    """Medians of `alternations` timings per arm (3 calls each), the arms' order flipped each time."""
    times = collections.defaultdict(list)
    for m in rows:
        x, out = torch.randn(m, weight.shape[1]), torch.empty(m, weight.shape[0])
        for i in range(alternations):
            for levels in ARMS if i % 2 else reversed(ARMS):
                ql.quant_linear(x, weight, out=out, activation_levels=levels)
                started = time.perf_counter()
                for _ in range(3):
                    ql.quant_linear(x, weight, out=out, activation_levels=levels)
                times[f"lm_head M={m} levels {levels}"].append((time.perf_counter() - started) / 3)
    return {key: statistics.median(values) * 1e3 for key, values in times.items()}


def curve(engine, widths: list[int], rounds: int) -> dict:
    times = collections.defaultdict(list)
    for _ in range(rounds):
        for levels in ARMS:
            use(levels)
            for width in widths:
                times[f"T={width} levels {levels}"].append(time_forward(engine, context=300, width=width, repeats=5))
    return {key: statistics.median(values) * 1e3 for key, values in times.items()}


def end_to_end(per_category: int, max_tokens: int) -> tuple[dict, list[torch.Tensor], object]:
    prompts = first_turns(per_category)
    llms = {}
    for name, config in CONFIGS.items():
        for levels in ARMS:
            use(levels)
            llms[name, levels] = LLM(speculative_config=config)
            llms[name, levels].generate(["Hello there, how are"], SamplingParams(temperature=0, max_tokens=8))
    captured: list[torch.Tensor] = []  # [rows, D] final-norm inputs of the head, plain runs
    for levels in ARMS:
        model = llms["plain", levels].engine.model
        original = model.lm_head_matmul

        def recording(normed, weight, *, out=None, original=original):
            captured.append(normed.detach().float().clone())
            return original(normed, weight, out=out)

        if levels == ARMS[0]:  # one arm's inputs are enough (the same model, nearly the same texts)
            model.lm_head_matmul = recording
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    seconds, tokens, outputs = collections.Counter(), collections.Counter(), {}
    for i, prompt in enumerate(prompts):
        for name in CONFIGS:
            for levels in ARMS if i % 2 == 0 else reversed(ARMS):
                use(levels)
                started = time.perf_counter()
                ids = llms[name, levels].generate([prompt], params)[0].outputs[0].token_ids
                seconds[name, levels] += time.perf_counter() - started
                tokens[name, levels] += len(ids)
                outputs[name, levels, i] = list(ids)
    same_as_plain = all(
        outputs[name, levels, i] == outputs["plain", levels, i]
        for name in CONFIGS
        for levels in ARMS
        for i in range(len(prompts))
    )
    identical_answers = sum(outputs["plain", 127, i] == outputs["plain", 63, i] for i in range(len(prompts)))
    rates = {
        f"{name} levels {levels}": tokens[name, levels] / seconds[name, levels] for name in CONFIGS for levels in ARMS
    }
    weight = llms["plain", ARMS[0]].engine.model.lm_head_weight
    return (
        {
            "prompts": len(prompts),
            "speculative outputs equal plain, per arm": same_as_plain,
            "plain answers identical between arms": identical_answers,
            "tok/s": rates,
            "speedup over the same arm's plain": {
                key: rate / rates[f"plain levels {key.split()[-1]}"] for key, rate in rates.items()
            },
        },
        captured,
        weight,
    )


def float32_agreement(per_category: int, max_tokens: int) -> dict:
    prompts = first_turns(per_category)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    answers = {}
    for arm in ("float32", *ARMS):
        use(ARMS[0] if arm == "float32" else arm)  # float32 has no quantized head: levels unused
        llm = LLM(dtype="float32") if arm == "float32" else LLM()
        answers[arm] = [list(llm.generate([p], params)[0].outputs[0].token_ids) for p in prompts]
        del llm

    result: dict = {"prompts": len(prompts)}
    for levels in ARMS:
        pairs = list(zip(answers[levels], answers["float32"]))
        result[f"levels {levels}: answers identical to float32"] = sum(a == b for a, b in pairs) / len(pairs)
        result[f"levels {levels}: mean common prefix with float32"] = statistics.mean(
            common_prefix(a, b) for a, b in pairs
        )
    return result


def precision(captured: list[torch.Tensor], weight) -> dict:
    hidden = torch.cat(captured)  # [R, D]
    vocab = weight.shape[0]
    dense = torch.cat([weight.rows(torch.arange(s, min(vocab, s + 16384))) for s in range(0, vocab, 16384)])
    agree = collections.Counter()
    for start in range(0, hidden.shape[0], 256):
        h = hidden[start : start + 256]
        top = (h @ dense.T).argmax(-1)
        for levels in ARMS:
            q, dx, _ = ql.quantize_activations(h, levels)
            dequantized = (q.float().reshape(h.shape[0], -1, 32) * dx[:, :, None]).reshape(h.shape)
            got = (dequantized @ dense.T).argmax(-1)
            agree[levels] += int((got == top).sum())
    rows = hidden.shape[0]
    return {"rows": rows} | {f"top-1 agreement, levels {levels}": agree[levels] / rows for levels in ARMS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--skip", nargs="*", default=[], choices=("kernel", "curve", "e2e", "agreement"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print("kernel:", ql.active_isa())
    result: dict = {"isa": ql.active_isa()}
    if "kernel" not in args.skip or "curve" not in args.skip:
        llm = LLM()
        if "kernel" not in args.skip:
            result["kernel ms"] = per_kernel(llm.engine.model.lm_head_weight, args.rows, 5 * args.rounds)
        if "curve" not in args.skip:
            result["curve ms"] = curve(llm.engine, args.widths, args.rounds)
        del llm
    if "e2e" not in args.skip:
        result["e2e"], captured, weight = end_to_end(args.per_category, args.max_tokens)
        result["precision"] = precision(captured, weight)
    if "agreement" not in args.skip:
        result["float32 agreement"] = float32_agreement(args.per_category, args.max_tokens)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
