"""Hostile or careless clients: huge prompts, oversized or stalled bodies, broken Unicode, no API key."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from quickdraft.server.errors import APIError, error_body
from quickdraft.server.middleware import EndCancelledRequests
from quickdraft.server.preprocess import surrogate_index
from tests.server.conftest import start_server, tiny_server_config

API_KEY = "sk-test-0123456789"
MAX_REQUEST_BYTES = 4096
READ_TIMEOUT_SECONDS = 0.5


@pytest.fixture(scope="module")
def guarded_server(tiny_checkpoints):
    """An API key, a small body limit, a short read timeout, and a model name with a "/"."""
    running = start_server(
        tiny_server_config(
            tiny_checkpoints["qwen3"],
            served_model_name="team/guarded",
            api_key=API_KEY,
            max_request_bytes=MAX_REQUEST_BYTES,
            request_read_timeout_seconds=READ_TIMEOUT_SECONDS,
        )
    )
    yield running
    running.stop()


def keyed_client(server, *, api_key: str = API_KEY):
    from openai import OpenAI

    return OpenAI(base_url=server.api_url, api_key=api_key, max_retries=0, timeout=30.0)


def auth(api_key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


def body_of_size(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes (padded through the `user` field)."""
    body = {"model": "team/guarded", "prompt": "hi", "max_tokens": 1, "user": ""}
    padding = size - len(json.dumps(body).encode())
    assert padding >= 0
    return json.dumps({**body, "user": "u" * padding}).encode()


def assert_error(response, *, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    assert isinstance(error["message"], str) and error["message"]
    return error


# ---- raw HTTP, for what a well-behaved client library cannot do ---------------------------
def connect(server) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body: (status, headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in header_lines)}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return int(status_line.split()[1]), headers, body


def post_raw(sock: socket.socket, path: str, body: bytes, *, extra_headers: str = "") -> None:
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra_headers}\r\n".encode()
        + body
    )


