"""A GGUF decoded plainly by quickdraft and by llama.cpp (llama-cpp-python) on the same file, one
process per engine run: a random model with a real model's layer shapes but `--layers` layers and
a small byte-level vocabulary, written as llama.cpp writes GGUF files (the tests' writer; routers
and the shared-expert gate F32, every other matrix `--qtype`):

- `qwen3moe`: Qwen3-30B-A3B's layers (hidden 2048, 32 query / 4 key heads of 128, experts of 768,
  8 of `--experts` a token);
- `qwen2moe`: Qwen1.5-MoE-A2.7B's (hidden 2048, 16 heads of 128 with q/k/v biases, experts of
  1408, 4 of `--experts` a token, not renormalised, a gated shared expert of 5632);
- `qwen2`: Qwen2.5-1.5B's dense layers (hidden 1536, 12 query / 2 key heads of 128 with q/k/v
  biases, MLP 8960);
- `gpt-oss`: gpt-oss-20b's (hidden 2880, 64 query / 8 key heads of 64 with biases and sinks,
  sliding 128-token windows every other layer, experts of 2880, 4 of `--experts` a token, biased
  router and experts, YaRN).

Greedy decoding of `--tokens` tokens after a short prompt, end of sequence ignored; each engine
runs in a process of its own (another engine's threads, spinning after their work, would take its
cores), the engines alternating for `--rounds` rounds, each a warm-up then the median of
`--repeats` runs; the medians over rounds are printed (the model's text is noise: only the speed
is compared).  `--base DIR` adds quickdraft from another checkout (its own kernel build and
cache) as a third engine.  With a few of the real model's layers, the per-token work outside the
layers (the LM head call, sampling, the engine's step) weighs more than it would there.

    python benchmarks/moe_gguf_peers.py --gguf /tmp/moe.gguf --layers 4 --experts 32 --qtype Q8_0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the tests' GGUF writer (after PYTHONPATH: A/B runs)


def model_config(architecture: str, *, layers: int, experts: int, vocab_size: int, **extra):
    """A transformers config with the layer shapes named in this module's docstring."""
    import transformers
    from moe_decode import qwen3_30b_a3b_layers  # run from benchmarks/: its folder is on the path

    if architecture == "qwen3moe":
        return qwen3_30b_a3b_layers(layers=layers, experts=experts, vocab_size=vocab_size, **extra)
    common = dict(vocab_size=vocab_size, num_hidden_layers=layers, max_position_embeddings=4096, **extra)
    if architecture == "gpt-oss":
        return transformers.GptOssConfig(
            hidden_size=2880,
            intermediate_size=2880,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=experts,
            num_experts_per_tok=4,
            sliding_window=128,
            tie_word_embeddings=False,
            **common,
        )
    if architecture == "qwen2moe":
        return transformers.Qwen2MoeConfig(
            hidden_size=2048,
            intermediate_size=5632,
            num_attention_heads=16,
            num_key_value_heads=16,
            num_experts=experts,
            num_experts_per_tok=4,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            norm_topk_prob=False,
            tie_word_embeddings=False,
            **common,
        )
    return transformers.Qwen2Config(
        hidden_size=1536,
        intermediate_size=8960,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        **common,
    )


