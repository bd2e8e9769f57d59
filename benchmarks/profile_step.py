"""Where the milliseconds of one batch-1 decode step go (embedded Gemma 3 270M by default).

Times every matmul by the layer it belongs to (synchronously, so the sum is real wall
time), the whole forward, and the sampling, then prints a table with the bytes each part
reads and the bandwidth it achieves.

    python benchmarks/profile_step.py --dtype bfloat16 --steps 48
"""

from __future__ import annotations

import argparse
import collections
import time


def categorize(weight, model) -> str:
    if weight is model.lm_head_weight:
        return "lm_head"
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            if getattr(layer, name) is weight:
                return name
    return "other"


def weight_bytes(weight) -> int:
    return weight.nbytes if hasattr(weight, "parts") else weight.numel() * weight.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto", help="auto: the GGUF weights as stored (default)")
    parser.add_argument("--steps", type=int, default=48)
    args = parser.parse_args()

    from quickdraft import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=512)
    engine, model = llm.engine, llm.engine.model
    inner_linear = model.linear
    seconds: dict[str, float] = collections.defaultdict(float)
    bytes_read: dict[str, int] = collections.defaultdict(int)
    names: dict[int, str] = {}

    def timed_linear(x, weight, bias=None):
        key = names.setdefault(id(weight), categorize(weight, model))
        if key == "lm_head":  # timed by timed_logits
            return inner_linear(x, weight, bias)
        start = time.perf_counter()
        out = inner_linear(x, weight, bias)
        seconds[key] += time.perf_counter() - start
        bytes_read[key] += weight_bytes(weight)
        return out

    # The engine's quantized LM head writes into the runner's logits buffer without model.linear.
    inner_logits = model.compute_logits

    def timed_logits(hidden, **kw):
        start = time.perf_counter()
        out = inner_logits(hidden, **kw)
        seconds["lm_head"] += time.perf_counter() - start
        bytes_read["lm_head"] += weight_bytes(model.lm_head_weight)
        return out

    forward_seconds = [0.0]
    inner_forward = engine.runner.forward

    def timed_forward(*a, **kw):
        start = time.perf_counter()
        out = inner_forward(*a, **kw)
        forward_seconds[0] += time.perf_counter() - start
        return out

    params = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
    llm.generate(["warm up"], SamplingParams(temperature=0, max_tokens=4))
    request_id = engine.add_request(prompt="The history of the printing press", params=params)
    engine.step()  # prefill + first token, not counted
    model.linear, model.compute_logits, engine.runner.forward = timed_linear, timed_logits, timed_forward
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    total = time.perf_counter() - start
    model.linear, engine.runner.forward = inner_linear, inner_forward
    del model.compute_logits  # the method again
    engine.release(request_id)

    per_step = lambda s: 1e3 * s / steps  # noqa: E731
    print(f"{args.dtype}, batch 1, {steps} decode steps: {per_step(total):.2f} ms/step ({steps / total:.1f} tokens/s)")
    print(f"{'part':<28}{'ms/step':>9}{'share':>8}{'MB/step':>9}{'GB/s':>7}")
    matmul_total = 0.0
    for key in ("lm_head", "gate_up_proj", "down_proj", "qkv_proj", "o_proj", "other"):
        if key not in seconds:
            continue
        matmul_total += seconds[key]
        mb = bytes_read[key] / steps / 1e6
        print(
            f"{'matmul ' + key:<28}{per_step(seconds[key]):9.2f}{seconds[key] / total:8.0%}{mb:9.1f}"
            f"{mb / 1e3 / (seconds[key] / steps):7.1f}"
        )
    rest_forward = forward_seconds[0] - matmul_total
    rest_step = total - forward_seconds[0]
    print(f"{'rest of forward (attention,':<28}{per_step(rest_forward):9.2f}{rest_forward / total:8.0%}")
    print(f"{'  norms, rope, kv, python)':<28}")
    print(f"{'sampling, detokenize, sched':<28}{per_step(rest_step):9.2f}{rest_step / total:8.0%}")


if __name__ == "__main__":
    main()