def recv_until_closed(sock: socket.socket, *, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


# ---- 1: preprocessing off the event loop ----------------------------------------------------
def test_a_huge_prompt_does_not_stall_other_requests(plain_server):
    # 2 MiB of text: seconds of tokenization on a slow CPU, under the default 4 MiB body limit.
    # (Turning the ids into a Python list and freeing tokenizers' Encoding still hold the GIL,
    # about 0.1 s at this size: the bound below leaves room for that.)
    prompt = "word " * (2 * 1024 * 1024 // 5)
    outcome = {}

    def send_huge_prompt():
        outcome["response"] = httpx.post(
            f"{plain_server.api_url}/completions",
            timeout=120,
            json={"model": plain_server.model_name, "prompt": prompt, "max_tokens": 2},
        )

    sender = threading.Thread(target=send_huge_prompt)
    latencies = []
    with httpx.Client(timeout=30) as client:
        sender.start()
        while sender.is_alive():
            started = time.monotonic()
            assert client.get(f"{plain_server.base_url}/health").status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.02)
    sender.join()
    # Tokenized in full, then refused for the context: the server really was busy with it.
    error = assert_error(outcome["response"], status=400, code="context_length_exceeded")
    assert error["param"] == "prompt"
    assert len(latencies) >= 5, latencies
    assert max(latencies) < 0.5, latencies


def test_a_50_mb_body_while_streams_run_is_refused_and_stalls_no_one(plain_server):
    """The issue's case: 50 MB bodies (announced, and chunked without a length) against the
    default 4 MiB limit, while two streams decode: each body gets its 413, and neither the
    streams' tokens nor /health wait more than a second at any point."""
    huge = b"x" * (50 * 1024 * 1024)
    url = f"{plain_server.api_url}/completions"
    assert httpx.post(url, json={"prompt": "go", "max_tokens": 2}, timeout=60).status_code == 200  # warm
    stream_body = {
        "model": plain_server.model_name,
        "prompt": "go",
        "max_tokens": 100,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    gaps: list[float] = []
    streamed_tokens: list[int] = []
    refusals: list[int] = []

    def stream_and_time() -> None:
        with httpx.Client(timeout=60) as client, client.stream("POST", url, json=stream_body) as response:
            last = time.monotonic()
            for line in response.iter_lines():
                if line:
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                    if line != "data: [DONE]" and json.loads(line.removeprefix("data: ")).get("usage"):
                        streamed_tokens.append(json.loads(line.removeprefix("data: "))["usage"]["completion_tokens"])

    def send_huge_bodies() -> None:
        def chunked():
            for start in range(0, len(huge), 1 << 20):
                yield huge[start : start + (1 << 20)]

        for content in (huge, chunked()):
            try:
                response = httpx.post(url, content=content, headers={"Content-Type": "application/json"}, timeout=60)
                refusals.append(response.status_code)
                assert_error(response, status=413, code="request_too_large")
            except (httpx.WriteError, httpx.RemoteProtocolError):
                refusals.append(413)  # answered and closed before the client finished writing

    streams = [threading.Thread(target=stream_and_time) for _ in range(2)]
    for thread in streams:
        thread.start()
    sender = threading.Thread(target=send_huge_bodies)
    sender.start()
    health = []
    with httpx.Client(timeout=30) as client:
        while sender.is_alive() or any(thread.is_alive() for thread in streams):
            started = time.monotonic()
            assert client.get(f"{plain_server.base_url}/health").status_code == 200
            health.append(time.monotonic() - started)
            time.sleep(0.02)
    for thread in (*streams, sender):
        thread.join()
    assert refusals == [413, 413]
    assert streamed_tokens == [100, 100]  # both streams ran to the end
    assert max(gaps) < 1.0 and max(health) < 1.0, (max(gaps), max(health))


def test_tokenizer_encodes_like_the_backend_without_holding_the_gil(plain_server, ngram_server):
    """Tokenizer.encode goes through encode_batch (which releases the GIL): the same ids as encode."""
    texts = ["The capital of France is", "", "<bos>special<eos> text", "émoji 🙂 and ß", "a\nb\n\nc " * 50]
    for server in (plain_server, ngram_server):
        tokenizer = server.server.tokenizer
        for text in texts:
            for add_special_tokens in (True, False):
                assert (
                    tokenizer.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
                    == tokenizer.backend.encode(text, add_special_tokens=add_special_tokens).ids
                ), text


# ---- 2: request size limit -----------------------------------------------------------------
def test_body_at_the_limit_is_served_one_byte_more_is_413(guarded_server):
    url = f"{guarded_server.api_url}/completions"
    headers = {**auth(), "Content-Type": "application/json"}
    at_limit = httpx.post(url, content=body_of_size(MAX_REQUEST_BYTES), headers=headers, timeout=30)
    assert at_limit.status_code == 200, at_limit.text
    too_large = httpx.post(url, content=body_of_size(MAX_REQUEST_BYTES + 1), headers=headers, timeout=30)
    error = assert_error(too_large, status=413, code="request_too_large")
    assert str(MAX_REQUEST_BYTES) in error["message"] and "--max-request-bytes" in error["message"]
    assert error["type"] == "invalid_request_error"


def test_body_without_content_length_is_cut_while_reading(guarded_server):
    def chunks():  # a generator body: httpx sends it chunked, with no Content-Length
        for _ in range(8):
            yield b" " * 1024

    response = httpx.post(
        f"{guarded_server.api_url}/completions",
        content=chunks(),
        headers={**auth(), "Content-Type": "application/json"},
        timeout=30,
    )
    assert "content-length" not in response.request.headers
    assert_error(response, status=413, code="request_too_large")


def test_declared_length_past_the_limit_is_refused_before_the_body(guarded_server):
    with connect(guarded_server) as sock:
        # Only the headers: a 10 MB body is announced but never sent, and still the answer comes.
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Length: 10000000\r\n\r\n".encode()
        )
        status, _headers, body = read_response(sock)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert "10000000 bytes" in json.loads(body)["error"]["message"]


# ---- 3: unpaired surrogates --------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "raw_body", "param", "index"),
    [
        ("/completions", rb'{"prompt": "\ud800", "max_tokens": 2}', "prompt", 0),
        ("/completions", rb'{"prompt": ["ab\udfff"], "max_tokens": 2}', "prompt.0", 2),
        ("/completions", rb'{"prompt": "ok", "stop": ["fine", "x\ud83d"], "max_tokens": 2}', "stop.1", 1),
        ("/completions", rb'{"prompt": "ok", "stop": "\udc00", "max_tokens": 2}', "stop", 0),
        (
            "/chat/completions",
            rb'{"messages": [{"role": "user", "content": "hi \ud800"}], "max_tokens": 2}',
            "messages.0.content",
            3,
        ),
        (
            "/chat/completions",
            rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}], "max_tokens": 2}',
            "messages.0.content.0.text",
            0,
        ),
    ],
)
def test_unpaired_surrogates_are_a_400_naming_the_field(ngram_server, path, raw_body, param, index):
    with connect(ngram_server) as sock:
        post_raw(sock, f"/v1{path}", raw_body)
        status, _, body = read_response(sock)
        error = json.loads(body)["error"]
        assert status == 400, error
        assert error["param"] == param and error["code"] == "invalid_unicode"
        assert f"{param} contains an unpaired UTF-16 surrogate" in error["message"]
        assert f"at index {index}" in error["message"]
        # The connection is kept: the next request on it is served.
        post_raw(sock, "/v1/completions", b'{"prompt": "fine", "max_tokens": 2}')
        status, _, body = read_response(sock)
        assert status == 200, body


