"""The FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, and
vLLM's /tokenize and /detokenize.

A handler reads the body (413 past --max-request-bytes, 408 when the client stalls), then
parses, validates, renders and tokenizes the prompt on a preprocessing thread (never on the
event loop: a huge prompt must not stall other connections), takes a place in the admission
count (429 when full), submits the request to the engine loop and waits for it to be admitted
(so an engine-side rejection is still a proper 400), then either collects the whole output or
streams Server-Sent Events. A client that goes away aborts its request at once: non-streaming
handlers watch for the disconnect while they wait, and the SSE response aborts when its
connection closes, however it closes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

import quickdraft
from quickdraft.config import check_ranks_by_logprobs
from quickdraft.engine.beam_search import BeamSearch
from quickdraft.engine.parallel_sampling import merged_batch_output
from quickdraft.kv.cache import CacheFullError
from quickdraft.models.chat import ChatRenderError, render_chat
from quickdraft.models.lora import LoRAError, LoRARequest
from quickdraft.models.weight_updates import read_checkpoint_tensors
from quickdraft.outputs import CompletionOutput, RequestMetrics, RequestOutput
from quickdraft.pooling import PoolingParams, cosine_similarity, score_pairs
from quickdraft.server.engine_loop import Admitted, Failed, LoopStopped, Progress, Rejected, RequestOptions, Submission
from quickdraft.server.errors import DEFAULT_CODES, APIError, bad_request, shutting_down
from quickdraft.server.logits_processors import resolve_logits_processors
from quickdraft.server.middleware import ApiKeyCheck, EndCancelledRequests
from quickdraft.server.preprocess import Model, parse_json, parse_request
from quickdraft.server.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionLogprobs,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    PoolingRequest,
    RerankRequest,
    SamplingFields,
    ScoreRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    chat_logprobs_body,
    now_seconds,
    prompt_logprobs_body,
    speculation_body,
    usage_body,
    usage_of,
)
from quickdraft.server.responses import (
    ResponsesRequest,
    function_call_item,
    message_item,
    output_items,
    output_text_part,
    reasoning_item,
    renamed_error,
    response_body,
)
from quickdraft.server.routing import INVOCATION_FIELDS, invoked_route
from quickdraft.server.validation import validation_error_to_api_error
from quickdraft.structured.reasoning import REASONING_PARSERS, ReasoningParser
from quickdraft.structured.tools import (
    TOOL_CALL_PARSERS,
    PlainTextStream,
    ReplyDelta,
    ToolCalling,
    ToolCallStream,
    merged_calls,
)

if TYPE_CHECKING:
    import torch

    from quickdraft.sampling_params import SamplingParams
    from quickdraft.server.server import QuickdraftServer

SCENARIO_HEADER = "x-scenario"
# HTTP status logged for a request whose client left before the answer (nginx's convention).
CLIENT_CLOSED_REQUEST = 499


def create_app(server: QuickdraftServer) -> FastAPI:
    app = FastAPI(
        title="quickdraft", summary="OpenAI-compatible API with lossless speculative decoding", lifespan=server.lifespan
    )
    _install_error_handlers(app, server)
    _add_info_routes(app, server)
    _add_generation_routes(app, server)
    _add_invocations_route(app, server)
    if server.config.allow_runtime_lora_updating:
        _add_lora_routes(app, server)
    if server.config.enable_dev_endpoints:
        _add_dev_routes(app, server)
    # The last added runs first: the key is checked before anything else happens.
    app.add_middleware(EndCancelledRequests, is_shutting_down=lambda: server.shutting_down, error=server.shutdown_error)
    if server.config.api_key is not None:
        app.add_middleware(
            ApiKeyCheck,
            api_key=server.config.api_key,
            on_reject=lambda scope, err: _record_rejection(server, Request(scope), err),
        )
    # Outermost: a browser's preflight (OPTIONS, without the key) is answered before the key check.
    config = server.config
    app.add_middleware(
        CORSMiddleware,
        allow_origins=config.allowed_origins,
        allow_methods=config.allowed_methods,
        allow_headers=config.allowed_headers,
        allow_credentials=config.allow_credentials,
    )
    return app


# ---- errors ---------------------------------------------------------------------------------
def _record_rejection(server: QuickdraftServer, request: Request, err: APIError) -> None:
    server.metrics.record_rejection(scenario=_scenario_of(request, server), status=err.status)


def _install_error_handlers(app: FastAPI, server: QuickdraftServer) -> None:
    def respond(request: Request, err: APIError) -> JSONResponse:
        _record_rejection(server, request, err)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return respond(request, err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError):
        # FastAPI answers 422 in its own shape; OpenAI clients expect a 400 in theirs.
        return respond(request, validation_error_to_api_error(err.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        # The router's own errors (unknown route, wrong method): keep their headers (Allow).
        message = f"{err.detail}: {request.method} {request.url.path}"
        return respond(
            request,
            APIError(
                status=err.status_code, message=message, code=DEFAULT_CODES.get(err.status_code), headers=err.headers
            ),
        )

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, err: Exception):
        return respond(
            request, APIError(status=500, message=f"internal error: {type(err).__name__}: {err}", code="internal_error")
        )


def _scenario_of(request: Request, server: QuickdraftServer) -> str:
    scenario = getattr(request.state, "scenario", None)
    return scenario if scenario is not None else server.scenarios.resolve(request.headers.get(SCENARIO_HEADER))


# ---- /v1/models, /health, /metrics -----------------------------------------------------------
def _add_info_routes(app: FastAPI, server: QuickdraftServer) -> None:
    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": server.created,
            "owned_by": "quickdraft",
            "max_model_len": server.max_model_len,
            "speculative_method": server.method,
        }

    def adapter_card(adapter: LoRARequest) -> dict[str, Any]:
        parent = adapter.base_model_name or server.model_name
        return {**model_card(adapter.lora_name), "root": adapter.lora_path, "parent": parent}

    @app.get("/v1/models")
    async def list_models():
        cards = [model_card(name) for name in server.model_names]
        return {"object": "list", "data": cards + [adapter_card(a) for a in server.lora_modules.values()]}

    @app.get("/v1/models/{model_id:path}")  # :path, since model names may hold a "/"
    async def retrieve_model(model_id: str):
        adapter = _check_model(server, model_id)
        return model_card(model_id) if adapter is None else adapter_card(adapter)

    @app.get("/version")  # vLLM's
    async def version():
        return {"version": quickdraft.__version__}

    # HEAD too: load balancers and uptime checkers probe with it (uvicorn sends no body).
    @app.api_route("/health", methods=["GET", "HEAD"])
    @app.api_route("/ping", methods=["GET", "HEAD", "POST"])  # SageMaker's health check (vLLM serves it)
    async def health():
        stats = server.engine_loop.stats
        if not server.admission.accepting:
            status = "shutting_down"
        elif not server.engine_loop.is_alive:
            status = "engine_stopped"
        else:
            status = "ok"
        body = {
            "status": status,
            "model": server.model_name,
            "method": server.method,
            "in_flight": server.admission.in_flight,
            "max_queue": server.admission.max_in_flight,
            "engine": asdict(stats),
        }
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


# ---- LoRA adapters added and dropped while serving (vLLM's routes) ------------------------------
def _add_lora_routes(app: FastAPI, server: QuickdraftServer) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await _read_request(server, request, model=LoadLoRAAdapterRequest)
        if body is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        name = body.lora_name
        if name in server.lora_modules or name in server.model_names:
            raise bad_request(f"lora_name: the adapter {name!r} has already been loaded", param="lora_name")
        try:
            adapter = LoRARequest(name, server.next_lora_id(), body.lora_path)
            # loaded (and checked against the model) on the loop thread, between steps
            await asyncio.wrap_future(server.engine_loop.call(lambda engine: engine.add_lora(adapter)))
        except LoRAError as err:
            raise bad_request(str(err), param="lora_path") from err
        server.lora_modules[name] = adapter
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await _read_request(server, request, model=UnloadLoRAAdapterRequest)
        if body is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        adapter = server.lora_modules.get(body.lora_name)
        if adapter is None or body.lora_int_id not in (None, adapter.lora_int_id):
            raise APIError(
                status=404,
                param="lora_name",
                code="lora_not_found",
                message=f"lora_name: the adapter {body.lora_name!r} (id {body.lora_int_id}) cannot be found",
            )
        del server.lora_modules[body.lora_name]  # new requests no longer find it; running ones keep it
        await asyncio.wrap_future(server.engine_loop.call(lambda engine: engine.remove_lora(adapter.lora_int_id)))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _add_dev_routes(app: FastAPI, server: QuickdraftServer) -> None:
    @app.post("/reset_prefix_cache")  # vLLM's (dev mode)
    async def reset_prefix_cache():
        await asyncio.wrap_future(server.engine_loop.call(lambda engine: engine.reset_prefix_cache(), when_idle=True))
        return Response(status_code=200)

    @app.post("/update_weights_from_disk")  # SGLang's
    async def update_weights_from_disk(request: Request):
        body = await _read_request(server, request, model=UpdateWeightsFromDiskRequest)
        if body is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if body.load_format not in (None, "auto", "safetensors"):
            raise bad_request(
                f"load_format: only safetensors checkpoints are read, got {body.load_format!r}", param="load_format"
            )
        try:  # read off the event loop; applied on the loop thread once the requests in flight are done
            tensors = await server.preprocessor.run(read_checkpoint_tensors, Path(body.model_path))
            changed = await asyncio.wrap_future(
                server.engine_loop.call(lambda engine: engine.load_weights(tensors.items()), when_idle=True)
            )
        except ValueError as err:
            raise bad_request(str(err), param="model_path") from err
        message = f"updated {len(changed)} model tensors from {body.model_path}; the prefix cache was reset"
        return JSONResponse({"success": True, "message": message, "num_updated_tensors": len(changed)})


# ---- generation -----------------------------------------------------------------------------
class Generation:
    """One request's way through the engine loop, seen from its handler.

    `close()` is idempotent and synchronous (it may run inside a cancelled task): it aborts
    the request when it has not finished and gives back its admission place.
    """

    def __init__(
        self,
        *,
        server: QuickdraftServer,
        prompts: list[list[int]],
        params: SamplingParams,
        scenario: str,
        prompt_param: str,
        id_prefix: str,
        options: RequestOptions | None = None,  # priority, cache salt, adapter (None: the defaults)
        client_request_id: str | None = None,
    ):
        self.server = server
        self.request_id = f"{id_prefix}-{uuid.uuid4().hex}"  # the engine's: unique whatever clients send
        # the response's `id`: the client's request_id where it sent one (vLLM's)
        self.response_id = self.request_id if client_request_id is None else f"{id_prefix}-{client_request_id}"
        self._options = options or RequestOptions()
        self.created = now_seconds()
        self._prompts = prompts
        self._params = params
        self._scenario = scenario
        self._prompt_param = prompt_param  # "prompt" or "messages": the field a rejection names
        self._events: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._admitted_place = False
        self._submitted = False
        self._done = False
        self._closed = False
        self.n = params.n  # completions asked for per prompt
        self.num_choices = len(prompts) * params.n  # choice k: completion k % n of prompt k // n
        # engine requests, child k sample k % num_samples of prompt k // num_samples (the choices
        # themselves unless best_of > n: then the n best of each prompt's become its choices)
        self.num_samples = params.num_samples
        self.num_children = len(prompts) * params.num_samples
        self._keep_logprobs = params.logprobs is not None
        self.num_prompt_tokens = sum(len(prompt) for prompt in prompts)
        self.output: RequestOutput | None = None  # all of them, once the last has finished
        # choice -> its prompt's logprobs, where asked for (by child index until the output is known)
        self.prompt_logprobs: dict[int, list] = {}

    @property
    def model_name(self) -> str:
        """What the response's "model" says: the adapter's name where the request named one."""
        adapter = self._options.lora_request
        return adapter.lora_name if adapter is not None else self.server.model_name

    def _deliver(self, event) -> None:  # called on the engine loop thread
        self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    async def start(self) -> None:
        """Take an admission place, submit, wait until the engine admitted the request."""
        self.server.admission.enter()
        self._admitted_place = True
        submission = Submission(
            request_id=self.request_id,
            prompts=self._prompts,
            params=self._params,
            scenario=self._scenario,
            submitted_at=time.perf_counter(),
            deliver=self._deliver,
            options=self._options,
        )
        try:
            self.server.engine_loop.submit(submission)
        except LoopStopped as err:
            raise shutting_down() from err
        self._submitted = True
        event = await self._events.get()
        if isinstance(event, Rejected):
            self._done = True
            if event.param is not None:
                raise bad_request(event.message, param=event.param)
            raise bad_request(f"{self._prompt_param}: {event.message}", param=self._prompt_param)
        if isinstance(event, Failed):
            self._done = True
            raise APIError(status=event.status, message=event.message, code=event.code, param=event.param)
        if not isinstance(event, Admitted):
            raise APIError(status=500, message=f"unexpected engine event {type(event).__name__}", code="engine_error")

    async def progress(self) -> AsyncIterator[Progress]:
        """The progress events of the request's completions until all have finished (then
        `output` holds them all); a failure raises APIError."""
        finished: dict[int, RequestOutput] = {}
        while True:
            event = await self._events.get()
            if isinstance(event, Failed):
                self._done = True
                raise APIError(status=event.status, message=event.message, code=event.code, param=event.param)
            if event.prompt_logprobs is not None:
                self.prompt_logprobs[event.index] = event.prompt_logprobs
            if event.finished:
                finished[event.index] = event.output
                if len(finished) == self.num_children:
                    self._done = True
                    outputs = [finished[index] for index in range(self.num_children)]
                    self.output = merged_batch_output(
                        self.request_id,
                        outputs,
                        n=self.n,
                        seed=outputs[0].seed,
                        samples=self.num_samples,
                        keep_logprobs=self._keep_logprobs,
                    )
                    if self.num_samples > self.n:  # every child of a prompt has its prompt's logprobs
                        by_child = self.prompt_logprobs
                        self.prompt_logprobs = {
                            choice: by_child[(choice // self.n) * self.num_samples]
                            for choice in range(self.num_choices)
                            if (choice // self.n) * self.num_samples in by_child
                        }
            yield event
            if self.output is not None:
                return

    async def collect(self) -> RequestOutput:
        """Wait for the end; the full output (every completion)."""
        async for _ in self.progress():
            pass
        if self.output is None:
            raise APIError(status=500, message="the request ended without an output", code="engine_error")
        return self.output

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._submitted and not self._done:
            self.server.engine_loop.abort(self.request_id)
        if self._admitted_place:
            self.server.admission.leave()


# The request bodies are read and parsed by the handlers themselves (not by FastAPI from a
# typed parameter) so that both happen under the size limit, the read timeout and off the
# event loop.
def _add_generation_routes(app: FastAPI, server: QuickdraftServer) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _read_request(server, request, model=CompletionRequest)
        if body is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        prepared = _prepare(server, request=request, body=body)
        prompts = await server.preprocessor.run(_completion_prompts, server, body)
        echo = None
        if body.echo:  # the prompt as given, or its token ids' text
            texts = [p if isinstance(p, str) else server.tokenizer.decode(p) for p in body.prompts()]
            echo = list(zip(texts, prompts))
        return await _generate(
            server,
            body=body,
            request=request,
            prepared=prepared,
            prompts=prompts,
            prompt_param="prompt",
            id_prefix="cmpl",
            writer_class=CompletionWriter,
            writer_options={"echo": echo},
        )

    @app.post("/v1/responses")
    async def responses(request: Request):
        body = await _read_request(server, request, model=ResponsesRequest)
        if body is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        body.check_unsupported()
        history = server.responses.conversation(body.previous_response_id) if body.previous_response_id else []
        try:
            return await _respond_to(server, request=request, body=body, history=history)
        except APIError as err:
            raise renamed_error(err) from err

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return JSONResponse(server.responses.body(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        server.responses.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _read_request(server, request, model=TokenizeRequest)
        if body is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        _check_model(server, body.model)
        _use_server_chat_settings(server, body)
        body.check()
        return JSONResponse(await server.preprocessor.run(_tokenize, server, body))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _read_request(server, request, model=DetokenizeRequest)
        if body is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        _check_model(server, body.model)
        vocab = server.tokenizer.vocab_size
        bad = [token for token in body.tokens if not 0 <= token < vocab]
        if bad:
            raise bad_request(f"tokens: ids outside the vocabulary [0, {vocab}): {bad[:5]}", param="tokens")
        text = await server.preprocessor.run(server.tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text})

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await _read_request(server, request, model=EmbeddingRequest)
        if body is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        _check_base_model(server, body.model)
        vectors, used = await _pool_inputs(server, body, task="embed")
        data = [
            {"object": "embedding", "index": index, "embedding": _embedding_body(vector, body.encoding_format)}
            for index, vector in enumerate(vectors)
        ]
        return _list_response(server, body, prefix="embd", data=data, used=used)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(request: Request):
        body = await _read_request(server, request, model=ScoreRequest)
        if body is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        _check_base_model(server, body.model)
        firsts, seconds = body.texts()
        try:
            pairs = score_pairs(len(firsts), len(seconds))
        except ValueError as err:
            raise bad_request(str(err), param="text_2") from err
        scores, used = await _pair_scores(
            server,
            firsts + seconds,
            pairs,
            num_first=len(firsts),
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            add_special_tokens=body.add_special_tokens,
        )
        data = [{"index": index, "object": "score", "score": value} for index, value in enumerate(scores)]
        return _list_response(server, body, prefix="score", data=data, used=used)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(request: Request):
        body = await _read_request(server, request, model=RerankRequest)
        if body is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        _check_base_model(server, body.model)
        [query], documents = body.texts()
        scores, used = await _pair_scores(
            server,
            [query, *documents],
            score_pairs(1, len(documents)),
            num_first=1,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            add_special_tokens=body.add_special_tokens,
        )
        ranked = sorted(range(len(documents)), key=lambda index: -scores[index])  # stable: ties keep their order
        ranked = ranked[: body.top_n] if body.top_n else ranked
        results = [
            {"index": index, "relevance_score": scores[index]}
            | ({"document": {"text": documents[index]}} if body.return_documents else {})
            for index in ranked
        ]
        return JSONResponse(
            {
                "id": f"rerank-{uuid.uuid4().hex}",
                "model": body.model or server.model_name,
                "results": results,
                "usage": {"prompt_tokens": used, "total_tokens": used},
            }
        )

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(request: Request):
        body = await _read_request(server, request, model=ClassificationRequest)
        if body is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        _check_base_model(server, body.model)
        classifier = server.engine.pooler.classifier
        if classifier is None:
            raise bad_request(
                "model: this model has no classification head (a *ForSequenceClassification one has)", param="model"
            )
        prompts = body.prompts()
        token_ids = await server.preprocessor.run(
            _pooling_tokens, server, prompts, add_special_tokens=body.add_special_tokens, param="input"
        )
        keep = body.truncate_prompt_tokens
        probs = await _pool_on_loop(server, lambda engine: engine.classify(token_ids, truncate_prompt_tokens=keep))
        data = [
            {
                "index": index,
                "label": classifier.labels[int(p.argmax())],
                "probs": p.tolist(),
                "num_classes": classifier.num_labels,
            }
            for index, p in enumerate(probs)
        ]
        used = _tokens_used(token_ids, keep=keep)
        return _list_response(server, body, prefix="classify", data=data, used=used)

    @app.post("/pooling")
    @app.post("/v1/pooling")
    async def pooling(request: Request):
        body = await _read_request(server, request, model=PoolingRequest)
        if body is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        _check_base_model(server, body.model)
        pooler = server.engine.pooler
        task = pooler.default_task if body.task is None else body.task
        try:
            pooler.check_task(task, field="task")
        except ValueError as err:
            raise bad_request(str(err), param="task") from err
        results, used = await _pool_inputs(server, body, task=task)
        data = [
            {"index": index, "object": "pooling", "data": _embedding_body(result, body.encoding_format)}
            for index, result in enumerate(results)
        ]
        return _list_response(server, body, prefix="pool", data=data, used=used)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _read_request(server, request, model=ChatCompletionRequest)
        if body is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return await _chat(server, request=request, body=body)


# ---- SageMaker's /invocations (vLLM serves it): one path for every kind of request ------------
def invocation_path(body: Any, *, classifier: bool) -> str:
    """The route that serves an /invocations body (routing.invoked_route); a 400 naming the
    fields that pick one."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}", param=None)
    path = invoked_route(body, classifier=classifier)
    if path is None:
        fields = ", ".join(f"{name} ({route})" for name, route in INVOCATION_FIELDS)
        raise bad_request(f"/invocations: the body has none of the fields that pick a route: {fields}", param=None)
    return path


