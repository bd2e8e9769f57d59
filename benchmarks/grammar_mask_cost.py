"""Per-token mask cost of the two maintained grammar engines on the embedded tokenizer (262k ids).

Walks a valid answer token by token (our tokenizer's tokens of a JSON document / a regex
match), computing the next-token mask before each token and consuming it, and reports the
one-off costs (tokenizer set-up, grammar compile) and the per-token mask time (median, p90).
This is how `quickdraft.structured` chose its engine; run:

    .venv/bin/python benchmarks/grammar_mask_cost.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["mathematics", "poetry of science", "engines"],
    "address": {"city": "London", "zip": "12345"},
}
REGEX = r"(\d{3})-(\d{3})-(\d{4}) \((home|work|mobile)\)"
REGEX_TEXT = "555-123-4567 (mobile)"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def walk_llguidance(tokenizer_json: str, eos: int, vocab_size: int, grammar: str, tokens: list[int], repeats: int):
    import llguidance
    import llguidance.torch

    start = time.perf_counter()
    ll_tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
    setup = time.perf_counter() - start
    times, compile_times = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        compile_times.append(time.perf_counter() - start)
        assert not matcher.is_error(), matcher.get_error()
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        for token in tokens:
            start = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
            times.append(time.perf_counter() - start)
            allowed = (int(bitmask[0, token // 32]) >> (token % 32)) & 1
            assert allowed, f"llguidance forbids token {token}"
            assert matcher.consume_token(token), matcher.get_error()
    return setup, statistics.median(compile_times), times


def walk_xgrammar(tokenizer_json: str, eos: int, vocab_size: int, kind: str, source: str, tokens, repeats: int):
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_vocab_and_metadata(
        encoded_vocab=_vocab_strings(tokenizer_json, vocab_size),
        metadata=json.dumps(  # byte fallback (sentencepiece)
            {"vocab_type": 1, "vocab_size": vocab_size, "add_prefix_space": False, "stop_token_ids": [eos]}
        ),
    )
    compiler = xgrammar.GrammarCompiler(info, max_threads=2)
    setup = time.perf_counter() - start
    times, compile_times = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(source) if kind == "json" else compiler.compile_regex(source)
        compile_times.append(time.perf_counter() - start)
        compiler.clear_cache()
        matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=[eos])
        bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        for token in tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - start)
            assert matcher.accept_token(token), f"xgrammar forbids token {token}"
    return setup, statistics.median(compile_times), times


def _vocab_strings(tokenizer_json: str, vocab_size: int) -> list[str]:
    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    pieces = [""] * vocab_size
    for piece, index in vocab.items() if isinstance(vocab, dict) else ((p, i) for i, (p, _) in enumerate(vocab)):
        if index < vocab_size:
            pieces[index] = piece
    for added in json.loads(tokenizer_json).get("added_tokens", []):
        if added["id"] < vocab_size:
            pieces[added["id"]] = added["content"]
    return pieces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from quickdraft.models import gguf
    from quickdraft.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(gguf.default_model_dir())
    tokenizer_json = tokenizer.backend.to_str()
    eos, vocab_size = tokenizer.eos_token_ids[0], tokenizer.vocab_size
    cases = {
        "json_schema": ("json", json.dumps(SCHEMA), json.dumps(DOCUMENT)),
        "regex": ("regex", REGEX, REGEX_TEXT),
    }
    import llguidance

    for name, (kind, source, text) in cases.items():
        tokens = tokenizer.encode(text, add_special_tokens=False) + [eos]
        grammar = (
            llguidance.LLMatcher.grammar_from_json_schema(source)
            if kind == "json"
            else llguidance.LLMatcher.grammar_from_regex(source)
        )
        for engine, walk in (
            ("llguidance", partial(walk_llguidance, tokenizer_json, eos, vocab_size, grammar, tokens, args.repeats)),
            ("xgrammar", partial(walk_xgrammar, tokenizer_json, eos, vocab_size, kind, source, tokens, args.repeats)),
        ):
            try:
                setup, compile_s, times = walk()
            except Exception as error:  # an engine that cannot walk the answer is reported, not hidden
                print(f"{name:12s} {engine:11s} failed: {type(error).__name__}: {error}")
                continue
            print(
                f"{name:12s} {engine:11s} tokens {len(tokens):3d}  set-up {setup * 1e3:7.1f} ms  "
                f"compile {compile_s * 1e3:7.1f} ms  mask median {statistics.median(times) * 1e6:7.1f} us  "
                f"p90 {percentile(times, 0.9) * 1e6:7.1f} us  max {max(times) * 1e6:8.1f} us"
            )


if __name__ == "__main__":
    main()