def test_a_paired_surrogate_escape_is_ordinary_text(ngram_server):
    raw = rb'{"prompt": "smile \ud83d\ude00", "max_tokens": 2}'  # one character, U+1F600
    response = httpx.post(
        f"{ngram_server.api_url}/completions", content=raw, headers={"Content-Type": "application/json"}, timeout=30
    )
    assert response.status_code == 200, response.text


def test_surrogate_in_a_key_or_an_echoed_name_never_breaks_the_response(ngram_server):
    with connect(ngram_server) as sock:
        post_raw(sock, "/v1/completions", rb'{"prompt": "x", "metadata": {"\udc80": "v"}}')
        status, _, body = read_response(sock)
        assert status == 400 and json.loads(body)["error"]["param"] == "metadata"
        post_raw(sock, "/v1/completions", rb'{"prompt": "x", "\ud800": 1}')  # a field name pydantic cannot read
        status, _, body = read_response(sock)
        assert status == 400 and json.loads(body)["error"]["code"] == "invalid_unicode"


def test_surrogate_index():
    assert surrogate_index("plain") is None and surrogate_index("ümlaut 🙂") is None
    assert surrogate_index("ab\ud800cd") == 2 and surrogate_index("\udfff") == 0


# ---- 6, 7: /v1/models/{id}, HEAD /health -----------------------------------------------------
def test_retrieve_model_with_the_openai_client(guarded_server):
    client = keyed_client(guarded_server)
    model = client.models.retrieve("team/guarded")  # a "/" in the name, as in org/model names
    assert model.id == "team/guarded" and model.object == "model" and model.owned_by == "quickdraft"
    assert model.model_extra["max_model_len"] == 128
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-17")
    assert caught.value.body["code"] == "model_not_found" and "gpt-17" in caught.value.body["message"]


def test_head_health_answers_200_without_a_body(plain_server):
    response = httpx.head(f"{plain_server.base_url}/health", timeout=10)
    assert response.status_code == 200 and response.content == b""
    assert response.headers["content-type"] == "application/json"


# ---- 8: read timeout ------------------------------------------------------------------------
def test_a_client_stalling_mid_body_is_dropped(guarded_server):
    with connect(guarded_server) as sock:
        started = time.monotonic()
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Length: 100\r\n\r\n".encode()
            + b'{"prompt": "'
        )
        answer = recv_until_closed(sock, timeout=10)  # returns once the server closed the connection
        elapsed = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    assert READ_TIMEOUT_SECONDS * 0.8 < elapsed < READ_TIMEOUT_SECONDS + 5


@pytest.mark.parametrize("sent", [b"", b"POS", b"POST /v1/completions HTTP/1.1\r\nHost: te"])
def test_a_client_stalling_before_its_headers_end_is_dropped(guarded_server, sent):
    with connect(guarded_server) as sock:
        started = time.monotonic()
        sock.sendall(sent)
        answer = recv_until_closed(sock, timeout=10)  # returns once the server closed the connection
        elapsed = time.monotonic() - started
    assert answer == b""
    assert READ_TIMEOUT_SECONDS * 0.8 < elapsed < READ_TIMEOUT_SECONDS + 5