def _add_invocations_route(app: FastAPI, server: QuickdraftServer) -> None:
    endpoints = {route.path: route.endpoint for route in app.routes if "POST" in getattr(route, "methods", ())}

    @app.post("/invocations")
    async def invocations(request: Request):
        raw = await _read_raw(server, request)
        if raw is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        body = await server.preprocessor.run(parse_json, raw, content_type=request.headers.get("content-type"))
        path = invocation_path(body, classifier=server.engine.pooler.classifier is not None)
        # The route reads the body again (and then the client's disconnect) through this receive.
        replayed = False

        async def receive() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await request.receive()
            replayed = True
            return {"type": "http.request", "body": raw, "more_body": False}

        return await endpoints[path](Request(request.scope, receive))


async def _chat(
    server: QuickdraftServer,
    *,
    request: Request,
    body: ChatCompletionRequest,
    prompt_param: str = "messages",
    id_prefix: str = "chatcmpl",
    writer_class: type[ChatWriter] | None = None,
    writer_options: dict[str, Any] | None = None,  # the writer's own keyword arguments, beside chat's
) -> Response:
    """A chat request through the engine loop (the Responses API's too, as the chat request it means)."""
    _use_server_chat_settings(server, body)
    prepared = _prepare(server, request=request, body=body)
    prepared.params = _decoded_for_reasoning(server, _thinking_first(server, prepared.params))
    _check_tool_parser(server, body.tool_calling)
    prompt_token_ids = await server.preprocessor.run(_render_chat, server, body)
    reasoning = _reasoning_parser(server, prepared.params)
    return await _generate(
        server,
        body=body,
        request=request,
        prepared=prepared,
        prompts=[prompt_token_ids],
        prompt_param=prompt_param,
        id_prefix=id_prefix,
        writer_class=writer_class or ChatWriter,
        writer_options={
            "tool_calling": body.tool_calling,
            "reasoning": reasoning,
            "echo": body.echoed_text(),
            **(writer_options or {}),
        },
    )


