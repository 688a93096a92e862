"""The engine loop for a server: steps run in a worker thread, never on the event loop.

Handlers never touch the engine while a step runs: a request is tokenized and checked by the
input processor in its own thread (it changes nothing), then new requests and aborts are queued
and applied between steps by the loop task, and each request's outputs come back through its own
asyncio queue. A stream that ends early (client cancel, deadline) aborts its request, which
frees its blocks before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from coordinator import request_log
from coordinator.engine import LLMEngine
from coordinator.outputs import RequestOutput
from coordinator.sampling_params import SamplingParams


# Grammars compiling at once: llguidance compiles without the GIL, so two big schemas compile side
# by side while the input thread goes on tokenizing other requests.
GRAMMAR_THREADS = 2


class QueueFullError(RuntimeError):
    pass


class DeadlineExceededError(RuntimeError):
    """The request's deadline passed: it was aborted and its blocks freed."""


class RequestFailedError(RuntimeError):
    """The engine ended this request with an error (a poison request); the others go on."""


class EngineDeadError(RuntimeError):
    """The engine loop failed: raised to every request it held, and to every new one."""

    def __init__(self, message: str, request_id: str, cause: BaseException, in_flight: bool):
        super().__init__(message)
        self.request_id = request_id
        self.cause = cause
        self.in_flight = in_flight  # False: refused before it was queued