def write_model(path: Path, *, architecture: str, layers: int, experts: int, qtype: str) -> None:
    import torch
    import transformers
    from gguf import GGMLQuantizationType as QType

    from tests.models.test_gguf import byte_level_vocab, write_tiny_gguf

    vocab = byte_level_vocab(pre="qwen2")
    config = model_config(
        architecture,
        layers=layers,
        experts=experts,
        vocab_size=len(vocab.tokens),
        bos_token_id=vocab.bos_id,
        eos_token_id=vocab.eos_id,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # biases as trained models have them, not transformers' zeros
        for name, parameter in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                parameter.normal_(0.0, 0.5)
    # MXFP4_MOE: llama.cpp's mix for MoE models (the experts MXFP4, random blocks here; the rest Q8_0);
    # MXFP4_F16: the experts MXFP4, the rest F16
    if qtype.startswith("MXFP4_"):
        qtypes = {"_exps": QType.MXFP4, "": QType.Q8_0 if qtype == "MXFP4_MOE" else QType.F16}
    else:
        qtypes = {"": QType[qtype]}
    write_tiny_gguf(path, architecture=architecture, model=model, vocab=vocab, qtypes=qtypes)


def quickdraft_rate(llm, prompt: list[int], tokens: int) -> float:
    """Decode tokens a second: a request of `tokens` tokens minus one of a single token (the prefill)."""
    from quickdraft import SamplingParams

    def seconds(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
        assert len(out.outputs[0].token_ids) == max_tokens
        return time.perf_counter() - start

    return (tokens - 1) / (seconds(tokens) - seconds(1))


def llama_cpp_rate(llm, prompt: list[int], tokens: int) -> float:
    llm.reset()
    llm.eval(prompt)
    start = time.perf_counter()
    for _ in range(tokens - 1):
        token = llm.sample(temp=0.0)
        llm.eval([token])
    return (tokens - 1) / (time.perf_counter() - start)


def engine_rate(
    engine: str, path: Path, *, tokens: int, threads: int, repeats: int, quantization: str | None = None
) -> float:
    """The median decode rate of `repeats` runs of one engine, after a warm-up (a kernel build
    after a source change, first touches of the weights)."""
    prompt = list(range(3, 35))
    if engine.startswith("quickdraft"):
        from quickdraft import LLM

        llm = LLM(str(path), max_model_len=512, max_num_seqs=1, quantization=quantization)
        rate = quickdraft_rate
    else:
        import llama_cpp

        llm = llama_cpp.Llama(str(path), n_ctx=512, n_threads=threads, n_batch=512, verbose=False)
        rate = llama_cpp_rate
    rate(llm, prompt, 4)
    return statistics.median(rate(llm, prompt, tokens) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True, help="written here when missing")
    parser.add_argument("--architecture", choices=["qwen3moe", "qwen2moe", "qwen2", "gpt-oss"], default="qwen3moe")
    parser.add_argument("--base", type=Path, help="another quickdraft checkout, run as a third engine")
    parser.add_argument("--quantization", help="quickdraft's (default: auto, the GGUF as stored)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument(
        "--qtype", default="Q8_0", help="a GGUF type, or MXFP4_MOE / MXFP4_F16 (experts MXFP4, the rest Q8_0 / F16)"
    )
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="runs per engine and round (median)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--engine", choices=["quickdraft", "quickdraft@base", "llama.cpp"], help="(internal) one engine, one rate"
    )
    args = parser.parse_args()
    if args.engine:  # a child: one engine in its own process (no other engine's threads beside it)
        rate = engine_rate(
            args.engine,
            args.gguf,
            tokens=args.tokens,
            threads=args.threads,
            repeats=args.repeats,
            quantization=args.quantization,
        )
        print(json.dumps({"rate": rate}))
        return
    if not args.gguf.exists():
        write_model(
            args.gguf, architecture=args.architecture, layers=args.layers, experts=args.experts, qtype=args.qtype
        )
    rates: dict[str, list[float]] = {"quickdraft": [], "llama.cpp": []}
    if args.base is not None:
        rates["quickdraft@base"] = []
    for _ in range(args.rounds):
        for engine in rates:
            child = [sys.executable, __file__, "--gguf", str(args.gguf), "--engine", engine]
            child += ["--tokens", str(args.tokens), "--repeats", str(args.repeats), "--threads", str(args.threads)]
            child += [] if args.quantization is None else ["--quantization", args.quantization]
            env = dict(os.environ)
            if engine == "quickdraft@base":  # the other checkout with a kernel build and cache of its own
                env |= {
                    "PYTHONPATH": str(args.base),
                    "TORCH_EXTENSIONS_DIR": f"{args.base}-ext",
                    "QUICKDRAFT_CACHE": f"{args.base}-cache",
                }
            output = subprocess.run(child, check=True, capture_output=True, text=True, env=env).stdout
            rates[engine].append(json.loads(output.strip().splitlines()[-1])["rate"])
    medians = {name: statistics.median(r) for name, r in rates.items()}
    print(
        json.dumps(
            {
                "file": str(args.gguf),
                "size_mb": round(args.gguf.stat().st_size / 1e6, 1),
                "decode_tok_s_median": {k: round(v, 1) for k, v in medians.items()},
                "decode_tok_s_rounds": {k: [round(x, 1) for x in v] for k, v in rates.items()},
                "quickdraft_vs_llama_cpp": round(medians["quickdraft"] / medians["llama.cpp"], 3),
            }
            | (
                {"quickdraft_vs_base": round(medians["quickdraft"] / medians["quickdraft@base"], 3)}
                if args.base is not None
                else {}
            )
        )
    )


if __name__ == "__main__":
    main()
