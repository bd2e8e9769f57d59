"""Tool calls with speculation on the embedded model: tool_choice "required" and a named function.

Twelve requests written here (weather, search, calendar, e-mail, currency), each rendered in
Gemma's turn format with the tools in a system preamble (quickdraft/structured/tools.py), are
answered greedily at batch 1 under the tool-calling constraint (`--modes auto`: free text whose
<tool_call> blocks the grammar holds to the tools; `auto-free`: no grammar), once per configuration,
interleaved (request by request, every configuration in turn): tokens per second against
constrained plain decoding, tokens per target forward, identical outputs, and whether the
reply reads as calls of the tools.

    .venv/bin/python benchmarks/tool_calls.py --out benchmarks/tool-calls-2026-12-05-zen2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from results_files import save_results
from structured_outputs import GrammarClock, summarise

CONFIGS = {
    "plain": None,
    "grammar": {"method": "grammar"},
    "suffix": {"method": "suffix"},
    "grammar+suffix": {"method": "hybrid", "drafters": [{"method": "grammar"}, {"method": "suffix"}]},
    "suffix+grammar": {"method": "hybrid", "drafters": [{"method": "suffix"}, {"method": "grammar"}]},
}
# Gemma's turns; the base model has no template of its own.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else 'user' }}\n"
    "{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def function(name: str, description: str, properties: dict, required: list[str] | None = None) -> dict:
    parameters = {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def text(max_length: int) -> dict:
    return {"type": "string", "maxLength": max_length}


TOOLS = [
    function(
        "get_weather",
        "Current weather in a city",
        {"city": text(40), "unit": {"enum": ["celsius", "fahrenheit"]}},
    ),
    function("search_web", "Search the web", {"query": text(80), "max_results": {"type": "integer", "maximum": 20}}),
    function(
        "create_event",
        "Add an event to the calendar",
        {
            "title": text(60),
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "minutes": {"type": "integer"},
        },
    ),
    function("send_email", "Send an e-mail", {"to": text(60), "subject": text(80), "body": text(200)}),
    function(
        "convert_currency",
        "Convert an amount between currencies",
        {"amount": {"type": "number"}, "source": text(3), "target": text(3)},
    ),
]
REQUESTS = [
    ("What's the weather like in Lisbon right now? In celsius please.", "get_weather"),
    ("Is it cold in Chicago today? Give me fahrenheit.", "get_weather"),
    ("Find me three articles about the history of the printing press.", "search_web"),
    ("Search for the best hiking trails near Denver, top 5.", "search_web"),
    ("Put a dentist appointment in my calendar on 2026-12-14, it takes 45 minutes.", "create_event"),
    ("Schedule a 30 minute call with the design team on 2027-01-06 titled 'Design review'.", "create_event"),
    ("Email anna@example.com that the report will be late, subject 'Report delay'.", "send_email"),
    ("Send bob@example.org a thank-you note for the dinner last night.", "send_email"),
    ("How much is 250 US dollars in euros?", "convert_currency"),
    ("Convert 1200 Japanese yen to British pounds.", "convert_currency"),
    ("What will the weather be in Tokyo? Use celsius.", "get_weather"),
    ("Look up who won the 1998 football world cup.", "search_web"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    # auto: free text, <tool_call> blocks held to the tools by the grammar; auto-free: no grammar
    parser.add_argument(
        "--modes", nargs="*", default=["required", "named"], choices=["required", "named", "auto", "auto-free"]
    )
    parser.add_argument(
        "--cached-tools",
        action="store_true",
        help="before each timed request, put the prompt's tools preamble in the prefix cache (another "
        "request with the same tools), as a server answering many requests with one set of tools has it",
    )
    args = parser.parse_args()
    from quickdraft import LLM, SamplingParams
    from quickdraft.structured.tools import chat_template_inputs, resolve_tool_calling

    clock = GrammarClock()
    llm = LLM(max_model_len=2048)

    def request(text: str, name: str, mode: str):
        choices = {"required": "required", "auto": "auto", "auto-free": "auto"}
        choice = choices.get(mode, {"type": "function", "function": {"name": name}})
        calling = resolve_tool_calling(
            tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, constrain_auto=mode == "auto"
        )
        messages, variables = chat_template_inputs(
            [{"role": "user", "content": text}], template=GEMMA_TEMPLATE, calling=calling
        )
        prompt = llm.tokenizer.apply_chat_template(messages, chat_template=GEMMA_TEMPLATE, **variables)
        token_ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured_outputs=calling.constraint())
        return calling, {"prompt_token_ids": token_ids}, params

    calling, prompt, params = request(*REQUESTS[0], "required")
    llm.generate([prompt], params)  # the grammar's vocabulary index and first-call costs
    rows: dict[str, list[dict]] = {f"{mode}: {name}": [] for mode in args.modes for name in args.configs}
    for position, (text, name) in enumerate(REQUESTS):
        for mode in args.modes:
            calling, prompt, params = request(text, name, mode)
            for config in args.configs:
                llm.engine.set_speculative_config(CONFIGS[config])
                llm.engine.reset_prefix_cache()
                if args.cached_tools:
                    _, other, _ = request("Hello.", name, mode)
                    llm.generate([other], SamplingParams(max_tokens=1, temperature=0.0))
                before = clock.seconds
                start = time.perf_counter()
                out = llm.generate([prompt], params)[0]
                seconds = time.perf_counter() - start
                completion = out.outputs[0]
                reply = calling.new_stream().whole(completion.text)
                valid = completion.finish_reason == "stop" and (mode.startswith("auto") or bool(reply.calls))
                valid = valid and not (reply.calls and reply.content and mode in ("required", "named"))
                called = [piece.name for piece in reply.calls if piece.name is not None]
                rows[f"{mode}: {config}"].append(
                    {
                        "prompt": f"request-{position}",
                        "tokens": len(completion.token_ids),
                        "seconds": seconds,
                        "decode_seconds": out.metrics.finished_time - out.metrics.first_token_time,
                        "forwards": out.metrics.num_target_forwards,
                        "cached_prompt_tokens": out.metrics.num_cached_tokens,
                        "prompt_tokens": out.metrics.num_prompt_tokens,
                        "grammar_seconds": clock.seconds - before,
                        "finish_reason": completion.finish_reason,
                        "valid": valid,
                        "called": called,
                        "expected": name,
                        "token_ids": completion.token_ids,
                        "text": completion.text,
                    }
                )
                print(
                    f"request-{position:<3d} {mode:9s} {config:15s} {len(completion.token_ids):4d} tok "
                    f"{seconds:6.2f} s {out.metrics.num_target_forwards:4d} fwd valid={valid} {called} "
                    f"prompt {out.metrics.num_cached_tokens}/{out.metrics.num_prompt_tokens} cached",
                    flush=True,
                )
    reports = []
    for mode in args.modes:
        mode_rows = {name.split(": ", 1)[1]: runs for name, runs in rows.items() if name.startswith(f"{mode}: ")}
        right = sum(r["called"] == [r["expected"]] for r in mode_rows["plain"]) if "plain" in mode_rows else 0
        # After the first token (the prompt's prefill, the same work in every configuration).
        decode_rows = {
            name: [r | {"seconds": r["decode_seconds"], "tokens": r["tokens"] - 1} for r in runs]
            for name, runs in mode_rows.items()
        }
        reports.append(
            f"### tool_choice {mode}\n\nplain decoding called the expected tool in {right}/{len(REQUESTS)}\n\n"
            "Whole requests (prefill of the prompt with its tools preamble included):\n\n"
            + summarise(mode_rows).replace("valid JSON", "reads as calls")
            + "\nDecoding after the first token:\n\n"
            + summarise(decode_rows).replace("valid JSON", "reads as calls")
        )
    report = "\n".join(reports)
    print(report)
    save_results(args.out, rows=rows, report=report)


if __name__ == "__main__":
    main()