class AsyncEngine:
    def __init__(self, llm_engine: LLMEngine, max_queued_requests: int = 1024):
        self.llm_engine = llm_engine
        self.max_queued_requests = max_queued_requests
        self._adds: list[tuple[str, list[int], SamplingParams, int, bool]] = []
        self._aborts: list[str] = []
        self._streams: dict[str, asyncio.Queue] = {}
        self._wakeup = asyncio.Event()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._input_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-input")
        self._grammar_threads = ThreadPoolExecutor(max_workers=GRAMMAR_THREADS, thread_name_prefix="grammar")
        self._ids = itertools.count()
        self._num_checking = 0  # requests being tokenized and checked: they count as queued
        self._num_waiting = 0  # the scheduler's waiting requests, as of the last step
        self._abort_reasons: dict[str, str] = {}  # of aborts that are not a client's cancel
        self._task: asyncio.Task | None = None
        self.error: BaseException | None = None
        self._restart_listeners: list = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run())
        self.llm_engine.recovery_listeners.append(
            lambda restarting: loop.call_soon_threadsafe(self._set_restarting, restarting))

    def add_restart_listener(self, listener) -> None:
        """`await listener(restarting)` when a worker-group rebuild starts (True) and ends (False)."""
        self._restart_listeners.append(listener)

    def _set_restarting(self, restarting: bool) -> None:
        for listener in self._restart_listeners:
            asyncio.get_running_loop().create_task(listener(restarting))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:
                pass  # the loop had failed: self.error holds it, every stream was told
        self._thread.shutdown(wait=True)
        self._input_thread.shutdown(wait=True)
        self._grammar_threads.shutdown(wait=True)

    @property
    def num_queued(self) -> int:
        return self._num_checking + len(self._adds) + self._num_waiting

    async def drain(self, timeout: float) -> int:
        """Let the requests in flight finish for up to `timeout` seconds (new ones are the front
        door's to refuse), then end the rest with EngineDeadError (not in flight: UNAVAILABLE).
        Returns how many were ended unfinished."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._streams and loop.time() < deadline and self.error is None:
            await asyncio.sleep(0.05)
        ended = list(self._streams.items())
        for request_id, queue in ended:
            queue.put_nowait(EngineDeadError("the server is shutting down and its drain time passed",
                                             request_id, RuntimeError("drained"), in_flight=False))
        return len(ended)

    async def wait_stopped(self) -> BaseException | None:
        """Wait until the engine loop ends (stop() or a failure); returns the failure, if any."""
        if self._task is not None:
            await asyncio.wait({self._task})
            if not self._task.cancelled():
                self._task.exception()  # retrieved here: the failure is self.error
        return self.error

    async def generate(self, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams,
                       request_id: str = "", priority: int = 0, messages: list[dict] | None = None,
                       timeout: float | None = None, chat_options: dict | None = None,
                       max_tokens_field: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; `messages` (a chat) instead of a prompt renders the model's
        chat template (`chat_options`: InputProcessor.chat_prompt_ids' keyword arguments;
        `max_tokens_field`: InputProcessor.process').
        ValueError for bad input and QueueFullError come before any output, with nothing queued.
        Past `timeout` seconds in any state (queued, prefilling, decoding, swapped) the request is
        aborted (finish reason "deadline") and DeadlineExceededError raised."""
        expires = None if timeout is None else asyncio.get_running_loop().time() + timeout
        self.check_accepting(request_id)
        self._num_checking += 1
        try:
            token_ids = await self.check_input(prompt, prompt_token_ids, params, priority, messages, chat_options,
                                               max_tokens_field)
        finally:
            self._num_checking -= 1
        # aclosing: a consumer that stops reading closes the inner stream now (its abort), not at GC.
        async with contextlib.aclosing(self.generate_checked(token_ids, params, request_id, priority, expires,
                                                             prompt, timeout)) as outputs:
            async for out in outputs:
                yield out

    def check_accepting(self, request_id: str = "") -> None:
        """EngineDeadError, ValueError (the id is taken) or QueueFullError when a new request would
        be refused now."""
        if self.error is not None:
            raise EngineDeadError(f"the engine has stopped after a failure: {self.error!r}", request_id,
                                  self.error, in_flight=False)
        if request_id and request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if self.num_queued >= self.max_queued_requests:
            raise QueueFullError(f"the queue is full ({self.max_queued_requests} requests waiting)")

    async def check_input(self, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams,
                          priority: int = 0, messages: list[dict] | None = None,
                          chat_options: dict | None = None, max_tokens_field: str | None = None) -> list[int]:
        """The prompt's token ids once every check passed (ValueError naming the field otherwise):
        tokenizing in the input thread, a structured output's grammar in the grammar pool, so
        that a schema that takes a second to compile never holds up other requests' tokenizing."""
        loop = asyncio.get_running_loop()
        processor = self.llm_engine.input_processor
        token_ids = await loop.run_in_executor(
            self._input_thread, processor.process, prompt, prompt_token_ids, params, priority, messages,
            chat_options, False, max_tokens_field)
        if params.structured_outputs is not None:
            await loop.run_in_executor(self._grammar_threads, processor.grammars.compile, params.structured_outputs)
        return token_ids

    async def generate_checked(self, token_ids: list[int], params: SamplingParams, request_id: str = "",
                               priority: int = 0, expires: float | None = None,
                               prompt: str | None = None, timeout: float | None = None,
                               publish_kv: bool = False) -> AsyncIterator[RequestOutput]:
        """`generate` for a request `check_input` passed: queued at once. `expires`: the loop's
        time past which it is aborted (its deadline of `timeout` seconds). `publish_kv`: a
        prefill replica's prefill-only request (LLMEngine.add_processed_request)."""
        if self.error is not None or (self._task is not None and self._task.done()):
            raise EngineDeadError(f"the engine has stopped: {self.error!r}", request_id, self.error,
                                  in_flight=False)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:  # taken while this one was tokenized
            raise ValueError(f"request_id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        self._adds.append((request_id, token_ids, params, priority, publish_kv))
        self._wakeup.set()
        finished, out, logged = False, None, request_log.enabled()
        if logged:
            shown = prompt if prompt is not None else self.llm_engine.tokenizer.decode(token_ids)  # a chat's, rendered
            request_log.received(request_id, shown, token_ids, params)
            started = time.monotonic()
        try:
            while not finished:
                if expires is None:
                    out = await queue.get()
                else:
                    try:
                        out = await asyncio.wait_for(queue.get(), expires - asyncio.get_running_loop().time())
                    except TimeoutError:
                        self._abort_reasons[request_id] = "deadline"
                        raise DeadlineExceededError(f"request {request_id!r} passed its deadline "
                                                    f"({timeout:g} s)") from None
                if isinstance(out, EngineDeadError):
                    raise out  # drained: refused as the server stops
                if isinstance(out, BaseException):
                    raise EngineDeadError(f"the engine failed while serving request {request_id!r}: {out!r}",
                                          request_id, out, in_flight=True)
                finished = out.finished
                if out.error is not None:
                    raise RequestFailedError(out.error)
                out.prompt = prompt
                yield out
        finally:
            if not finished:  # cancelled, deadline, or the consumer stopped reading
                self._streams.pop(request_id, None)
                self._aborts.append(request_id)
                self._wakeup.set()
            if logged:
                how = ", ".join(sorted({c.finish_reason or "" for c in out.outputs})) if finished else \
                    self._abort_reasons.get(request_id, "aborted")
                generated = sum(len(c.token_ids) for c in out.outputs) if isinstance(out, RequestOutput) else 0
                request_log.ended(request_id, how, generated, time.monotonic() - started)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._apply_pending()
                if not self.llm_engine.has_unfinished_requests():
                    self._wakeup.clear()
                    if not (self._adds or self._aborts):
                        await self._wakeup.wait()
                    continue
                outputs = await loop.run_in_executor(self._thread, self.llm_engine.step)
                self._count_waiting()
                for out in outputs:
                    queue = self._streams.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                        if out.finished:
                            del self._streams[out.request_id]
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a bug in a step: fail every stream, refuse new ones
            self.error = e
            for queue in self._streams.values():
                queue.put_nowait(e)
            self._streams.clear()
            raise

    def _apply_pending(self) -> None:
        aborts, self._aborts = self._aborts, []
        adds, self._adds = self._adds, []
        if not (adds or aborts):
            return
        aborted = set(aborts)
        engine = self.llm_engine
        for request_id, token_ids, params, priority, publish_kv in adds:
            if request_id in aborted:
                continue  # cancelled before it ever reached the engine
            engine.add_processed_request(request_id, None, token_ids, params, priority, publish_kv)
        for request_id in aborts:
            engine.abort_request(request_id, self._abort_reasons.pop(request_id, "abort"))
        engine.refresh_stats()  # once for the lot: no step runs now
        self._count_waiting()

    def _count_waiting(self) -> None:
        """Taken between steps: a handler reading the scheduler's queue mid-step could see it
        change under it (the step runs on its own thread)."""
        self._num_waiting = self.llm_engine.scheduler.num_waiting_requests

    def replica_engines(self) -> list[tuple[str, LLMEngine]]:
        """(replica label, engine) for the metrics: one replica, "0" (a Router has several)."""
        return [("0", self.llm_engine)]

    async def reset_prefix_cache(self) -> bool:
        """LLMEngine's reset_prefix_cache, run on the step thread so that it falls between steps."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._reset_prefix_cache)

    def _reset_prefix_cache(self) -> bool:
        done = self.llm_engine.scheduler.kv.reset_prefix_cache()
        self.llm_engine.refresh_stats()  # an idle engine takes no step that would show it
        return done

    async def stats(self) -> dict:
        stats = self.llm_engine.stats()
        stats["num_queued"] = self.num_queued
        return stats
