"""One thread owns the engine; every connection talks to it through a thread-safe inbox.

The engine is not thread-safe, so only the loop thread ever touches it. Handlers put
commands (add, abort, call) in the inbox; the loop drains the inbox between steps, so
requests join and leave between steps (continuous batching: the engine's scheduler batches
whatever is running, with speculation). While work exists the loop steps; when idle it
sleeps on the inbox. Each request's events go back through the `deliver` callable the
handler gave (it hops onto the handler's event loop with `call_soon_threadsafe`).

Nothing a request does may stop the loop: an error from `add_request` rejects that request
only (a 400); an error inside `step()` fails the requests that were running (a 500; the
state of every request in a step that raised is unknown, so none of them is kept) and the
loop goes on with the rest.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from quickdraft.engine.compute_thread import ComputeThread
from quickdraft.engine.engine import Engine
from quickdraft.engine.parallel_sampling import child_params, child_request_ids, children_seed
from quickdraft.engine.request import RequestStatus
from quickdraft.kv.cache import CacheFullError
from quickdraft.models.lora import LoRARequest
from quickdraft.outputs import RequestOutput, StreamDelta, TokenLogprobs
from quickdraft.sampling_params import SamplingParams
from quickdraft.server.metrics import FinishedRequest, ServerMetrics

logger = logging.getLogger("quickdraft.server")


# ---- events sent back to a handler -----------------------------------------------------
@dataclass
class Admitted:
    """The engine took the request (it is waiting for or holding a cache slot)."""


@dataclass
class Rejected:
    """`add_request` refused the request (bad prompt, too long): a 400 for it alone."""

    message: str
    param: str | None = None  # the sampling parameter at fault; None: the prompt


@dataclass
class Progress:
    """What one step added to one completion of the request; its last has `finished` and the
    completion's full `output` (a request of n completions gets each one's, `index` 0..n-1)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None  # one per token in token_ids, when the request asked
    finished: bool
    finish_reason: str | None
    output: RequestOutput | None
    index: int = 0
    # On a completion's first event, where the request asked for them: its prompt's logprobs
    # (RequestOutput.prompt_logprobs), for an echoed prompt streamed before the completion
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class Failed:
    """The request was admitted but could not finish (engine error, shutdown)."""

    status: int
    message: str
    code: str
    param: str | None = None  # the request field at fault, where one is


LoopEvent = Admitted | Rejected | Progress | Failed

# What requests still held when the loop stops are told, unless the stopper says otherwise.
SHUTTING_DOWN = Failed(status=503, message="the server is shutting down", code="shutting_down")


@dataclass(frozen=True)
class RequestOptions:
    """What a request asks of the engine beside its prompts and sampling (Engine.add_request's)."""

    priority: int = 0  # vLLM's: lower first, under the "priority" scheduling policy
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks shared only under the same salt
    lora_request: LoRARequest | None = None  # the adapter the request's "model" names


@dataclass
class Submission:
    request_id: str
    prompts: list[list[int]]  # token ids: one prompt, or a batch (each gets params.n completions)
    params: SamplingParams
    scenario: str
    submitted_at: float  # time.perf_counter() in the handler
    deliver: Callable[[LoopEvent], None]  # thread-safe: called from the loop thread
    options: RequestOptions = field(default_factory=RequestOptions)


@dataclass
class LoopStats:
    """A snapshot the loop publishes after every iteration (read by /health and tests)."""

    running: int = 0
    waiting: int = 0
    free_slots: int = 0
    num_slots: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks held by requests (the fullest layer group)
    tracked_requests: int = 0  # requests the loop still holds for a handler
    steps: int = 0
    failed_steps: int = 0
    alive: bool = False


class LoopStopped(RuntimeError):
    """The loop no longer takes requests (the server is shutting down)."""


# ---- commands in the inbox -------------------------------------------------------------
@dataclass
class _Add:
    submission: Submission


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    function: Callable[[Engine], Any]
    # CacheFullError while requests generate: run it again after the next step (it waits for the
    # slot or blocks they hold, as a queued request does)
    wait_for_cache: bool = False
    # run once no request is left in the engine; submissions arriving meanwhile wait for it
    # (a weight update must not mix two models' keys in one request)
    when_idle: bool = False
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Stop:
    failure: Failed  # what every request still held is told


@dataclass
class _Tracked:
    """One engine request of a submission (its only one, or completion `index` of its n)."""

    submission: Submission
    index: int = 0
    num_sent_tokens: int = 0  # tokens (and their logprobs) already delivered
    started: bool = False  # its first event went out


