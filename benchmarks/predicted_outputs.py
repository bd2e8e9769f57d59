"""Predicted outputs on code: the request's `prediction` is the reply expected.

The functions are read at run time from Python's own standard library (nothing copied here).
Three kinds of task: "edit" shows a function and asks for it again renamed, predicted by the
source with the rename applied (what an editor sends: the file as it will mostly be); "write"
shows only the function's first line, predicted by the library's body (text the prompt does not
hold); "rewrite" asks for "write" again with the function renamed, predicted by the model's own
answer to the first (a client regenerating after a small change). Greedy, batch 1, the embedded
model, configurations interleaved per prompt in one process: plain decoding, the prediction
alone, suffix decoding (which copies from the prompt too), and suffix with the prediction (the
prediction drafts for its request where the output follows it). Every output is compared with
plain decoding's.
"""

from __future__ import annotations

import argparse
import colorsys
import inspect
import shlex
import statistics
import string
import textwrap
import time
from pathlib import Path

from results_files import save_results

FUNCTIONS = [
    (colorsys.rgb_to_hls, "rgb_to_hue_lightness_saturation"),
    (colorsys.hls_to_rgb, "hue_lightness_saturation_to_rgb"),
    (statistics.median, "middle_value"),
    (shlex.quote, "shell_quote"),
    (textwrap.dedent, "remove_common_indent"),
    (string.capwords, "capitalize_words"),
]
CONFIGS = {
    "plain": (None, False),
    "prediction": (None, True),
    "suffix": ({"method": "suffix"}, False),
    "suffix + prediction": ({"method": "suffix"}, True),
}


def tasks() -> list[tuple[str, str, str]]:
    """(name, prompt, prediction) per function and kind: "edit" shows the function and asks for
    it renamed (the prediction, the renamed source, is in the prompt nearly whole: suffix
    decoding finds it there too); "write" shows only its first line and asks for the rest (the
    prediction, the library's own body, is nowhere in the prompt: a client's earlier answer)."""
    out = []
    for function, new_name in FUNCTIONS:
        source = inspect.getsource(function)
        renamed = source.replace(f"def {function.__name__}(", f"def {new_name}(", 1)
        prompt = (
            f"Here is a Python function:\n```python\n{source}```\n"
            f"The same function, renamed to `{new_name}`, with nothing else changed:\n```python\n"
        )
        out.append((f"edit {function.__name__}", prompt, renamed))
        first_line, body = source.split("\n", 1)
        out.append((f"write {function.__name__}", f"```python\n{first_line}\n", body))
        renamed_line = first_line.replace(f"def {function.__name__}(", f"def {new_name}(", 1)
        # "rewrite": the same request with the function renamed, predicted by the model's own
        # answer to the first one (a client regenerating after a small change): filled in main()
        out.append((f"rewrite {function.__name__}", f"```python\n{renamed_line}\n", f"```python\n{first_line}\n"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from quickdraft import LLM, SamplingParams

    llm = LLM(max_model_len=4096)
    llm.generate(["Warm up"], SamplingParams(max_tokens=4, temperature=0.0))
    rows: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for name, prompt, prediction in tasks():
        if name.startswith("rewrite"):  # the prediction: the model's answer to the original prompt
            earlier = SamplingParams(temperature=0.0, max_tokens=512, stop=["```"])
            llm.engine.set_speculative_config(None)
            prediction = llm.generate([prediction], earlier)[0].outputs[0].text
        limit = len(llm.tokenizer.encode(prediction, add_special_tokens=False)) + 16
        for config, (speculative, predicted) in CONFIGS.items():
            llm.engine.set_speculative_config(speculative)
            llm.engine.reset_prefix_cache()
            params = SamplingParams(
                temperature=0.0, max_tokens=limit, stop=["```"], prediction=prediction if predicted else None
            )
            start = time.perf_counter()
            out = llm.generate([prompt], params)[0]
            seconds = time.perf_counter() - start
            completion, metrics = out.outputs[0], out.metrics
            rows[config].append(
                {
                    "task": name,
                    "tokens": len(completion.token_ids),
                    "seconds": seconds,
                    "decode_seconds": metrics.finished_time - metrics.first_token_time,
                    "forwards": metrics.num_target_forwards,
                    "accepted": metrics.num_accepted_tokens,
                    "drafted": metrics.num_draft_tokens,
                    "as_predicted": completion.text.strip() == prediction.strip(),
                    "token_ids": completion.token_ids,
                }
            )
            print(
                f"{name:20s} {config:20s} {len(completion.token_ids):4d} tok {seconds:6.2f} s "
                f"{metrics.num_target_forwards:4d} fwd as predicted={rows[config][-1]['as_predicted']}",
                flush=True,
            )
    report = "\n".join(
        f"### {kind}\n\n"
        + summary({config: [r for r in runs if r["task"].startswith(kind)] for config, runs in rows.items()})
        for kind in ("edit", "write", "rewrite")
    )
    print(report)
    save_results(args.out, rows=rows, report=report)


def summary(rows: dict[str, list[dict]]) -> str:
    plain = rows["plain"]
    lines = [
        "| config | tok/s | vs plain (whole requests) | vs plain (after the first token) | per-task median | "
        "tokens/forward | identical to plain | output = prediction |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for config, runs in rows.items():
        tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
        decode = sum(r["decode_seconds"] for r in runs)
        per_task = statistics.median(p["seconds"] / r["seconds"] for p, r in zip(plain, runs))
        lines.append(
            f"| {config} | {tokens / seconds:.1f} | {sum(p['seconds'] for p in plain) / seconds:.2f}x | "
            f"{sum(p['decode_seconds'] for p in plain) / decode:.2f}x | {per_task:.2f}x | "
            f"{tokens / max(1, sum(r['forwards'] for r in runs)):.2f} | "
            f"{sum(r['token_ids'] == p['token_ids'] for r, p in zip(runs, plain))}/{len(runs)} | "
            f"{sum(r['as_predicted'] for r in runs)}/{len(runs)} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
