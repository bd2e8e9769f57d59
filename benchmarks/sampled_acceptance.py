"""Acceptance under sampling: position-keyed verification (today's engine) against the rejection
rule it replaced, per drafter, on the first questions per task of Spec-Bench, plus the cost of one
sampled token's draw.

    python benchmarks/sampled_acceptance.py --per-task 10 --max-tokens 128 --temperature 0.7

"keyed": the engine as it is: point-mass drafts are checked against the target's own
position-keyed draw (``verify_by_target_choice``), and the draft model draws its chain with the
same keyed noise (``coupling="keyed"``).  "rejection": point-mass drafts verified with the
previous rule (accept with p[x], renormalise, recover from the residual: ``verify_proposal``),
and the draft model's samples with min(1, p/q) (``coupling="rejection"``).  For point masses the
two accept each child with the same probability, so their figures should agree within noise;
for the draft model the couplings differ.

No draft model is trained for the embedded Gemma 3 270M, so the draft model here is the target
cut to its first `--draft-layers` layers (a real, weaker model with the same vocabulary).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from quickdraft import LLM, SamplingParams
from quickdraft.engine import engine as engine_module
from quickdraft.engine import verification
from quickdraft.verify.rejection import verify_proposal
from quickdraft.verify.sampler import (
    RowContext,
    logits_to_probs,
    make_generator,
    position_key,
    sample_from_probs,
    sample_keyed,
    samples_by_argmax,
)

QUESTIONS = Path(__file__).resolve().parents[2] / "shared/data/specbench/questions.dev.jsonl"
# Configs by name; the draft model's is built in main (it needs the truncated checkpoint).
SPECS = {
    "ngram": {"method": "ngram"},
    "suffix": {"method": "suffix"},
    "eagle3": {"method": "eagle3", "top_k": 1, "min_draft_prob": 0.2},
    "hybrid": {
        "method": "hybrid",
        "drafters": [{"method": "suffix"}, {"method": "eagle3", "top_k": 1}],
        "skip_after": 3,
    },
}


def first_questions(path: Path, per_task: int) -> list[str]:
    taken: dict[str, int] = {}
    prompts = []
    for line in path.read_text().splitlines():
        question = json.loads(line)
        if taken.get(question["category"], 0) < per_task:
            taken[question["category"]] = taken.get(question["category"], 0) + 1
            prompts.append(question["turns"][0])
    return prompts


def verify_one(request, proposal, logits, eos_token_ids):
    """The engine's batched verification for one request; logits [num_nodes, V]."""
    return verification.verify_step(
        requests=[request],
        proposals=[proposal],
        logits=logits,
        row_offsets=[0, logits.shape[0]],
        eos_token_ids=eos_token_ids,
    )[0]


@contextlib.contextmanager
def engine_verification(rule):
    """Run the engine with `rule(request, proposal, logits, eos_token_ids)` verifying each request."""
    original = engine_module.verify_step

    def verify_step(*, requests, proposals, logits, row_offsets, eos_token_ids):
        return [
            rule(request, proposal, logits[row_offsets[i] : row_offsets[i + 1]], eos_token_ids)
            for i, (request, proposal) in enumerate(zip(requests, proposals))
        ]

    engine_module.verify_step = verify_step
    try:
        yield
    finally:
        engine_module.verify_step = original


def rejection_rule_for_point_masses():
    """The previous verification of sampled point-mass drafts, for comparison."""

    def verify(request, proposal, logits, eos_token_ids):
        if samples_by_argmax(request.params, num_output_tokens=len(request.output_token_ids)):
            return verify_one(request, proposal, logits, eos_token_ids)
        rows = [
            RowContext(params=request.params, prompt_token_ids=request.prompt_token_ids, output_token_ids=h)
            for h in verification.node_histories(request, proposal)
        ]
        return verify_proposal(
            proposal=proposal,
            target_probs=logits_to_probs(logits, rows, eos_token_ids=eos_token_ids),
            generator=request.generator,
            max_new_tokens=request.remaining_output_tokens,
        )

    return engine_verification(verify)


