"""Keyed coupling vs min(1, p/q) for a sampled draft model, per draft token, on real texts.

For a draft model that samples its token from q while the target's distribution is p, the
previous rule accepts with probability sum_x min(p(x), q(x)) (the best any coupling can do);
the keyed coupling draws both with the same position-keyed exponential noise E and accepts when
argmax p/E == argmax q/E.  This script measures both per position, on Spec-Bench texts sampled
from the embedded Gemma 3 270M, with draft models of several strengths: the target cut to its
first k layers (the final norm and LM head applied to layer k's output, which is exactly the
truncated checkpoint `sampled_acceptance.py` builds for its draft-model run).

    python benchmarks/coupling_acceptance.py --per-task 1 --keys 64 --cuts 6,9,12,15,17
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from sampled_acceptance import QUESTIONS, first_questions

from quickdraft import LLM, SamplingParams
from quickdraft.verify.sampler import keyed_noise, position_key


def cut_probs(model, token_ids: list[int], cuts: list[int], temperature: float) -> dict[int, torch.Tensor]:
    """{k: [T, V] softmax(logits / temperature) of the model cut after k layers}; k = all layers is the target."""
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_hidden_states=True)
        probs = {}
        for k in cuts:
            hidden = out.hidden_states[k][0]
            if k < len(out.hidden_states) - 1:  # the last entry already went through the final norm
                hidden = model.model.norm(hidden)
            probs[k] = torch.softmax(model.lm_head(hidden).float() / temperature, dim=-1)
    return probs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-task", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--keys", type=int, default=64, help="keyed noise draws per position (Monte Carlo)")
    parser.add_argument("--cuts", default="6,9,12,15,17")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import transformers

    from quickdraft.models.gguf import default_model_dir, float_checkpoint_dir

    model = transformers.AutoModelForCausalLM.from_pretrained(
        float_checkpoint_dir(default_model_dir()), dtype=torch.float32
    ).eval()
    layers = model.config.num_hidden_layers
    cuts = [int(c) for c in args.cuts.split(",")]
    llm = LLM(max_model_len=4096)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    totals = {k: {"rejection": 0.0, "keyed": 0.0} for k in cuts}
    positions = 0
    for i, prompt in enumerate(first_questions(QUESTIONS, args.per_task)):
        out = llm.generate([prompt], dataclasses.replace(params, seed=1000 + i))[0]
        prompt_ids, output_ids = out.prompt_token_ids, out.outputs[0].token_ids
        probs = cut_probs(model, prompt_ids + output_ids, [*cuts, layers], args.temperature)
        for t in range(len(output_ids)):
            row = len(prompt_ids) - 1 + t  # predicts output position t
            target = probs[layers][row]  # [V]
            noise = torch.stack([keyed_noise(position_key(seed, t), target.numel()) for seed in range(args.keys)])
            target_draws = (target / noise).argmax(dim=-1)  # [keys]
            for k in cuts:
                draft = probs[k][row]
                totals[k]["rejection"] += float(torch.minimum(target, draft).sum())
                totals[k]["keyed"] += float(((draft / noise).argmax(dim=-1) == target_draws).float().mean())
            positions += 1
        print(f"question {i}: {positions} positions so far", flush=True)
    results = {
        "setting": vars(args) | {"positions": positions},
        "per_cut": {k: {rule: value / positions for rule, value in v.items()} for k, v in totals.items()},
    }
    for k, rates in results["per_cut"].items():
        print(
            f"first {k:2d} of {layers} layers: min(1, p/q) accepts {rates['rejection']:.3f}, "
            f"keyed coupling {rates['keyed']:.3f} per draft token"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