async def _respond_to(server: QuickdraftServer, *, request: Request, body: ResponsesRequest, history: list) -> Response:
    """A Responses request through the chat pipeline, as the chat request it means."""
    conversation = history + body.input_messages()
    try:
        chat = ChatCompletionRequest.model_validate(body.chat_fields(conversation=conversation))
    except ValidationError as err:
        raise validation_error_to_api_error(err.errors()) from err
    return await _chat(
        server,
        request=request,
        body=chat,
        prompt_param="input",
        id_prefix="resp",
        writer_class=ResponsesWriter,
        writer_options={"request": body, "conversation": conversation},
    )


async def _read_request(server: QuickdraftServer, request: Request, *, model: type[Model]) -> Model | None:
    """The validated body (parsed on a preprocessing thread), or None if the client left."""
    raw = await _read_raw(server, request)
    if raw is None:
        return None
    return await server.preprocessor.run(
        parse_request, raw, content_type=request.headers.get("content-type"), model=model
    )


async def _read_raw(server: QuickdraftServer, request: Request) -> bytes | None:
    """The body under the server's size and time limits, or None if the client left."""
    if server.shutting_down:  # before reading a body that would be refused anyway
        raise shutting_down()
    return await read_body(
        request, max_bytes=server.config.max_request_bytes, idle_timeout=server.config.request_read_timeout_seconds
    )