def test_header_deadline_rearms_after_each_response_on_a_kept_alive_connection(guarded_server):
    with connect(guarded_server) as sock:
        for _ in range(3):  # each request well inside its own deadline, together past one
            time.sleep(READ_TIMEOUT_SECONDS * 0.5)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
            status, _, _ = read_response(sock)
            assert status == 200
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")  # then half a request, and silence
        started = time.monotonic()
        assert recv_until_closed(sock, timeout=10) == b""
        assert time.monotonic() - started < READ_TIMEOUT_SECONDS + 5


def test_a_slow_but_steady_client_is_not_dropped(guarded_server):
    body = body_of_size(400)
    with connect(guarded_server) as sock:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        )
        for start in range(0, len(body), 100):  # each pause shorter than the timeout, the total longer
            time.sleep(READ_TIMEOUT_SECONDS * 0.5)
            sock.sendall(body[start : start + 100])
        status, _, answer = read_response(sock)
    assert status == 200, answer


# ---- 10: API key -------------------------------------------------------------------------
def test_api_key_is_required_on_v1_routes(guarded_server):
    completion = keyed_client(guarded_server).completions.create(model="team/guarded", prompt="hi", max_tokens=2)
    assert completion.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError) as caught:
        keyed_client(guarded_server, api_key="sk-wrong").completions.create(
            model="team/guarded", prompt="hi", max_tokens=2
        )
    assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        keyed_client(guarded_server, api_key="sk-wrong").models.list()
    missing = httpx.get(f"{guarded_server.api_url}/models", timeout=10)
    error = assert_error(missing, status=401, code="invalid_api_key")
    assert error["type"] == "invalid_request_error" and "Authorization: Bearer" in error["message"]
    assert missing.headers["www-authenticate"] == "Bearer"
    lower_case_scheme = httpx.get(
        f"{guarded_server.api_url}/models", timeout=10, headers={"Authorization": f"bearer {API_KEY}"}
    )
    assert lower_case_scheme.status_code == 200
    # Probes and scrapers need no key.
    assert httpx.get(f"{guarded_server.base_url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{guarded_server.base_url}/metrics", timeout=10).status_code == 200
    assert httpx.get(f"{guarded_server.base_url}/ping", timeout=10).status_code == 200
    tokens = httpx.post(f"{guarded_server.base_url}/tokenize", json={"prompt": "hi"}, timeout=10)
    assert tokens.status_code == 200  # open, as in vLLM
    # The routes outside /v1 that run the model need it as much as those under /v1.
    body = {"model": "team/guarded", "prompt": "hi", "max_tokens": 2}
    for path, fields in (
        ("/invocations", body),
        ("/score", {"text_1": "a", "text_2": "b"}),
        ("/classify", {}),
        ("/pooling", {"input": "a"}),
    ):
        refused = httpx.post(f"{guarded_server.base_url}{path}", json=fields, timeout=10)
        assert_error(refused, status=401, code="invalid_api_key")
    invoked = httpx.post(f"{guarded_server.base_url}/invocations", json=body, headers=auth(), timeout=30)
    assert invoked.status_code == 200 and invoked.json()["usage"]["completion_tokens"] == 2