class EngineLoop:
    def __init__(self, *, engine: Engine, metrics: ServerMetrics, compute: ComputeThread | None = None):
        self._engine = engine
        self._metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine request id -> its submission
        # submission id -> its engine requests (the submission's own id, or n children's)
        self._children: dict[str, list[str]] = {}
        # The loop runs on `compute`, the thread that loaded the engine (engine/compute_thread.py
        # says why), or on a thread of its own.
        self._owns_compute = compute is None
        self._compute = compute
        self._running: concurrent.futures.Future | None = None
        self._calls_waiting_for_cache: list[_Call] = []
        self._calls_waiting_for_idle: list[_Call] = []
        self._held: list[_Add] = []  # submissions that came while a call waits for the engine to drain
        self._accepting = True
        self._accept_lock = threading.Lock()  # orders "stop" against late submissions
        self._steps = 0
        self._failed_steps = 0
        self.stats = LoopStats()

    # ---- the handlers' side (any thread) ---------------------------------------------
    def start(self) -> None:
        self._publish_stats()
        if self._compute is None:
            self._compute = ComputeThread(name="quickdraft-engine-loop")
        self._running = self._compute.submit(self._run)

    def submit(self, submission: Submission) -> None:
        self._put(_Add(submission))

    def abort(self, request_id: str) -> None:
        """Abort a request and free its slot (no event is delivered for it any more)."""
        try:
            self._put(_Abort(request_id))
        except LoopStopped:
            pass  # the stopping loop aborts every request it still holds

    def call(
        self, function: Callable[[Engine], Any], *, wait_for_cache: bool = False, when_idle: bool = False
    ) -> concurrent.futures.Future:
        """Run function(engine) on the loop thread between steps (inspection, tests, embeddings);
        `wait_for_cache`: a CacheFullError while requests generate runs it again after later steps;
        `when_idle`: once the running requests have finished, new ones held back until it has run."""
        command = _Call(function, wait_for_cache=wait_for_cache, when_idle=when_idle)
        self._put(command)
        return command.future

    def stop(self, *, timeout: float | None = None, failure: Failed | None = None) -> None:
        """Abort every request still held (each gets `failure`, by default a 503) and end the thread."""
        with self._accept_lock:
            if self._accepting:
                self._accepting = False
                self._inbox.put(_Stop(failure or SHUTTING_DOWN))
        if self._running is None or self._compute is None or threading.current_thread() is self._compute.thread:
            return
        try:
            self._running.result(timeout)
        except concurrent.futures.TimeoutError:
            return  # still stopping: not this loop's compute thread to end yet
        if self._owns_compute:
            self._compute.close()

    @property
    def is_alive(self) -> bool:
        return self._running is not None and not self._running.done()

    def _put(self, command) -> None:
        with self._accept_lock:
            if not self._accepting:
                raise LoopStopped("the server is shutting down")
            self._inbox.put(command)

    # ---- the loop thread -------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if self._handle_commands(block=not self._engine.has_unfinished_requests()):
                    return
                if self._engine.has_unfinished_requests():
                    self._step()
                # after a step, or an abort, freed what they wait for (with nothing generating they end)
                self._retry_calls_waiting_for_cache()
                # before the loop blocks on its inbox: the step may have finished the last request
                self._run_calls_waiting_for_idle()
                self._publish_stats()
            except Exception:  # a bug in the loop itself must not end the service
                logger.exception("engine loop iteration failed; continuing")
                time.sleep(0.01)

    def _handle_commands(self, *, block: bool) -> bool:
        """Run the inbox's commands; True when the loop must stop."""
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for position, command in enumerate(commands):
            if isinstance(command, _Stop):
                self._shutdown(failure=command.failure, leftover=commands[position + 1 :])
                return True
            self._handle(command)
        return False

    def _handle(self, command) -> None:
        if isinstance(command, _Add):
            if self._calls_waiting_for_idle:
                self._held.append(command)
            else:
                self._add(command.submission)
        elif isinstance(command, _Abort):
            self._held = [held for held in self._held if held.submission.request_id != command.request_id]
            self._abort_submission(command.request_id, notify=None)
        elif isinstance(command, _Call) and command.when_idle:
            self._calls_waiting_for_idle.append(command)
        elif isinstance(command, _Call):
            self._call(command)

    def _run_calls_waiting_for_idle(self) -> None:
        """Once the engine has drained, the calls that waited for it, then the held submissions."""
        if not self._calls_waiting_for_idle or self._engine.has_unfinished_requests():
            return
        calls, self._calls_waiting_for_idle = self._calls_waiting_for_idle, []
        for command in calls:
            self._call(command)
        held, self._held = self._held, []
        for command in held:
            self._handle(command)

    def _add(self, submission: Submission) -> None:
        """The submission's engine requests: params.num_samples children of each prompt (n, or
        best_of), child k sample k % num_samples of prompt k // num_samples
        (engine/parallel_sampling.py); one when that is all."""
        params, prompts = submission.params, submission.prompts
        seed = children_seed(params, draw_seed=self._engine.draw_seed)
        request_ids = child_request_ids(submission.request_id, len(prompts) * params.num_samples)
        each = child_params(  # each choice streams its echo
            params, seed=seed, prompt_logprobs_for_all=True, logprobs_mode=self._engine.config.logprobs_mode
        )
        children = [(prompt, child) for prompt in prompts for child in each]
        try:
            for request_id, (prompt, child) in zip(request_ids, children):
                self._engine.add_request(
                    prompt_token_ids=prompt,
                    params=child,
                    request_id=request_id,
                    priority=submission.options.priority,
                    cache_salt=submission.options.cache_salt,
                    lora_request=submission.options.lora_request,
                )
        except Exception as err:
            for request_id in request_ids:  # the children added before the failure (unknown ids are ignored)
                self._engine.abort_request(request_id)
                self._engine.release(request_id)
            if isinstance(err, (ValueError, TypeError)):
                _deliver(submission, Rejected(message=str(err), param=getattr(err, "param", None)))
            else:  # not the request's fault: say so with a 500
                logger.exception("add_request failed")
                message = f"could not queue the request: {err}"
                _deliver(submission, Failed(status=500, message=message, code="engine_error"))
            return
        for index, request_id in enumerate(request_ids):
            self._tracked[request_id] = _Tracked(submission, index=index)
        self._children[submission.request_id] = request_ids
        _deliver(submission, Admitted())

    def _call(self, command: _Call) -> None:
        if command.future.set_running_or_notify_cancel():
            self._run_call(command)

    def _run_call(self, command: _Call) -> None:
        try:
            command.future.set_result(command.function(self._engine))
        except CacheFullError as err:
            if command.wait_for_cache and self._engine.has_unfinished_requests():
                self._calls_waiting_for_cache.append(command)
            else:
                command.future.set_exception(err)
        except Exception as err:
            command.future.set_exception(err)

    def _retry_calls_waiting_for_cache(self) -> None:
        waiting, self._calls_waiting_for_cache = self._calls_waiting_for_cache, []
        for command in waiting:
            self._run_call(command)

    def _step(self) -> None:
        try:
            deltas = self._engine.step()
        except Exception as err:
            self._fail_running(err)
            return
        self._steps += 1
        if deltas:
            self._metrics.record_step(batch_size=len(deltas))
        for delta in deltas:
            self._dispatch(delta)

    def _dispatch(self, delta: StreamDelta) -> None:
        tracked = self._tracked.get(delta.request_id)
        if tracked is None:  # not a request of ours; never leave it behind
            if delta.finished:
                self._engine.release(delta.request_id)
            return
        if not (delta.text or delta.token_ids or delta.finished):
            return  # a prefill chunk that produced nothing yet
        if delta.finish_reason == "error":  # its logits processors failed: the request fails, alone
            error = self._engine.get_request(delta.request_id).error
            failure = Failed(
                status=400,
                message=str(error),
                code="logits_processor_error",
                param=getattr(error, "param", None),
            )
            self._abort_submission(tracked.submission.request_id, notify=failure, finish_reason="error")
            return
        logprobs = self._new_logprobs(delta.request_id, tracked, num_new=len(delta.token_ids))
        tracked.num_sent_tokens += len(delta.token_ids)
        prompt_logprobs = None
        if not tracked.started:
            tracked.started = True
            prompt_logprobs = self._engine.get_request(delta.request_id).prompt_logprobs
        if delta.finished:
            self._forget(delta.request_id, finish_reason=delta.finish_reason or "stop", metrics=delta.output.metrics)
        _deliver(
            tracked.submission,
            Progress(
                text=delta.text,
                token_ids=list(delta.token_ids),
                logprobs=logprobs,
                finished=delta.finished,
                finish_reason=delta.finish_reason,
                output=delta.output,
                index=tracked.index,
                prompt_logprobs=None if prompt_logprobs is None else list(prompt_logprobs),
            ),
        )

    def _new_logprobs(self, request_id: str, tracked: _Tracked, *, num_new: int) -> list[TokenLogprobs] | None:
        if tracked.submission.params.logprobs is None:
            return None
        request = self._engine.get_request(request_id)
        return list(request.logprobs[tracked.num_sent_tokens : tracked.num_sent_tokens + num_new])

    def _abort_submission(self, submission_id: str, *, notify: Failed | None, finish_reason: str = "abort") -> None:
        """Abort every engine request of a submission still running; tell its handler once."""
        request_ids = self._children.get(submission_id, [])
        submission = next((self._tracked[i].submission for i in request_ids if i in self._tracked), None)
        for request_id in request_ids:
            self._abort(request_id, finish_reason=finish_reason)
        if notify is not None and submission is not None:
            _deliver(submission, notify)

    def _abort(self, request_id: str, *, finish_reason: str) -> None:
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return  # finished (and released) before the abort arrived
        try:
            request = self._engine.get_request(request_id)
            metrics = request.metrics
            self._engine.abort_request(request_id)
        except Exception:  # after a failed step the request's state may be inconsistent
            logger.exception("aborting request %s failed", request_id)
            metrics = None
        self._forget(request_id, finish_reason=finish_reason, metrics=metrics)

    def _forget(self, request_id: str, *, finish_reason: str, metrics) -> None:
        """The engine request left the engine: count it, release it, stop tracking it (and its
        submission once none of its requests is left)."""
        tracked = self._tracked.pop(request_id)
        self._engine.release(request_id)
        submission_id = tracked.submission.request_id
        if not any(i in self._tracked for i in self._children.get(submission_id, [])):
            self._children.pop(submission_id, None)
        if metrics is not None:
            self._metrics.record_request(
                FinishedRequest(
                    scenario=tracked.submission.scenario,
                    submitted_at=tracked.submission.submitted_at,
                    finish_reason=finish_reason,
                    metrics=metrics,
                )
            )

    def _fail_running(self, err: Exception) -> None:
        """step() raised: fail the requests that were in it, keep the waiting ones."""
        logger.error("engine step failed: %s", err, exc_info=err)
        self._failed_steps += 1
        self._metrics.record_failed_step()
        failure = Failed(
            status=500, message=f"generation failed inside the engine: {type(err).__name__}: {err}", code="engine_error"
        )
        for submission_id, request_ids in list(self._children.items()):
            # One completion lost fails the whole request (its answer would be incomplete).
            if any(self._was_running(i) for i in request_ids if i in self._tracked):
                self._abort_submission(submission_id, notify=failure, finish_reason="error")

    def _was_running(self, request_id: str) -> bool:
        try:
            return self._engine.get_request(request_id).status == RequestStatus.RUNNING
        except KeyError:  # gone from the engine: it cannot be kept either
            return True

    def _shutdown(self, *, failure: Failed, leftover: list) -> None:
        for command in leftover:
            if isinstance(command, _Add):
                _deliver(command.submission, failure)
            elif isinstance(command, _Call):
                command.future.cancel()
        for waiting in self._calls_waiting_for_cache:  # running futures: they cannot be cancelled
            waiting.future.set_exception(LoopStopped("the server is shutting down"))
        self._calls_waiting_for_cache = []
        for waiting_call in self._calls_waiting_for_idle:
            waiting_call.future.cancel()
        for held in self._held:
            _deliver(held.submission, failure)
        self._calls_waiting_for_idle, self._held = [], []
        for submission_id in list(self._children):
            self._abort_submission(submission_id, notify=failure)
        self._publish_stats(alive=False)

    def _publish_stats(self, *, alive: bool = True) -> None:
        scheduler, cache = self._engine.scheduler, self._engine.cache
        self.stats = LoopStats(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            free_slots=cache.num_free_slots,
            num_slots=cache.num_slots,
            kv_cache_usage=cache.usage,
            tracked_requests=len(self._children),
            steps=self._steps,
            failed_steps=self._failed_steps,
            alive=alive,
        )
        self._metrics.set_load(
            running=self.stats.running,
            waiting=self.stats.waiting,
            free_slots=self.stats.free_slots,
            kv_cache_usage=self.stats.kv_cache_usage,
        )
        if self._engine.loras is not None:
            self._metrics.set_loras(
                max_loras=self._engine.config.max_loras,
                running=_adapter_names(scheduler.running),
                waiting=_adapter_names(scheduler.waiting),
            )


def _adapter_names(requests) -> list[str]:
    """The distinct LoRA adapters of `requests`, by name, in order."""
    return sorted({request.lora.name for request in requests if request.lora is not None})


def _deliver(submission: Submission, event: LoopEvent) -> None:
    try:
        submission.deliver(event)
    except Exception:  # the handler's event loop is gone (server stopping): nothing to tell
        logger.debug("could not deliver %s for %s", type(event).__name__, submission.request_id)