async def read_body(request: Request, *, max_bytes: int, idle_timeout: float) -> bytes | None:
    """The request body, or None when the client disconnected while sending it.

    413 as soon as the body is known to be too large (from Content-Length before reading any
    of it, else once the bytes read pass the limit); 408, closing the connection, when no
    byte of it arrives for idle_timeout seconds. What is left unread is discarded by uvicorn.
    """
    declared = _content_length(request)
    if declared is not None and declared > max_bytes:
        raise _body_too_large(max_bytes, size=f"{declared} bytes")
    chunks, size = [], 0
    while True:
        try:
            message = await asyncio.wait_for(request.receive(), idle_timeout)
        except TimeoutError:
            raise APIError(
                status=408,
                code="request_timeout",
                headers={"Connection": "close"},
                message=f"no data of the request body arrived for {idle_timeout:g} s "
                "(--request-read-timeout); closing the connection",
            ) from None
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise _body_too_large(max_bytes, size=f"more than {max_bytes} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _content_length(request: Request) -> int | None:
    try:
        return int(request.headers["content-length"])
    except (KeyError, ValueError):  # absent (chunked), or malformed (uvicorn refuses those itself)
        return None


def _body_too_large(max_bytes: int, *, size: str) -> APIError:
    return APIError(
        status=413,
        code="request_too_large",
        message=f"the request body ({size}) is larger than this server takes: {max_bytes} bytes (--max-request-bytes)",
    )


def _completion_prompts(server: QuickdraftServer, body: CompletionRequest) -> list[list[int]]:
    """Each prompt's token ids, checked against the context (runs on a preprocessing thread)."""
    prompts = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            token_ids = server.tokenizer.encode(prompt, add_special_tokens=body.add_special_tokens)
        else:
            token_ids = list(prompt)
        token_ids = _truncated(token_ids, body.truncate_prompt_tokens)
        _check_prompt_length(server, token_ids, param="prompt")
        prompts.append(token_ids)
    return prompts


async def _generate(
    server: QuickdraftServer,
    *,
    body,
    request: Request,
    prepared,
    prompts: list[list[int]],
    prompt_param: str,
    id_prefix: str,
    writer_class,
    writer_options: dict[str, Any] | None = None,  # the writer class's own keyword arguments
):
    """Run the prompts through the engine loop, answer (streamed or whole)."""
    _check_room_for_max_tokens(server, prompts, body=body)
    if body.use_beam_search:
        return await _beam_search(
            server,
            body=body,
            request=request,
            prepared=prepared,
            prompts=prompts,
            prompt_param=prompt_param,
            id_prefix=id_prefix,
            writer_class=writer_class,
        )
    generation = Generation(
        server=server,
        prompts=prompts,
        params=prepared.params,
        scenario=prepared.scenario,
        prompt_param=prompt_param,
        id_prefix=id_prefix,
        options=prepared.options,
        client_request_id=body.request_id,
    )
    writer = writer_class(
        server=server,
        generation=generation,
        include_usage=body.include_usage,
        include_token_ids=body.return_token_ids,
        continuous_usage=body.continuous_usage,
        include_prompt_logprobs=body.prompt_logprobs is not None,
        tokens_as_ids=body.return_tokens_as_token_ids,
        predicted=body.prediction is not None,
        **(writer_options or {}),
    )
    return await _respond(generation, writer=writer, stream=body.stream, request=request)


async def _beam_search(
    server: QuickdraftServer,
    *,
    body,
    request: Request,
    prepared,
    prompts: list[list[int]],
    prompt_param: str,
    id_prefix: str,
    writer_class,
):
    """vLLM's use_beam_search: rounds of one-token requests through the engine loop (each
    beam's top 2n next tokens; engine/beam_search.py), then the n best beams of each prompt as
    its choices (choice k: beam k % n of prompt k // n)."""
    try:
        check_ranks_by_logprobs(server.config.logprobs_mode, what="beam search")
    except ValueError as error:
        raise bad_request(str(error), param="use_beam_search") from None
    params = body.beam_search_params(
        max_tokens=prepared.params.max_tokens, room=server.max_model_len - max(len(p) for p in prompts)
    )
    search = BeamSearch(prompts, params, eos_token_ids=server.eos_token_ids, max_model_len=server.max_model_len)
    common = dict(server=server, scenario=prepared.scenario, prompt_param=prompt_param, id_prefix=id_prefix)
    started = time.perf_counter()
    while not search.done:
        pending = search.pending()
        generation = Generation(prompts=pending, params=params.round_params(), options=prepared.options, **common)
        try:
            await generation.start()
            output = await _collect_unless_disconnected(generation, request)
        finally:
            generation.close()
        if output is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        search.advance([completion.logprobs[0].top for completion in output.outputs])  # type: ignore[index]
    beams = search.results(
        decode=lambda ids: server.tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens)
    )
    completions = [
        CompletionOutput(
            index=prompt * params.beam_width + rank,
            text=beam.output_text,
            token_ids=beam.output_token_ids,
            finish_reason=beam.finish_reason,
            cumulative_logprob=beam.cum_logprob,
        )
        for prompt, result in enumerate(beams)
        for rank, beam in enumerate(result.sequences)
    ]
    metrics = RequestMetrics(arrival_time=started, num_prompt_tokens=sum(len(p) for p in prompts))
    output = RequestOutput(
        request_id=id_prefix,
        prompt=None,
        prompt_token_ids=prompts[0],
        outputs=completions,
        finished=True,
        metrics=metrics,
    )
    # the response's id and envelope (this generation is never submitted)
    envelope = Generation(
        prompts=prompts, params=prepared.params, options=prepared.options, client_request_id=body.request_id, **common
    )
    writer = writer_class(
        server=server, generation=envelope, include_usage=False, include_token_ids=body.return_token_ids
    )
    return JSONResponse(writer.full_body(output))


class _Prepared:
    def __init__(self, *, params: SamplingParams, scenario: str, options: RequestOptions):
        self.params = params
        self.scenario = scenario
        self.options = options


def _prepare(server: QuickdraftServer, *, request: Request, body: SamplingFields) -> _Prepared:
    """Checks shared by both endpoints: scenario label, model, unsupported fields, sampling."""
    # The body's metadata.scenario wins over the X-Scenario header.
    raw_scenario = (body.metadata or {}).get("scenario") or request.headers.get(SCENARIO_HEADER)
    scenario = server.scenarios.resolve(raw_scenario)
    request.state.scenario = scenario
    adapter = _check_model(server, body.model)
    body.check_unsupported()
    params = body.sampling_params(server.default_sampling, max_logprobs=server.config.max_logprobs)
    if body.logits_processors:
        processors = resolve_logits_processors(body.logits_processors, pattern=server.config.logits_processor_pattern)
        try:
            params = dataclasses.replace(params, logits_processors=processors)
        except ValueError as err:  # not a callable of the forms a processor takes
            raise bad_request(str(err), param="logits_processors") from err
    options = RequestOptions(priority=body.priority, cache_salt=body.cache_salt, lora_request=adapter)
    return _Prepared(params=params, scenario=scenario, options=options)