def test_a_browser_s_preflight_is_answered_without_the_key(guarded_server):
    headers = {
        "Origin": "https://ui.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    preflight = httpx.options(f"{guarded_server.api_url}/chat/completions", headers=headers, timeout=10)
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    # The request itself still needs the key, and its answer carries the CORS header.
    refused = httpx.get(f"{guarded_server.api_url}/models", headers={"Origin": "https://ui.example"}, timeout=10)
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    served = httpx.get(
        f"{guarded_server.api_url}/models", headers={"Origin": "https://ui.example"} | auth(), timeout=10
    )
    assert served.status_code == 200 and served.headers["access-control-allow-origin"] == "*"


def test_cors_settings_are_checked(tiny_checkpoints):
    with pytest.raises(ValueError, match="needs the allowed origins named"):
        tiny_server_config(tiny_checkpoints["qwen3"], allow_credentials=True)
    with pytest.raises(ValueError, match="allowed_origins must be a list"):
        tiny_server_config(tiny_checkpoints["qwen3"], allowed_origins="*")


def test_api_key_is_checked_before_the_body(guarded_server):
    url = f"{guarded_server.api_url}/completions"
    malformed = httpx.post(url, content=b"{nope", headers={"Content-Type": "application/json"}, timeout=10)
    assert_error(malformed, status=401, code="invalid_api_key")
    too_large = httpx.post(
        url,
        content=body_of_size(MAX_REQUEST_BYTES + 1),
        timeout=10,
        headers={"Authorization": "Bearer sk-wrong", "Content-Type": "application/json"},
    )
    assert_error(too_large, status=401, code="invalid_api_key")
    assert_error(httpx.get(f"{guarded_server.api_url}/nothing", timeout=10), status=401, code="invalid_api_key")


# ---- 9: every error has a code -------------------------------------------------------------
def test_every_error_has_a_string_code(plain_server, guarded_server):
    api = plain_server.api_url
    json_headers = {"Content-Type": "application/json"}
    responses = {
        "malformed JSON": httpx.post(f"{api}/completions", content=b'{"prompt": ', headers=json_headers),
        "empty body": httpx.post(f"{api}/completions", content=b"", headers=json_headers),
        "not an object": httpx.post(f"{api}/completions", json=[1]),
        "form body": httpx.post(
            f"{api}/completions", content=b"prompt=x", headers={"Content-Type": "application/x-www-form-urlencoded"}
        ),
        "missing field": httpx.post(f"{api}/completions", json={"max_tokens": 2}),
        "wrong type": httpx.post(f"{api}/completions", json={"prompt": "x", "max_tokens": "2"}),
        "bad value": httpx.post(f"{api}/completions", json={"prompt": "x", "top_p": 0}),
        "unknown route": httpx.get(f"{api}/nothing"),
        "unknown model": httpx.post(f"{api}/completions", json={"model": "nope", "prompt": "x"}),
        "unknown model card": httpx.get(f"{api}/models/nope"),
        "wrong method": httpx.delete(f"{api}/completions"),
        "too large": httpx.post(
            f"{guarded_server.api_url}/completions",
            headers={**auth(), **json_headers},
            content=body_of_size(MAX_REQUEST_BYTES + 1),
        ),
        "no key": httpx.get(f"{guarded_server.api_url}/models"),
    }
    statuses = set()
    for name, response in responses.items():
        assert 400 <= response.status_code < 500, (name, response.text)
        error = response.json()["error"]
        assert isinstance(error["code"], str) and error["code"], (name, error)
        assert set(error) == {"message", "type", "param", "code"}, (name, error)
        statuses.add(response.status_code)
    assert statuses == {400, 401, 404, 405, 413}
    assert responses["wrong method"].json()["error"]["code"] == "method_not_allowed"
    assert "POST" in responses["wrong method"].headers["allow"]


# ---- requests uvicorn cancels at shutdown (past the drain) -----------------------------------
def run_cancelled(app, *, shutting_down: bool) -> list[dict]:
    """Run app under EndCancelledRequests, cancel it as uvicorn does past its wait; what was sent."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    async def scenario():
        guard = EndCancelledRequests(
            app,
            is_shutting_down=lambda: shutting_down,
            error=lambda: APIError(status=503, message="gone", code="server_shutdown"),
        )
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
        task = asyncio.ensure_future(guard(scope, receive, send))
        await asyncio.sleep(0.05)
        task.cancel()
        await task

    asyncio.run(scenario())
    return sent


async def tokenizing_app(scope, receive, send):
    await asyncio.sleep(60)  # still preparing its request: nothing sent yet


async def streaming_app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
    await asyncio.sleep(60)


def test_cancelled_before_answering_gets_a_503():
    sent = run_cancelled(tokenizing_app, shutting_down=True)
    assert sent[0]["status"] == 503
    assert json.loads(sent[1]["body"])["error"]["code"] == "server_shutdown"


def test_cancelled_stream_gets_its_error_event_and_done():
    sent = run_cancelled(streaming_app, shutting_down=True)
    last = sent[-1]
    assert last["more_body"] is False
    event, done = [line for line in last["body"].decode().split("\n") if line]
    assert json.loads(event.removeprefix("data: "))["error"]["code"] == "server_shutdown" and done == "data: [DONE]"


def test_cancellation_outside_shutdown_is_not_swallowed():
    with pytest.raises(asyncio.CancelledError):
        run_cancelled(tokenizing_app, shutting_down=False)


def test_error_bodies_stay_encodable():
    body = error_body(status=400, message="bad \ud800 text", param="x\udc00")
    assert json.dumps(body, ensure_ascii=False).encode("utf-8")
    assert "\\ud800" in body["error"]["message"] and body["error"]["code"] == "invalid_request"
