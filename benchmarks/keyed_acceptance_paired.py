"""Paired check of position-keyed verification: on the very steps a run takes, the accepted
draft tokens it realised against the number either rule accepts in expectation.

For point-mass drafts both rules accept a child x of a node with probability p(x), p the target's
distribution at that node, so the expected number accepted in a step is the sum over draft nodes
of the product of p along their paths.  Comparing runs of the two rules compares different
sampled texts (the drafts depend on the text); comparing realised with expected on the same steps
does not, so a bias in the keyed walk would show here within a few hundred steps.

    python benchmarks/keyed_acceptance_paired.py --method ngram --per-task 3 [--rule rejection]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses

from sampled_acceptance import (
    QUESTIONS,
    SPECS,
    engine_verification,
    first_questions,
    rejection_rule_for_point_masses,
)

from quickdraft import LLM, SamplingParams
from quickdraft.engine import engine as engine_module
from quickdraft.engine import verification
from quickdraft.verify.sampler import RowContext, logits_to_probs, samples_by_argmax


def expected_accepted(proposal, probs) -> float:  # probs [num_nodes, V]: the target's after each node
    reach = [1.0] * len(proposal.token_ids)
    for node in range(1, len(proposal.token_ids)):
        parent = proposal.parents[node]
        reach[node] = reach[parent] * float(probs[parent, proposal.token_ids[node]])
    return sum(reach[1:])


def recording(totals: dict):
    """The verification in force (the engine's, or a rule entered before), with each step's
    realised and expected acceptance added up."""
    previous = engine_module.verify_step

    def recorded(request, proposal, logits, eos_token_ids):
        rows = [0, logits.shape[0]]
        path = previous(
            requests=[request], proposals=[proposal], logits=logits, row_offsets=rows, eos_token_ids=eos_token_ids
        )[0]
        # Steps that max_tokens could cut short are left out: there the expectation above is wrong.
        if (
            proposal.num_draft_tokens
            and proposal.draft_probs is None
            and request.remaining_output_tokens > len(proposal.token_ids)
            and not samples_by_argmax(request.params, num_output_tokens=len(request.output_token_ids))
        ):
            rows = [
                RowContext(params=request.params, prompt_token_ids=request.prompt_token_ids, output_token_ids=h)
                for h in verification.node_histories(request, proposal)
            ]
            probs = logits_to_probs(logits, rows, eos_token_ids=eos_token_ids)
            expected = expected_accepted(proposal, probs)
            totals["steps"] += 1
            totals["realised"] += path.num_accepted
            totals["expected"] += expected
            totals["squared_gap"] += (path.num_accepted - expected) ** 2
        return path

    return engine_verification(recorded)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="ngram", choices=list(SPECS))
    parser.add_argument("--rule", default="keyed", choices=["keyed", "rejection"])
    parser.add_argument("--per-task", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    totals = {"steps": 0, "realised": 0, "expected": 0.0, "squared_gap": 0.0}
    rule = rejection_rule_for_point_masses() if args.rule == "rejection" else contextlib.nullcontext()
    with rule, recording(totals):
        llm = LLM(speculative_config=SPECS[args.method], max_model_len=4096)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
        for i, prompt in enumerate(first_questions(QUESTIONS, args.per_task)):
            llm.generate([prompt], dataclasses.replace(params, seed=1000 + i))
    # Each step's gap has mean 0 given its context; their sum over n steps has sd ~ sqrt(sum of squares).
    z = (totals["realised"] - totals["expected"]) / max(totals["squared_gap"], 1e-9) ** 0.5
    print(
        f"{args.method} {args.rule}: {totals['steps']} steps, accepted {totals['realised']}, "
        f"expected {totals['expected']:.1f} ({totals['realised'] / totals['steps']:.3f} vs "
        f"{totals['expected'] / totals['steps']:.3f} per step), z = {z:+.2f}"
    )


if __name__ == "__main__":
    main()
