"""Embeddings of one EmbeddingGemma-shaped GGUF by quickdraft, llama.cpp (llama-cpp-python) and
sentence-transformers, side by side: the vectors (cosine of each text's vectors) and the time per text.

The model: EmbeddingGemma 300M's shapes (Gemma 3 layers as an encoder: 24 layers, hidden 768,
3 query heads / 1 key head of 256, MLP 1152, bidirectional attention with a 512-position sliding
span on 5 of every 6 layers, mean pooling, Dense 768 -> 3072 -> 768, normalised) with random
weights (transformers' initialisation; nothing can be downloaded here), the embedded Gemma 3
270M's tokenizer (the same 262,144-token vocabulary), written as llama.cpp's converter writes the
`gemma-embedding` architecture with every matrix `--qtype`.  Texts: Spec-Bench first turns.

Peers: llama.cpp on the same file; sentence-transformers (`--peers`) on its float32 values (the
converted directory's float copy with its modules: the very weights for F16 / F32 files).
Each engine runs in a process of its own (another engine's threads, spinning after their work,
would take its cores), the engines alternating for `--rounds` rounds; each round embeds every text
once after a warm-up.  Printed: per engine the median seconds per text over rounds (and tokens a
second), and per peer the cosine of its vectors and quickdraft's per text (min / median), how many
texts both tokenizers turned into the same ids, and quickdraft's speedup.

    python benchmarks/embedding_peers.py --gguf /tmp/embeddinggemma-shaped-q8_0.gguf --texts 40 \
        --peers llama.cpp sentence-transformers
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

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the tests' GGUF writer
PEERS = ("llama.cpp", "sentence-transformers")
QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "specbench" / "questions.dev.jsonl"


def encoder_config(vocab_size: int, *, bos: int, eos: int, pad: int):
    import transformers

    return transformers.Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=768,
        intermediate_size=1152,
        num_hidden_layers=24,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        max_position_embeddings=2048,
        use_bidirectional_attention=True,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )


def write_model(path: Path, *, qtype: str) -> None:
    """The random EmbeddingGemma-shaped model as a `gemma-embedding` GGUF (the tests' writer), its
    tokenizer copied from the embedded Gemma 3 270M's file."""
    import torch
    import transformers

    from quickdraft.models.gguf import default_gguf_path, read_gguf
    from tests.models.test_embedding_models import write_embedding_gguf
    from tests.models.test_gguf import TinyVocab

    source = read_gguf(default_gguf_path()).fields
    vocab = TinyVocab(
        model=source["tokenizer.ggml.model"],
        pre=source.get("tokenizer.ggml.pre", "default"),
        tokens=source["tokenizer.ggml.tokens"],
        types=source["tokenizer.ggml.token_type"],
        scores=source["tokenizer.ggml.scores"],
        bos_id=source["tokenizer.ggml.bos_token_id"],
        eos_id=source["tokenizer.ggml.eos_token_id"],
        unk_id=source.get("tokenizer.ggml.unknown_token_id"),
        pad_id=source.get("tokenizer.ggml.padding_token_id"),
        add_bos=True,
        add_eos=True,  # EmbeddingGemma's tokenizer ends every text with <eos>
        add_space_prefix=source.get("tokenizer.ggml.add_space_prefix", False),
    )
    config = encoder_config(len(vocab.tokens), bos=vocab.bos_id, eos=vocab.eos_id, pad=vocab.pad_id or 0)
    torch.manual_seed(0)
    model = transformers.Gemma3TextModel(config).float().eval()
    generator = torch.Generator().manual_seed(1)
    dense = [torch.randn(3072, 768, generator=generator) * 0.02, torch.randn(768, 3072, generator=generator) * 0.02]
    write_embedding_gguf(path, model, dense=dense, vocab=vocab, qtype=qtype)


def texts(count: int) -> list[str]:
    lines = QUESTIONS.read_text().splitlines()
    return [json.loads(line)["turns"][0] for line in lines[:count]]


def run_engine(engine: str, path: Path, *, count: int, threads: int) -> dict:
    """One round of one engine: a warm-up, then every text once; its vectors, ids and times."""
    inputs = texts(count)
    if engine == "quickdraft":
        from quickdraft import LLM

        llm = LLM(str(path), max_model_len=2048, max_num_seqs=1)
        ids = [llm.tokenizer.encode(text) for text in inputs]
        embed = lambda text: llm.embed([text])[0].outputs.embedding  # noqa: E731
    elif engine == "sentence-transformers":
        import torch
        from sentence_transformers import SentenceTransformer

        from quickdraft.models.gguf import float_checkpoint_dir
        from quickdraft.models.loader import resolve_model_dir

        torch.set_num_threads(threads)
        # the file's values as float32 (F16 and F32 files: the very weights), with its modules
        model = SentenceTransformer(str(float_checkpoint_dir(resolve_model_dir(path))), device="cpu")
        ids = [model.tokenizer(text)["input_ids"] for text in inputs]
        embed = lambda text: model.encode(text, normalize_embeddings=True)  # noqa: E731
    else:
        import llama_cpp

        llm = llama_cpp.Llama(
            str(path), embedding=True, n_ctx=2048, n_batch=2048, n_ubatch=2048, n_threads=threads, verbose=False
        )
        ids = [llm.tokenize(text.encode("utf-8")) for text in inputs]  # as its embed tokenizes
        embed = lambda text: llm.embed(text, normalize=True)  # noqa: E731
    embed(inputs[0])
    vectors, seconds = [], []
    for text in inputs:
        start = time.perf_counter()
        vectors.append(list(map(float, embed(text))))
        seconds.append(time.perf_counter() - start)
    return {"vectors": vectors, "ids": ids, "seconds": seconds}


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (sum(x * x for x in a) ** 0.5 * sum(y * y for y in b) ** 0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True, help="written here when missing")
    parser.add_argument("--qtype", default="Q8_0")
    parser.add_argument("--texts", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="the summary and every round's times, as JSON")
    parser.add_argument(
        "--peers", nargs="+", default=["llama.cpp"], choices=PEERS, help="engines compared with quickdraft"
    )
    parser.add_argument("--engine", choices=["quickdraft", *PEERS], help="(internal) one engine, one round")
    args = parser.parse_args()
    if args.engine:
        print(json.dumps(run_engine(args.engine, args.gguf, count=args.texts, threads=args.threads)))
        return
    if not args.gguf.exists():
        write_model(args.gguf, qtype=args.qtype)
    rounds: dict[str, list[dict]] = {name: [] for name in ["quickdraft", *args.peers]}
    for _ in range(args.rounds):
        for engine in rounds:
            child = [sys.executable, __file__, "--gguf", str(args.gguf), "--engine", engine]
            child += ["--texts", str(args.texts), "--threads", str(args.threads)]
            output = subprocess.run(child, check=True, capture_output=True, text=True, env=dict(os.environ)).stdout
            rounds[engine].append(json.loads(output.strip().splitlines()[-1]))
    ours = rounds["quickdraft"][0]
    tokens = sum(len(ids) for ids in ours["ids"])
    per_round = {name: [sum(r["seconds"]) for r in runs] for name, runs in rounds.items()}
    median = {name: statistics.median(totals) for name, totals in per_round.items()}
    agreement = {}
    for peer in args.peers:
        theirs = rounds[peer][0]
        cosines = [cosine(a, b) for a, b in zip(ours["vectors"], theirs["vectors"])]
        agreement[peer] = {
            "same_token_ids": sum(a == b for a, b in zip(ours["ids"], theirs["ids"])),
            "cosine_min": round(min(cosines), 6),
            "cosine_median": round(statistics.median(cosines), 6),
            "quickdraft_speedup": round(median[peer] / median["quickdraft"], 3),
        }
    summary = {
        "file": str(args.gguf),
        "size_mb": round(args.gguf.stat().st_size / 1e6, 1),
        "texts": args.texts,
        "tokens": tokens,
        "ms_per_text_median": {name: round(1000 * value / args.texts, 1) for name, value in median.items()},
        "tokens_per_s_median": {name: round(tokens / value, 1) for name, value in median.items()},
        "seconds_per_round": {name: [round(x, 3) for x in totals] for name, totals in per_round.items()},
        "vs_quickdraft": agreement,
    }
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
