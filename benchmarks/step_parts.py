"""Where a batch-1 decoding step goes, speculative or plain: milliseconds per decode step in the
engine's parts (the target forward, the LM-head calls inside and after it, drafting, the
verification walks, the commits), timed around the engine's own methods on Spec-Bench first
turns.  Steps whose forward feeds more than `--max-decode-rows` tokens (prompt prefill) are left
out.  Compare configurations run in one invocation: this VM's speed drifts between runs.

    python benchmarks/step_parts.py --config null '{"method": "eagle3"}' --prompts 10
"""

from __future__ import annotations

import argparse
import collections
import json
import time

from sampled_acceptance import QUESTIONS  # run from benchmarks/: its folder is on the path

import quickdraft.engine.engine as engine_module
from quickdraft import LLM, SamplingParams

PARTS = ("step", "forward", "lm_head", "propose", "verify_walk", "commit")


class StepTimer:
    """Wraps an engine's parts with timers; counts only decode steps."""

    def __init__(self, llm: LLM, *, max_decode_rows: int):
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.rows = self.lm_rows = 0
        self.in_prefill = False
        self.max_decode_rows = max_decode_rows
        engine = llm.engine
        self._wrap(engine, "step", "step")
        self._wrap(engine.runner, "forward", "forward", before=self._forward_rows)
        self._wrap(engine.runner.model, "compute_logits", "lm_head", before=self._lm_rows)
        self._wrap(engine_module, "verify_step", "verify_walk")
        self._wrap(engine, "_commit", "commit")
        if engine.speculator is not None:
            self._wrap(engine.speculator, "propose", "propose")

    def _forward_rows(self, args, kwargs) -> None:
        work = args[0] if args else kwargs["work"]
        rows = sum(len(w.token_ids) for w in work)
        self.in_prefill = rows > self.max_decode_rows
        if not self.in_prefill:
            self.rows += rows

    def _lm_rows(self, args, kwargs) -> None:
        if not self.in_prefill:
            self.lm_rows += args[0].shape[0]

    def _wrap(self, owner, name: str, part: str, before=None) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            if before is not None:
                before(args, kwargs)
            started = time.perf_counter()
            result = inner(*args, **kwargs)
            if not self.in_prefill:
                self.seconds[part] += time.perf_counter() - started
                self.calls[part] += 1
            return result

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.rows = self.lm_rows = 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", nargs="+", default=["null", '{"method": "eagle3"}'], help="JSON, null = plain")
    parser.add_argument("--prompts", type=int, default=10, help="first turns, spread over the question file")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-decode-rows", type=int, default=24)
    args = parser.parse_args()
    questions = [json.loads(line) for line in QUESTIONS.read_text().splitlines()]
    stride = max(1, len(questions) // args.prompts)
    prompts = [q["turns"][0] for q in questions[::stride][: args.prompts]]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for config in args.config:
        llm = LLM(speculative_config=json.loads(config))
        timer = StepTimer(llm, max_decode_rows=args.max_decode_rows)
        llm.generate(prompts[:1], params)  # warm-up
        timer.reset()
        tokens = sum(len(llm.generate([p], params)[0].outputs[0].token_ids) for p in prompts)
        steps = timer.calls["step"]
        print(f"== {config}: {steps} decode steps, {tokens} tokens ({tokens / steps:.2f} a step with prefill's first)")
        print(f"   rows fed a step {timer.rows / steps:.2f}, LM-head rows a step {timer.lm_rows / steps:.2f}")
        for part in PARTS:
            per_step = timer.seconds[part] / steps * 1e3
            print(f"   {part:12s} {per_step:7.2f} ms a step   ({timer.calls[part] / steps:.2f} calls a step)")
        llm.close()


if __name__ == "__main__":
    main()