def _tokenize(server: QuickdraftServer, body: TokenizeRequest) -> dict[str, Any]:
    """vLLM's /tokenize answer (on a preprocessing thread): a prompt longer than the context is
    counted too, so that a client can see by how much."""
    tokenizer = server.tokenizer
    if body.messages is not None:
        text = _chat_text(server, body, instead="tokenize a prompt")
        tokens = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = tokenizer.encode(body.prompt or "", add_special_tokens=add_special)
    strings = [tokenizer.id_to_token(token) for token in tokens] if body.return_token_strs else None
    return {"count": len(tokens), "max_model_len": server.max_model_len, "tokens": tokens, "token_strs": strings}


def _list_response(server: QuickdraftServer, body: Any, *, prefix: str, data: list[dict], used: int) -> JSONResponse:
    """The `{"object": "list", "data": [...]}` answer of /v1/embeddings, /score and /classify."""
    return JSONResponse(
        {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": body.model or server.model_name,
            "data": data,
            "usage": {"prompt_tokens": used, "total_tokens": used},
        }
    )


def _check_base_model(server: QuickdraftServer, model: str | None) -> None:
    if _check_model(server, model) is not None:
        raise bad_request("model: embeddings and scores come from the base model, not a LoRA adapter", param="model")


def _pooling_params(server: QuickdraftServer, **fields: Any) -> PoolingParams:
    try:
        return PoolingParams(pooling_type=server.config.pooling_type, **fields)
    except ValueError as err:
        raise bad_request(str(err), param=None) from err