def truncated_draft_model(layers: int, out_dir: Path) -> Path:
    """The embedded model's first `layers` layers as a checkpoint of its own."""
    from safetensors.torch import load_file, save_file

    from quickdraft.models import gguf

    source = gguf.float_checkpoint_dir(gguf.default_model_dir())
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = layers
    if config.get("layer_types"):
        config["layer_types"] = config["layer_types"][:layers]
    (out_dir / "config.json").write_text(json.dumps(config))
    state = load_file(str(source / "model.safetensors"))
    keep = {k: v for k, v in state.items() if ".layers." not in k or int(k.split(".layers.")[1].split(".")[0]) < layers}
    save_file(keep, str(out_dir / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out_dir / name).write_bytes((source / name).read_bytes())
    return out_dir


def run(spec: dict | None, prompts: list[str], params: SamplingParams) -> dict:
    llm = LLM(speculative_config=spec, max_model_len=4096)
    llm.generate(prompts[:1], params)  # warm-up
    start_metrics = llm.get_metrics()
    drafted0, accepted0, forwards0 = (
        start_metrics.num_draft_tokens,
        start_metrics.num_accepted_tokens,
        start_metrics.num_target_forwards,
    )
    tokens, start = 0, time.perf_counter()
    for i, prompt in enumerate(prompts):  # batch 1
        out = llm.generate([prompt], dataclasses.replace(params, seed=1000 + i))[0]
        tokens += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    m = llm.get_metrics()
    drafted, accepted = m.num_draft_tokens - drafted0, m.num_accepted_tokens - accepted0
    return {
        "tokens_per_second": tokens / seconds,
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_forward": tokens / (m.num_target_forwards - forwards0),
    }


def draw_cost(vocab: int = 262144, repeats: int = 30) -> dict:
    """ms per sampled token's draw from a [1, V] distribution: keyed vs the previous exponential race."""
    probs = torch.softmax(torch.randn(1, vocab) * 3, dim=-1)
    generator = make_generator(0)
    costs = {}
    for name, draw in (
        ("keyed", lambda i: sample_keyed(probs, [position_key(7, i)])),
        ("previous", lambda i: sample_from_probs(probs, [generator])),
    ):
        times = []
        for i in range(repeats):
            start = time.perf_counter()
            draw(i)
            times.append(time.perf_counter() - start)
        costs[name] = statistics.median(times) * 1000
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-task", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument(
        "--draft-layers",
        type=int,
        default=15,
        help="the draft model: the target cut to its first N layers (6: ~4%% accepted, 15: ~57%%)",
    )
    parser.add_argument("--methods", default=",".join([*SPECS, "draft_model"]))
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()

    prompts = first_questions(QUESTIONS, args.per_task)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    results: dict = {"setting": vars(args) | {"questions": len(prompts)}, "draw_ms": draw_cost(), "runs": {}}
    print(f"draw of one sampled token (262k vocabulary), median ms: {results['draw_ms']}")
    draft_dir = Path("/tmp/quickdraft-bench") / f"gemma3-first-{args.draft_layers}-layers"
    for method in args.methods.split(","):
        for rule in ("keyed", "rejection"):
            if method == "draft_model":
                spec = {
                    "method": "draft_model",
                    "num_speculative_tokens": 3,
                    "coupling": rule,
                    "model": str(truncated_draft_model(args.draft_layers, draft_dir)),
                }
                figures = run(spec, prompts, params)
            else:
                with rejection_rule_for_point_masses() if rule == "rejection" else contextlib.nullcontext():
                    figures = run(SPECS[method], prompts, params)
            results["runs"][f"{method} {rule}"] = figures
            print(
                f"{method:12s} {rule:9s} "
                + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()),
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
