"""Structured outputs with speculation on the embedded model: JSON-schema extraction prompts.

Each prompt (the five Spec-Bench `extraction` questions of questions.dev.jsonl, each with a
schema written for it, and seven extraction prompts written here) is answered greedily at
batch 1 under its JSON schema, once per configuration, interleaved (prompt by prompt, every
configuration in turn), and compared with constrained plain decoding: tokens per second, target
forwards, identical outputs, whether the output parses and has the schema's required keys, and
the grammar's cost per generated token (tree walks with masks, and applying masks to logits).
"ceiling" drafts plain decoding's own answer, token for token (answer_drafter.py, chains of up
to 16): what a drafter that is always right reaches at this engine's step costs, the bound on every
other row's speedup.  (Not the request's `prediction`: that is text, and constrained answers
often re-encode to other tokens than the grammar let the model choose.)

    .venv/bin/python benchmarks/structured_outputs.py --out benchmarks/structured-2026-12-01
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from answer_drafter import CHAIN, AnswerDrafter
from results_files import save_results, totals

SPECBENCH = Path(__file__).resolve().parents[2] / "shared/data/specbench/questions.dev.jsonl"
CEILING = "ceiling (plain's answer drafted)"
CONFIGS = {
    "plain": None,
    CEILING: None,  # AnswerDrafter of plain's answer (run after plain)
    "grammar": {"method": "grammar"},
    "suffix": {"method": "suffix"},
    "suffix, 5 nodes (the default before 2026-12-03)": {"method": "suffix", "num_speculative_tokens": 5},
    "suffix, not periodic (before 2026-12-04)": {"method": "suffix", "periodic": False},
    "grammar+suffix": {"method": "hybrid", "drafters": [{"method": "grammar"}, {"method": "suffix"}]},
    "hybrid (default demo: suffix + eagle3)": {
        "method": "hybrid",
        "drafters": [{"method": "suffix"}, {"method": "eagle3", "top_k": 1, "num_speculative_tokens": 5}],
        "skip_after": 2,
    },
    "eagle3": {"method": "eagle3"},  # the shipped head's recommended chain (8, p >= 0.2)
    "suffix+eagle3": {"method": "hybrid", "drafters": [{"method": "suffix"}, {"method": "eagle3"}]},
    "grammar+suffix+eagle3": {
        "method": "hybrid",
        "drafters": [
            {"method": "grammar"},
            {"method": "suffix"},
            {"method": "eagle3", "top_k": 1, "num_speculative_tokens": 5},
        ],
        "skip_after": 2,
    },
}


def string(max_length: int = 40) -> dict:
    return {"type": "string", "maxLength": max_length}


def obj(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


SPECBENCH_SCHEMAS = {
    132: obj(
        {"answers": {"type": "array", "items": {"enum": ["Literature", "History", "Science", "Art"]}, "maxItems": 4}}
    ),
    134: obj({"company": string(), "ceo": string(), "profit_billion_usd": {"type": "number"}}),
    136: obj({"Amazon": {"type": "integer"}, "river": {"type": "integer"}, "you": {"type": "integer"}}),
    138: obj({"iPhone": {"type": "number"}, "Samsung Galaxy": {"type": "number"}, "Google Pixel": {"type": "number"}}),
    140: obj(
        {
            "months": {
                "type": "array",
                "items": obj(
                    {"month": string(7), "highest_close": {"type": "number"}, "lowest_close": {"type": "number"}}
                ),
            }
        }
    ),
}

WRITTEN = [
    (
        "Extract the person's details from the text as JSON.\nText: Maria Gonzalez, 34, works as a civil "
        "engineer in Valencia, Spain. You can reach her at maria.g@example.com.\nJSON:\n",
        obj({"name": string(), "age": {"type": "integer"}, "job": string(), "city": string(), "email": string()}),
    ),
    (
        "Turn this order into JSON.\nOrder: 3 blue notebooks at $4.50 each and 2 black pens at $1.20 each, "
        "shipped to 12 Baker Street, London.\nJSON:\n",
        obj(
            {
                "items": {
                    "type": "array",
                    "items": obj(
                        {"product": string(), "quantity": {"type": "integer"}, "unit_price": {"type": "number"}}
                    ),
                },
                "address": string(60),
            }
        ),
    ),
    (
        "Extract the meeting from the email as JSON.\nEmail: Hi team, let's meet on Thursday 14 March at 10:30 in "
        "room B2 to review the Q1 budget. Please bring the draft figures. - Tom\nJSON:\n",
        obj(
            {
                "day": string(),
                "date": string(),
                "time": string(8),
                "room": string(8),
                "topic": string(),
                "organiser": string(),
            }
        ),
    ),
    (
        "Classify the sentiment of each review and return JSON.\nReview 1: The battery lasts forever, love it.\n"
        "Review 2: Broke after two days, waste of money.\nReview 3: It's fine, nothing special.\nJSON:\n",
        obj(
            {
                "reviews": {
                    "type": "array",
                    "items": obj(
                        {"review": {"type": "integer"}, "sentiment": {"enum": ["positive", "negative", "neutral"]}}
                    ),
                    "maxItems": 3,
                }
            }
        ),
    ),
    (
        "Extract the book's metadata as JSON.\nThe novel 'The Remains of the Day' by Kazuo Ishiguro was published "
        "in 1989 by Faber and Faber and won the Booker Prize the same year.\nJSON:\n",
        obj(
            {
                "title": string(),
                "author": string(),
                "year": {"type": "integer"},
                "publisher": string(),
                "award": string(),
            }
        ),
    ),
    (
        "Give the weather report as JSON.\nReport: Tomorrow in Oslo: light snow in the morning, clearing later, "
        "high of -2 C, low of -8 C, wind from the north at 15 km/h.\nJSON:\n",
        obj(
            {
                "city": string(),
                "conditions": string(60),
                "high_c": {"type": "integer"},
                "low_c": {"type": "integer"},
                "wind_kmh": {"type": "integer"},
            }
        ),
    ),
    (
        "List the countries and capitals mentioned as JSON.\nText: On her tour she visited Lisbon in Portugal, "
        "Vienna in Austria and Oslo in Norway.\nJSON:\n",
        obj({"places": {"type": "array", "items": obj({"country": string(), "capital": string()}), "maxItems": 3}}),
    ),
]


def load_prompts() -> list[tuple[str, str, dict]]:
    prompts = []
    for line in SPECBENCH.read_text().splitlines():
        question = json.loads(line)
        if question["category"] == "extraction":
            text = question["turns"][0] + "\nAnswer as JSON.\nJSON:\n"
            prompts.append((f"specbench-{question['question_id']}", text, SPECBENCH_SCHEMAS[question["question_id"]]))
    prompts += [(f"written-{i}", text, schema) for i, (text, schema) in enumerate(WRITTEN)]
    return prompts


class GrammarClock:
    """Seconds spent in the grammar's tree walks and mask application (patched in)."""

    def __init__(self):
        import quickdraft.engine.engine as engine_module
        from quickdraft.structured import grammar

        self.seconds = 0.0
        grammar.RequestGrammar.walk = self._timed(grammar.RequestGrammar.walk)
        engine_module.apply_masks = self._timed(engine_module.apply_masks)

    def _timed(self, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    args = parser.parse_args()
    from quickdraft import LLM, SamplingParams

    clock = GrammarClock()
    llm = LLM(max_model_len=2048)
    prompts = load_prompts()
    warm = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs={"json": prompts[0][2]})
    llm.generate([prompts[0][1]], warm)  # the grammar's vocabulary index and first-call costs
    rows: dict[str, list[dict]] = {name: [] for name in args.configs}
    for prompt_id, text, schema in prompts:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured_outputs={"json": schema})
        for name in args.configs:
            if name == CEILING:
                answer = rows["plain"][-1]["token_ids"]
                llm.engine.set_drafter(AnswerDrafter(answer), num_speculative_tokens=CHAIN)
            else:
                llm.engine.set_speculative_config(CONFIGS[name])
            llm.engine.reset_prefix_cache()
            before = clock.seconds
            start = time.perf_counter()
            out = llm.generate([text], params)[0]
            seconds = time.perf_counter() - start
            completion = out.outputs[0]
            try:
                parsed = json.loads(completion.text)
                valid = isinstance(parsed, dict) and set(schema["required"]) <= set(parsed)
            except json.JSONDecodeError:
                valid = False
            rows[name].append(
                {
                    "prompt": prompt_id,
                    "tokens": len(completion.token_ids),
                    "seconds": seconds,
                    "decode_seconds": out.metrics.finished_time - out.metrics.first_token_time,
                    "forwards": out.metrics.num_target_forwards,
                    "grammar_seconds": clock.seconds - before,
                    "finish_reason": completion.finish_reason,
                    "valid": valid,
                    "token_ids": completion.token_ids,
                    "text": completion.text,
                }
            )
            print(
                f"{prompt_id:14s} {name:40s} {len(completion.token_ids):4d} tok {seconds:6.2f} s "
                f"{out.metrics.num_target_forwards:4d} fwd valid={valid} {completion.finish_reason}",
                flush=True,
            )
    # After the first token: the prompt's prefill is the same work in every configuration.
    decode_rows = {
        name: [r | {"seconds": r["decode_seconds"], "tokens": r["tokens"] - 1} for r in runs if r["tokens"] > 1]
        for name, runs in rows.items()
    }
    report = (
        "Whole requests (prefill included):\n\n"
        + summarise(rows)
        + "\nDecoding after the first token (answers of more than one token):\n\n"
        + summarise(decode_rows)
    )
    print(report)
    save_results(args.out, rows=rows, report=report)


def summarise(rows: dict[str, list[dict]]) -> str:
    plain = rows.get("plain")
    lines = [
        "| config | tok/s | speedup vs constrained plain (total time) | per-prompt speedup median | tokens/forward | "
        "identical to plain | valid JSON | grammar ms/token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in rows.items():
        tokens, seconds, forwards = totals(runs, "tokens", "seconds", "forwards")
        same = sum(r["token_ids"] == p["token_ids"] for r, p in zip(runs, plain)) if plain else 0
        speedups = [p["seconds"] / r["seconds"] for r, p in zip(runs, plain)] if plain else [0.0]
        plain_seconds = sum(p["seconds"] for p in plain) if plain else seconds
        lines.append(
            f"| {name} | {tokens / seconds:.1f} | {plain_seconds / seconds:.2f}x | "
            f"{statistics.median(speedups):.2f}x | "
            f"{tokens / max(forwards, 1):.2f} | {same}/{len(runs)} | {sum(r['valid'] for r in runs)}/{len(runs)} | "
            f"{1e3 * sum(r['grammar_seconds'] for r in runs) / max(tokens, 1):.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