def _pooling_tokens(
    server: QuickdraftServer, prompts: list[str | list[int]], *, add_special_tokens: bool, param: str
) -> list[list[int]]:
    """Each input of an embedding or scoring request as token ids (on a preprocessing thread): a
    text tokenized, ids checked."""
    tokenizer, vocab = server.tokenizer, server.tokenizer.vocab_size
    token_ids = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            token_ids.append(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
            continue
        bad = [token for token in prompt if not 0 <= token < vocab]
        if bad:
            raise bad_request(f"{param}[{index}]: ids outside the vocabulary [0, {vocab}): {bad[:5]}", param=param)
        token_ids.append(prompt)
    return token_ids


async def _pool_inputs(
    server: QuickdraftServer, body: EmbeddingRequest, *, task: str
) -> tuple[list[torch.Tensor], int]:
    """(each input's result of a pooling task, float32; the prompt tokens run) for a body with the
    fields of /v1/embeddings, computed on the loop thread between steps (Engine.pool)."""
    params = _pooling_params(
        server,
        normalize=body.normalize,
        dimensions=body.dimensions,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
    )
    token_ids = await server.preprocessor.run(
        _pooling_tokens, server, body.prompts(), add_special_tokens=body.add_special_tokens, param="input"
    )
    results = await _pool_on_loop(server, lambda engine: engine.pool(token_ids, params, task=task))
    return results, _tokens_used(token_ids, keep=params.truncate_prompt_tokens)


async def _embed_on_loop(
    server: QuickdraftServer, token_ids: list[list[int]], params: PoolingParams
) -> list[torch.Tensor]:  # each [D] float32
    """The prompts' embeddings, computed on the loop thread between steps of the requests generating."""
    return await _pool_on_loop(server, lambda engine: engine.embed(token_ids, params))


async def _pool_on_loop(server: QuickdraftServer, call: Callable[[Any], list[torch.Tensor]]) -> list[torch.Tensor]:
    """`call(engine)` (embed or classify) on the loop thread, between steps of the requests generating;
    its errors as 400s naming the input.  While generating requests hold the cache slots or blocks
    it needs, it waits for them (the loop runs it again after later steps, as a generation request
    waits in the queue); a cache that is full with nothing generating is a 503."""
    try:
        return await asyncio.wrap_future(server.engine_loop.call(call, wait_for_cache=True))
    except LoopStopped as err:
        raise shutting_down() from err
    except ValueError as err:
        raise bad_request(str(err), param="dimensions" if "dimensions" in str(err) else "input") from err
    except CacheFullError as err:
        raise APIError(status=503, message=str(err), param=None, code="cache_full") from err


def _tokens_used(token_ids: list[list[int]], *, keep: int | None) -> int:
    """The prompt tokens run: each prompt's, truncated to its last `keep` (None: whole)."""
    return sum(len(ids) if keep is None else min(len(ids), keep) for ids in token_ids)


async def _pair_scores(
    server: QuickdraftServer,
    texts: list[str],
    pairs: list[tuple[int, int]],
    *,
    num_first: int,
    truncate_prompt_tokens: int | None,
    add_special_tokens: bool,
) -> tuple[list[float], int]:
    """(each pair's score, the prompt tokens run): texts[:num_first] are the first texts, the rest
    the second ones.  A reranker reads each pair as one prompt (LLM.score); an embedding model's
    score is the cosine of the two embeddings, each distinct text embedded once."""
    pooler = server.engine.pooler
    if pooler.classifier is not None and not pooler.cross_encoder:
        raise bad_request(
            f"scores need an embedding model or a reranker; this classifier has {pooler.classifier.num_labels} "
            "labels: use /classify",
            param="model",
        )
    if pooler.cross_encoder:  # each pair one prompt

        def token_ids(inputs: list[str], specials: bool) -> list[list[int]]:
            return _pooling_tokens(server, inputs, add_special_tokens=specials and add_special_tokens, param="input")

        prompts = await server.preprocessor.run(
            server.tokenizer.cross_encoder_prompts, texts[:num_first], texts[num_first:], pairs, token_ids=token_ids
        )
        probs = await _pool_on_loop(
            server, lambda engine: engine.classify(prompts, truncate_prompt_tokens=truncate_prompt_tokens)
        )
        return [float(p[0]) for p in probs], _tokens_used(prompts, keep=truncate_prompt_tokens)
    params = _pooling_params(server, truncate_prompt_tokens=truncate_prompt_tokens)
    token_ids = await server.preprocessor.run(
        _pooling_tokens, server, texts, add_special_tokens=add_special_tokens, param="input"
    )
    distinct = list(dict.fromkeys(tuple(ids) for ids in token_ids))
    vectors = dict(zip(distinct, await _embed_on_loop(server, [list(ids) for ids in distinct], params)))
    scores = [
        cosine_similarity(vectors[tuple(token_ids[i])], vectors[tuple(token_ids[num_first + j])]) for i, j in pairs
    ]
    return scores, _tokens_used([list(ids) for ids in distinct], keep=params.truncate_prompt_tokens)


def _embedding_body(vector: torch.Tensor, encoding_format: str) -> list | str:  # vector [D] or [T, D] float32
    """OpenAI's: a (nested) list of floats, or base64 of the little-endian float32 bytes, row after
    row (what its client asks for)."""
    if encoding_format == "float":
        return vector.tolist()
    return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")


def _reasoning_parser(server: QuickdraftServer, params: SamplingParams) -> ReasoningParser | None:
    """The server's reasoning parser for a chat reply (structured/reasoning.py)."""
    name = server.config.reasoning_parser
    return None if name is None else REASONING_PARSERS[name]


def _thinking_first(server: QuickdraftServer, params: SamplingParams) -> SamplingParams:
    """A chat request's constraint behind the model's think block, on a server with a reasoning
    parser: the reply thinks freely, then matches the constraint (as vLLM's structured outputs
    start after the reasoning ends)."""
    constraint, name = params.structured_outputs, server.config.reasoning_parser
    if constraint is None or name is None:
        return params
    try:
        return dataclasses.replace(params, structured_outputs=dataclasses.replace(constraint, reasoning_parser=name))
    except ValueError as err:  # a parser whose replies a constraint cannot follow (openai_gptoss)
        raise bad_request(str(err), param=None, code="unsupported_parameter") from err


def _decoded_for_reasoning(server: QuickdraftServer, params: SamplingParams) -> SamplingParams:
    """A chat reply whose reasoning parser reads special tokens (gpt-oss's harmony markers):
    decoded with them kept, and ended at the parser's stop tokens too (a call's <|call|>)."""
    parser = _reasoning_parser(server, params)
    if parser is None or not parser.keeps_special_tokens:
        return params
    stops = {token_id for token in parser.stop_tokens if (token_id := server.tokenizer.token_to_id(token)) is not None}
    return dataclasses.replace(
        params, skip_special_tokens=False, stop_token_ids=sorted(set(params.stop_token_ids or []) | stops)
    )


def _use_server_chat_settings(server: QuickdraftServer, body: ChatCompletionRequest | TokenizeRequest) -> None:
    """The server's settings for reading tools and chat templates, given to a chat body before it is checked."""
    config = server.config
    body.use_server_tool_settings(constrain_auto_calls=config.auto_tool_call_grammar, parser=config.tool_call_parser)
    if body.chat_template is not None and not config.trust_request_chat_template:
        raise bad_request(
            "chat_template: this server does not take chat templates in requests (a template is code it "
            "would run); start it with --trust-request-chat-template to allow them",
            param="chat_template",
            code="unsupported_parameter",
        )


def _check_tool_parser(server: QuickdraftServer, calling: ToolCalling | None) -> None:
    """`auto` tool choice reads calls out of free text: that needs the server's parser."""
    if calling is not None and calling.mode == "auto" and server.config.tool_call_parser is None:
        raise bad_request(
            'tool_choice "auto" (the default when tools are given) reads calls out of the reply, which needs '
            f"a server started with --tool-call-parser (one of: {', '.join(TOOL_CALL_PARSERS)}); "
            'tool_choice "required" or a named function need none',
            param="tool_choice",
        )


def _check_model(server: QuickdraftServer, model: str | None) -> LoRARequest | None:
    """The LoRA adapter `model` names (None: the base model); a 404 for a name not served."""
    if model is None or model in server.model_names:
        return None
    adapter = server.lora_modules.get(model)
    if adapter is None:
        served = " or ".join(repr(name) for name in [*server.model_names, *server.lora_modules])
        raise APIError(
            status=404,
            param="model",
            code="model_not_found",
            message=f"model: {model!r} does not exist; this server serves {served}",
        )
    return adapter


def _render_chat(server: QuickdraftServer, body: ChatCompletionRequest) -> list[int]:
    """The conversation rendered and tokenized, checked against the context (on a preprocessing thread)."""
    text = _chat_text(server, body, instead="use /v1/completions with a prompt")
    # The template writes BOS itself (as LLM.chat does), unless the request asks for the tokenizer's too.
    token_ids = server.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    token_ids = _truncated(token_ids, body.truncate_prompt_tokens)
    _check_prompt_length(server, token_ids, param="messages")
    return token_ids


def _chat_text(server: QuickdraftServer, body: ChatCompletionRequest | TokenizeRequest, *, instead: str) -> str:
    """The conversation through the chat template; a 400 naming the field at fault (`instead`:
    what to send where there is no template)."""
    hint = instead if not server.config.trust_request_chat_template else f"{instead}, or send a chat_template"
    try:
        return render_chat(server.tokenizer, body.conversation(), body.rendering(), missing_template=hint)
    except ChatRenderError as err:
        raise bad_request(
            str(err).replace("this model", f"the model {server.model_name!r}", 1), param=err.param, code=err.code
        ) from err


def _truncated(token_ids: list[int], keep_last: int | None) -> list[int]:
    """truncate_prompt_tokens (checked in SamplingParams before the prompt is tokenized)."""
    return token_ids if keep_last is None else token_ids[-keep_last:]


def _check_room_for_max_tokens(server: QuickdraftServer, prompts: list[list[int]], *, body) -> None:
    """A request whose own max_tokens does not fit beside its prompt gets vLLM's (and OpenAI's) 400,
    not an answer silently cut at the end of the context; a server default is a cap, never a 400."""
    param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
    max_tokens = getattr(body, param, None)
    if max_tokens is None:
        return
    longest = max(len(p) for p in prompts)
    room = server.max_model_len - longest
    if max_tokens > room:
        raise bad_request(
            f"{param} is too large: {max_tokens}. This model's maximum context length is {server.max_model_len} "
            f"tokens and your request has {longest} input tokens ({max_tokens} > {server.max_model_len} - {longest})",
            param=param,
            code="context_length_exceeded",
        )


def _check_prompt_length(server: QuickdraftServer, prompt_token_ids: list[int], *, param: str) -> None:
    if len(prompt_token_ids) >= server.max_model_len:
        raise bad_request(
            f"{param}: the prompt has {len(prompt_token_ids)} tokens, but the model's context "
            f"(max_model_len) is {server.max_model_len}: no room to generate",
            param=param,
            code="context_length_exceeded",
        )


async def _respond(generation: Generation, *, writer: ResponseWriter, stream: bool, request: Request) -> Response:
    handed_over = False
    try:
        await generation.start()
        if stream:
            response = ServerSentEvents(writer.events(), on_close=generation.close)
            handed_over = True  # the response closes the generation when its connection ends
            return response
        output = await _collect_unless_disconnected(generation, request)
        if output is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(writer.full_body(output))
    finally:
        if not handed_over:
            generation.close()


async def _collect_unless_disconnected(generation: Generation, request: Request) -> RequestOutput | None:
    """The full output, or None when the client disconnected first (the request is aborted)."""
    collecting = asyncio.ensure_future(generation.collect())
    disconnected = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collecting, disconnected}, return_when=asyncio.FIRST_COMPLETED)
        if collecting.done():
            return collecting.result()
        return None
    finally:
        for task in (collecting, disconnected):
            task.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next message the server sends the app is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ServerSentEvents(StreamingResponse):
    """An SSE stream that runs `on_close` however it ends: done, client gone, or cancelled.

    Starlette only watches for the disconnect on older ASGI spec versions and otherwise notices
    it at the next write; this one always watches, so an abort frees the slot at once.
    """

    def __init__(self, content: AsyncIterator[str], *, on_close: Callable[[], None]):
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tasks:

                async def stream_then_stop() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-write
                        await self.stream_response(send)
                    tasks.cancel_scope.cancel()

                tasks.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                tasks.cancel_scope.cancel()
        finally:
            self._on_close()


# ---- response bodies ------------------------------------------------------------------------
def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


