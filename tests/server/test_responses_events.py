"""The Responses API's streamed events from a writer fed by hand: items open and close in order,
an empty reply still ends with its (empty) message, a failure ends with an error event."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from quickdraft.server.api import ResponsesWriter
from quickdraft.server.engine_loop import Progress
from quickdraft.server.errors import APIError
from quickdraft.server.responses import ResponsesRequest


class FakeGeneration:
    response_id, created, num_choices, num_prompt_tokens, output, model_name = "resp-1", 0, 1, 3, None, "m"

    def __init__(self, texts: list[str], *, fail: bool = False):
        self.texts, self.fail = texts, fail

    async def progress(self):
        for position, text in enumerate(self.texts):
            last = position == len(self.texts) - 1
            yield Progress(text=text, token_ids=[1], logprobs=None, finished=last, finish_reason="stop", output=None)
        if self.fail:
            raise APIError(status=400, message="it broke", code="logits_processor_error", param="x")


def events(texts: list[str], *, fail: bool = False) -> list[dict]:
    server = SimpleNamespace(model_name="m", responses=None)
    writer = ResponsesWriter(
        server=server,
        generation=FakeGeneration(texts, fail=fail),
        request=ResponsesRequest(input="hi", store=False),
        conversation=[],
        include_usage=False,
    )

    async def collect():
        return [chunk async for chunk in writer.events()]

    chunks = asyncio.run(collect())
    return [json.loads(chunk.split("data: ", 1)[1]) for chunk in chunks]


def test_text_opens_one_message_and_closes_it():
    kinds = [e["type"] for e in events(["Hel", "lo"])]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]


def test_an_empty_reply_still_ends_with_an_empty_message():
    stream = events([""])
    final = stream[-1]["response"]
    assert final["output"][0]["type"] == "message" and final["output"][0]["content"][0]["text"] == ""
    done = [e["item"] for e in stream if e["type"] == "response.output_item.done"]
    assert [item["id"] for item in done] == [item["id"] for item in final["output"]]


def test_a_failure_ends_with_an_error_event():
    stream = events(["a"], fail=True)
    assert stream[-1]["type"] == "error" and stream[-1]["message"] == "it broke"
    assert [e["sequence_number"] for e in stream] == list(range(1, len(stream) + 1))
