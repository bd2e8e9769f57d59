"""vLLM's run-batch: a file of requests in the OpenAI Batch format, run offline through the API.

Each input line is one request: ``{"custom_id": str, "method": "POST", "url": one of BATCH_URLS,
"body": {...}}``.  Each output line, in the input's order, is its result: ``{"id": "batch_req_...",
"custom_id": ..., "response": {"status_code": int, "request_id": str, "body": {...}}, "error":
null}``.  A request the API refuses (a 400 naming a bad field) is a response like any other, with
the API's error body, as the OpenAI Batch API reports them; a line that cannot be sent at all (not
JSON, no custom_id, another method or url, a custom_id already used, a stream) gets ``"response":
null`` and an ``error`` that names the line, and the other lines still run.

The requests go to the server's own ASGI app in this process (httpx's ASGI transport, no socket):
the same validation, defaults, chat templates, tools and speculation as ``quickdraft serve``, with
up to ``max_concurrency`` of them in flight so that the engine batches them.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quickdraft.server.config import ServerConfig
from quickdraft.server.server import QuickdraftServer

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/score", "/v1/rerank")


@dataclass(frozen=True)
class BatchLine:
    number: int  # its line in the input, from 1
    custom_id: str | None
    url: str | None
    body: dict[str, Any] | None
    error: str | None = None  # why it cannot be sent; None: send it


def parse_batch(text: str) -> list[BatchLine]:
    """Every non-blank line of a batch file, checked (a bad line is kept, with its error)."""
    seen: dict[str, int] = {}  # custom_id -> the line that used it first
    return [_parse_line(raw, number, seen) for number, raw in enumerate(text.splitlines(), start=1) if raw.strip()]


def _parse_line(raw: str, number: int, seen: dict[str, int]) -> BatchLine:
    def refused(message: str, custom_id: str | None = None) -> BatchLine:
        return BatchLine(number=number, custom_id=custom_id, url=None, body=None, error=f"line {number}: {message}")

    try:
        item = json.loads(raw)
    except json.JSONDecodeError as err:
        return refused(f"not JSON ({err.msg} at column {err.colno})")
    if not isinstance(item, dict):
        return refused(f"a JSON {type(item).__name__}, not an object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return refused(f"custom_id must be a non-empty string, got {custom_id!r}")
    if custom_id in seen:
        return refused(f"custom_id {custom_id!r} is already used by line {seen[custom_id]}", custom_id)
    seen[custom_id] = number
    method, url, body = item.get("method"), item.get("url"), item.get("body")
    if not isinstance(method, str) or method.upper() != "POST":
        return refused(f"method must be POST, got {method!r}", custom_id)
    if url not in BATCH_URLS:
        return refused(f"url must be one of {', '.join(BATCH_URLS)}, got {url!r}", custom_id)
    if not isinstance(body, dict):
        return refused(f"body must be a JSON object, got {type(body).__name__}", custom_id)
    if body.get("stream"):
        return refused("stream is not supported in a batch (each result is one JSON line)", custom_id)
    return BatchLine(number=number, custom_id=custom_id, url=url, body=body)


async def run_batch(server: QuickdraftServer, lines: list[BatchLine], *, max_concurrency: int) -> list[dict]:
    """Each line's result, in order (the server's engine loop runs for the call)."""
    import httpx

    server.start()
    try:
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://quickdraft-batch", timeout=None) as client:
            gate = asyncio.Semaphore(max_concurrency)
            return list(await asyncio.gather(*(_result(client, gate, line) for line in lines)))
    finally:
        await server.shutdown()


async def _result(client, gate: asyncio.Semaphore, line: BatchLine) -> dict:
    result: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id}
    if line.error is not None:
        return result | {"response": None, "error": {"code": "invalid_batch_line", "message": line.error}}
    assert line.url is not None
    async with gate:
        response = await client.post(line.url, json=line.body)
    try:
        body = response.json()
    except ValueError:
        body = {"error": {"message": response.text, "type": "server_error"}}
    request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else None
    return result | {
        "response": {
            "status_code": response.status_code,
            "request_id": request_id or f"batch-{uuid.uuid4().hex}",
            "body": body,
        },
        "error": None,
    }


def run_batch_file(
    config: ServerConfig, *, input_file: str, output_file: str, max_concurrency: int | None = None
) -> str:
    """Run `input_file` (a path, or "-" for stdin) into `output_file` (written whole once every
    request finished, by a rename: never half a file); returns a one-line summary."""
    text = sys.stdin.read() if input_file == "-" else Path(input_file).read_text(encoding="utf-8")
    lines = parse_batch(text)
    if output_file != "-" and not Path(output_file).resolve().parent.is_dir():
        raise FileNotFoundError(f"the output file's directory does not exist: {output_file}")
    server = QuickdraftServer(config)
    concurrency = max_concurrency or 4 * config.max_num_seqs
    start = time.perf_counter()
    results = asyncio.run(run_batch(server, lines, max_concurrency=concurrency))
    seconds = time.perf_counter() - start
    _write_results(output_file, results)
    return _summary(results, seconds=seconds)


def _write_results(output_file: str, results: list[dict]) -> None:
    text = "".join(json.dumps(result, ensure_ascii=False) + "\n" for result in results)
    if output_file == "-":
        sys.stdout.write(text)
        return
    target = Path(output_file)
    handle, staging = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.resolve().parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(staging, target)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def _summary(results: list[dict], *, seconds: float) -> str:
    sent = [r["response"] for r in results if r["response"] is not None]
    completed = [r for r in sent if 200 <= r["status_code"] < 300]
    usages = [r["body"].get("usage") or {} for r in completed if isinstance(r["body"], dict)]
    # completions and chat count completion_tokens, the Responses API output_tokens
    tokens = sum(usage.get("completion_tokens") or usage.get("output_tokens") or 0 for usage in usages)
    return (
        f"run-batch: {len(results)} lines: {len(completed)} completed, {len(sent) - len(completed)} refused by "
        f"the API, {len(results) - len(sent)} not sent; {tokens} tokens generated in {seconds:.1f} s "
        f"({tokens / max(seconds, 1e-9):.1f} tok/s)"
    )