class ResponseWriter:
    """Shapes one request's events into the endpoint's OpenAI bodies and SSE chunks."""

    object_name: str  # "text_completion" / "chat.completion"
    chunk_object_name: str

    def __init__(
        self,
        *,
        server: QuickdraftServer,
        generation: Generation,
        include_usage: bool,
        include_token_ids: bool = False,
        continuous_usage: bool = False,
        include_prompt_logprobs: bool = False,
        tokens_as_ids: bool = False,
        predicted: bool = False,
    ):
        self.server = server
        self.predicted = predicted  # the request brought a prediction: usage reports what came of it
        self.tokens_as_ids = tokens_as_ids  # vLLM's return_tokens_as_token_ids: "token_id:<id>" in logprobs
        self.generation = generation
        self.include_usage = include_usage
        self.include_token_ids = include_token_ids  # vLLM's return_token_ids extension
        self.include_prompt_logprobs = include_prompt_logprobs  # vLLM's prompt_logprobs extension
        # vLLM's continuous_usage_stats: every chunk's usage is the tokens so far (with include_usage)
        self.continuous_usage = continuous_usage and include_usage
        self._num_streamed_tokens = 0  # every choice's, for continuous usage

    def _with_token_ids(self, choice: dict[str, Any], token_ids: list[int]) -> dict[str, Any]:
        return {**choice, "token_ids": list(token_ids)} if self.include_token_ids else choice

    def _has_new_tokens_to_send(self, event: Progress) -> bool:
        # A token whose text is withheld (a possible stop string) still goes out with its id.
        return self.include_token_ids and bool(event.token_ids)

    def _decode_token(self, token_id: int) -> str:
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return self.server.tokenizer.decode([token_id], skip_special_tokens=False)

    def _prompt_logprobs(self, index: int) -> list[dict[str, Any] | None] | None:
        """Choice `index`'s prompt logprobs in vLLM's form, where the request asked for them."""
        entries = self.generation.prompt_logprobs.get(index)
        if not self.include_prompt_logprobs or entries is None:
            return None
        return prompt_logprobs_body(entries, decode=self._decode_token)

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.generation.response_id,
            "object": object_name,
            "created": self.generation.created,
            "model": self.generation.model_name,
        }

    def _speculation(self, output: RequestOutput) -> dict[str, Any]:
        return speculation_body(output.metrics, method=self.server.method, adaptive=self.server.adaptive)

    def full_body(self, output: RequestOutput) -> dict[str, Any]:
        return {
            **self._envelope(self.object_name),
            "choices": [self._full_choice(completion) for completion in output.outputs],
            "usage": usage_of(output, predicted=self.predicted),
            "speculation": self._speculation(output),
            "seed": output.seed,
        }  # replays a sampled answer (drawn by the engine when not given; completion i used seed + i)

    def _full_choice(self, completion: CompletionOutput) -> dict[str, Any]:
        raise NotImplementedError

    def _final_extras(self) -> dict[str, Any]:
        """What the chunk that ends the last completion carries: the request's acceptance
        figures and seed (none before every completion has finished)."""
        output = self.generation.output
        return {} if output is None else {"speculation": self._speculation(output), "seed": output.seed}

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        body = {**self._envelope(self.chunk_object_name), "choices": choices}
        if self.continuous_usage:
            body["usage"] = usage_body(
                num_prompt_tokens=self.generation.num_prompt_tokens, num_completion_tokens=self._num_streamed_tokens
            )
        elif self.include_usage:
            body["usage"] = None  # OpenAI: every chunk has usage null but the last one
        return sse({**body, **extra})

    async def events(self) -> AsyncIterator[str]:
        """SSE chunks, the usage chunk when asked, then [DONE]; an engine failure is an error event."""
        try:
            for chunk in self._opening_chunks():
                yield chunk
            async for event in self.generation.progress():
                self._num_streamed_tokens += len(event.token_ids)
                chunk = self._progress_chunk(event)
                if chunk is not None:
                    yield chunk
                output = self.generation.output
                if output is not None and self.include_usage:
                    yield sse(
                        {
                            **self._envelope(self.chunk_object_name),
                            "choices": [],
                            "usage": usage_of(output, predicted=self.predicted),
                            "speculation": self._speculation(output),
                        }
                    )
        except APIError as err:
            yield sse(err.body())
        yield sse("[DONE]")

    def _opening_chunks(self) -> list[str]:
        return []

    def _progress_chunk(self, event: Progress) -> str | None:
        raise NotImplementedError


class CompletionWriter(ResponseWriter):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, *, echo: list[tuple[str, list[int]]] | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        # Per completion: the text offsets of its streamed logprobs carry over from chunk to chunk.
        self._stream_logprobs = [
            CompletionLogprobs(decode=self._decode_token) for _ in range(self.generation.num_choices)
        ]
        self._echo = echo  # per prompt (text, token ids), put before its choices' text (`echo`)
        self._echoed: set[int] = set()  # streamed choices whose prompt went out

    def _echoed_prompt(self, index: int) -> tuple[str, list[int]] | None:
        return None if self._echo is None else self._echo[index // self.generation.n]

    def _full_choice(self, completion: CompletionOutput) -> dict[str, Any]:
        text, entries, prompt_ids = completion.text, completion.logprobs, None
        echoed = self._echoed_prompt(completion.index)
        if echoed is not None:
            prompt_text, prompt_ids = echoed
            text = prompt_text + text
            prompt_logprobs = self.generation.prompt_logprobs.get(completion.index)
            if entries is not None and prompt_logprobs is not None:
                entries = prompt_logprobs[1:] + entries  # entries after the first are all set by now
            else:
                prompt_ids = None
        logprobs = None
        if entries is not None:
            logprobs = CompletionLogprobs(decode=self._decode_token).body(entries, prompt=prompt_ids)
        choice = {
            "index": completion.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
        }
        if self.include_prompt_logprobs:
            choice["prompt_logprobs"] = self._prompt_logprobs(completion.index)
        return self._with_token_ids(choice, completion.token_ids)

    def _echo_chunk(self, event: Progress) -> str:
        """The choice's prompt (and its tokens' logprobs when asked), before its first tokens."""
        echoed = self._echoed_prompt(event.index)
        if echoed is None or event.index in self._echoed:
            return ""
        self._echoed.add(event.index)
        prompt_text, prompt_ids = echoed
        logprobs = None
        if event.prompt_logprobs is not None:
            entries = event.prompt_logprobs[1:]
            logprobs = self._stream_logprobs[event.index].body(entries, prompt=prompt_ids)
        return self._chunk([{"index": event.index, "text": prompt_text, "logprobs": logprobs, "finish_reason": None}])

    def _progress_chunk(self, event: Progress) -> str | None:
        echo = self._echo_chunk(event)
        if not (event.text or event.finished or event.logprobs or self._has_new_tokens_to_send(event)):
            return echo or None
        logprobs = self._stream_logprobs[event.index].body(event.logprobs) if event.logprobs is not None else None
        choice = self._with_token_ids(
            {"index": event.index, "text": event.text, "logprobs": logprobs, "finish_reason": event.finish_reason},
            event.token_ids,
        )
        return echo + self._chunk([choice], **self._final_extras())


class ChatWriter(ResponseWriter):
    """Chat bodies; with tool calling, each completion's text is read by its ToolCallStream into
    content and `tool_calls` (the streamed pieces join into what the whole reply carries)."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(
        self,
        *,
        tool_calling: ToolCalling | None = None,
        reasoning: ReasoningParser | None = None,
        echo: str = "",
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self._tool_calling = tool_calling
        self._reasoning = reasoning  # splits the thinking out before the calls are read
        self._echo = echo  # vLLM's chat echo: the assistant's last message, before the reply
        self._streams: dict[int, ToolCallStream] = {}  # per streamed completion

    def full_body(self, output: RequestOutput) -> dict[str, Any]:
        body = super().full_body(output)
        if self.include_prompt_logprobs:  # vLLM's place for them in chat: beside the choices
            body["prompt_logprobs"] = self._prompt_logprobs(0)
        return body

    def _new_stream(self) -> ToolCallStream:
        stream = PlainTextStream() if self._tool_calling is None else self._tool_calling.new_stream()
        return stream if self._reasoning is None else self._reasoning.new_stream(stream)

    def _finish_reason(self, reason: str | None, stream: ToolCallStream) -> str | None:
        return reason if self._tool_calling is None else self._tool_calling.finish_reason(reason, stream)

    def _full_choice(self, completion: CompletionOutput) -> dict[str, Any]:
        logprobs = None
        if completion.logprobs is not None:
            logprobs = chat_logprobs_body(completion.logprobs, decode=self._decode_token)
        stream = self._new_stream()
        reply = stream.whole(completion.text)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if self._tool_calling is not None:
            message["content"] = reply.content or None  # OpenAI: null beside calls
            message["tool_calls"] = merged_calls(reply.calls)
        if self._reasoning is not None:
            message["reasoning"] = reply.reasoning or None
            if not reply.content:
                message["content"] = None  # all thinking: the reply has no answer yet
        if self._echo:
            message["content"] = self._echo + (message["content"] or "")
        return self._with_token_ids(
            {
                "index": completion.index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": self._finish_reason(completion.finish_reason, stream),
            },
            completion.token_ids,
        )

    def _opening_chunks(self) -> list[str]:
        # OpenAI's first chunk of each choice announces the role.
        return [
            self._chunk(
                [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": self._echo},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for index in range(self.generation.num_choices)
        ]

    def _progress_chunk(self, event: Progress) -> str | None:
        stream = self._streams.setdefault(event.index, self._new_stream())
        reply = stream.feed(event.text)
        if event.finished:
            reply += stream.finish()
        logprobs = chat_logprobs_body(event.logprobs, decode=self._decode_token) if event.logprobs else None
        if reply or logprobs or self._has_new_tokens_to_send(event):
            content = {
                "index": event.index,
                "delta": _delta_body(reply),
                "logprobs": logprobs,
                "finish_reason": None,
            }
            content_chunk = self._chunk([self._with_token_ids(content, event.token_ids)])
        else:
            content_chunk = ""
        if not event.finished:
            return content_chunk or None
        reason = self._finish_reason(event.finish_reason, stream)
        final = self._chunk(
            [{"index": event.index, "delta": {}, "logprobs": None, "finish_reason": reason}],
            **self._final_extras(),
        )
        return content_chunk + final


class ResponsesWriter(ChatWriter):
    """The chat reply as OpenAI's Response object (server/responses.py) and, streamed, as its
    events: response.created, each output item opened, its text or arguments in deltas, closed,
    then response.completed with the whole response. A stored response is kept for
    previous_response_id."""

    def __init__(self, *, request: ResponsesRequest, conversation: list[dict[str, Any]], **kwargs: Any):
        super().__init__(**kwargs)
        self._request = request
        self._conversation = conversation  # the messages the reply answers (instructions left out)
        self._sequence = 0
        self._items: list[dict[str, Any]] = []  # streamed output items
        self._open = False  # whether the last item is still being streamed

    def _response(self, *, output: list[dict[str, Any]], status: str, usage=None, finish_reason=None):
        return response_body(
            response_id=self.generation.response_id,
            created=self.generation.created,
            model=self.generation.model_name,
            request=self._request,
            output=output,
            status=status,
            usage=usage,
            finish_reason=finish_reason,
        )

    def _kept(self, body: dict[str, Any]) -> dict[str, Any]:
        if self._request.store:
            self.server.responses.put(body, conversation=self._conversation)
        return body

    def full_body(self, output: RequestOutput) -> dict[str, Any]:
        chat = super().full_body(output)
        (choice,) = chat["choices"]
        logprobs = choice["logprobs"]["content"] if self._request.wants_logprobs and choice["logprobs"] else None
        items = output_items(choice["message"], logprobs=logprobs)
        return self._kept(
            self._response(output=items, status="completed", usage=chat["usage"], finish_reason=choice["finish_reason"])
        )

    def _event(self, kind: str, **fields: Any) -> str:
        self._sequence += 1
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    async def events(self) -> AsyncIterator[str]:
        yield self._event("response.created", response=self._response(output=[], status="in_progress"))
        yield self._event("response.in_progress", response=self._response(output=[], status="in_progress"))
        stream = self._new_stream()
        finish_reason = None
        try:
            async for event in self.generation.progress():
                reply = stream.feed(event.text)
                if event.finished:
                    reply += stream.finish()
                    finish_reason = self._finish_reason(event.finish_reason, stream)
                logprobs = None
                if self._request.wants_logprobs and event.logprobs:
                    logprobs = chat_logprobs_body(event.logprobs, decode=self._decode_token)["content"]
                for chunk in self._reply_events(reply, logprobs=logprobs):
                    yield chunk
            if not self._items:  # an empty reply is one empty message, as the whole response has it
                for chunk in self._open_item("message"):
                    yield chunk
            for chunk in self._close_item():
                yield chunk
            output = self.generation.output
            usage = None if output is None else usage_of(output)
            final = self._response(output=self._items, status="completed", usage=usage, finish_reason=finish_reason)
            yield self._event("response.completed", response=self._kept(final))
        except APIError as err:
            yield self._event("error", code=err.code, message=err.message, param=err.param)

    def _reply_events(self, reply: ReplyDelta, *, logprobs: list[dict[str, Any]] | None = None) -> list[str]:
        """Events for what the reply added: thinking, text and call pieces, each in its item
        (a new kind of piece closes the open item and opens its own)."""
        events: list[str] = []
        if reply.reasoning:
            events += self._open_item("reasoning")
            self._items[-1]["content"][0]["text"] += reply.reasoning
            events.append(self._event("response.reasoning_text.delta", **self._at(), delta=reply.reasoning))
        if reply.content or logprobs:
            events += self._open_item("message")
            part = self._items[-1]["content"][0]
            part["text"] += reply.content
            if logprobs:
                part.setdefault("logprobs", []).extend(logprobs)
            events.append(
                self._event(
                    "response.output_text.delta",
                    **self._at(),
                    content_index=0,
                    delta=reply.content,
                    logprobs=logprobs or [],
                )
            )
        for piece in reply.calls:
            if piece.call_id is not None:
                events += self._close_item()
                item = function_call_item(piece.call_id, piece.name or "", "", status="in_progress")
                events += self._add_item(item)
            self._items[-1]["arguments"] += piece.arguments
            if piece.arguments:
                events.append(
                    self._event("response.function_call_arguments.delta", **self._at(), delta=piece.arguments)
                )
        return events

    def _at(self) -> dict[str, Any]:
        return {"item_id": self._items[-1]["id"], "output_index": len(self._items) - 1}

    def _open_item(self, kind: str) -> list[str]:
        if self._open and self._items[-1]["type"] == kind:
            return []
        events = self._close_item()
        if kind == "reasoning":
            return events + self._add_item(reasoning_item(""))
        item = message_item("", status="in_progress")
        events += self._add_item(item)
        item["content"] = [output_text_part("")]
        part = item["content"][0]
        return events + [self._event("response.content_part.added", **self._at(), content_index=0, part=part)]

    def _add_item(self, item: dict[str, Any]) -> list[str]:
        self._items.append(item)
        self._open = True
        return [self._event("response.output_item.added", output_index=len(self._items) - 1, item=item)]

    def _close_item(self) -> list[str]:
        if not self._open:
            return []
        self._open = False
        item, at = self._items[-1], self._at()
        events = []
        if item["type"] == "message":
            text = item["content"][0]["text"]
            logprobs = item["content"][0].get("logprobs", [])
            events.append(self._event("response.output_text.done", **at, content_index=0, text=text, logprobs=logprobs))
            events.append(self._event("response.content_part.done", **at, content_index=0, part=item["content"][0]))
        elif item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", **at, arguments=item["arguments"]))
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(self._event("response.reasoning_text.done", **at, content_index=0, text=text))
        if "status" in item:  # messages and calls have one; reasoning items none
            item["status"] = "completed"
        events.append(self._event("response.output_item.done", output_index=at["output_index"], item=item))
        return events


def _delta_body(reply: ReplyDelta) -> dict[str, Any]:
    """A chunk's `delta`: the content, the pieces of calls when there are some, and thinking
    (`reasoning`, vLLM's field) where a reasoning parser found some."""
    delta: dict[str, Any] = {"content": reply.content}
    if reply.calls:
        delta["tool_calls"] = [piece.body() for piece in reply.calls]
        delta["content"] = reply.content or None
    if reply.reasoning:
        delta["reasoning"] = reply.reasoning
        if not reply.content:
            del delta["content"]  # vLLM's thinking deltas carry no content
    return delta
