"""The thread bridge for servers: `AsyncEngine` runs Engine.step in a background thread.

`submit` queues a request at once (so bad input and a full queue raise before any response
starts) and returns its RequestStream, whose `outputs` is an async iterator of RequestOutputs;
leaving it early (a client that disconnects) cancels the request, which frees its cache at the
start of the next step. Anything else that must touch the engine's state (stats, flushing the
prefix cache) runs on the step thread between two steps (`between_steps`).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from typing import AsyncIterator, Callable

from sala.engine.engine import Engine
from sala.engine.request import Request, RequestOutput
from sala.sampling import SamplingParams

log = logging.getLogger(__name__)


class AsyncEngine:
    """Engine.step in a background thread. `submit` queues a request at once (so bad input and a
    full queue raise before any response starts); its RequestStream yields the outputs."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.wakeup = threading.Event()
        self.stopping = False
        self.streams: dict[str, RequestStream] = {}
        self.calls: deque[tuple[Callable, asyncio.Future]] = deque()
        self.thread = threading.Thread(target=self._loop, name="sala-engine", daemon=True)
        self.thread.start()

    def between_steps(self, fn: Callable):
        """Await fn() run on the step thread between two steps, where the cache is not in use."""
        future = asyncio.get_running_loop().create_future()
        self.calls.append((fn, future))
        self.wakeup.set()
        return future

    def _loop(self) -> None:
        while not self.stopping:
            while self.calls:
                fn, future = self.calls.popleft()
                try:
                    result, error = fn(), None
                except Exception as e:
                    result, error = None, e
                future.get_loop().call_soon_threadsafe(_settle, future, result, error)
            if not self.engine.has_work():
                self.wakeup.wait()
                self.wakeup.clear()
                continue
            try:
                self.engine.step()
            except Exception as e:  # a bug or OOM must not leave every client waiting forever
                log.exception("engine step failed; failing all requests")
                for r in self.engine.fail_all():
                    if stream := self.streams.get(r.request_id):
                        stream.push(e)

    async def prepare(self, params: SamplingParams) -> None:
        """Compile the request's structured-output constraint, if any, without blocking the event
        loop or the step thread (a cached one returns at once): call before `submit`, which then
        finds it compiled. Raises InvalidParam for a constraint that is invalid or too slow to compile."""
        if params.structured_outputs is None:
            return
        params.validate(self.engine.model.config.vocab_size)
        grammars = await asyncio.to_thread(lambda: self.engine.grammars)  # the first reads the whole vocabulary
        future = asyncio.wrap_future(grammars.compiling(params.structured_outputs))
        try:
            await asyncio.wait_for(asyncio.shield(future), grammars.timeout_s)
        except asyncio.TimeoutError:
            raise grammars.too_slow(params.structured_outputs) from None

    def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> RequestStream:
        """Call from the event loop that will read the stream."""
        stream = RequestStream(self, asyncio.get_running_loop())
        stream.request = self.engine.add_request(prompt, params, stream.push, request_id)
        self.streams[stream.request.request_id] = stream
        self.wakeup.set()
        return stream

    def abort(self, request_id: str) -> bool:
        """Cancel a request by id, as SGLang's /abort_request: its stream still gets the final
        "cancelled" output, so its client sees the request end. False if no such request runs, or
        it is already being cancelled (an abort takes effect at the start of the next step)."""
        stream = self.streams.get(request_id)
        if stream is None or stream.finished or stream.request.cancelled:
            return False
        self.engine.cancel(stream.request)
        self.wakeup.set()
        return True

    def running(self) -> list[str]:
        """Ids of the requests running now, less those already being cancelled."""
        return [i for i, s in self.streams.items() if not (s.finished or s.request.cancelled)]

    def stats(self):
        """Await Engine.stats() taken between two steps."""
        return self.between_steps(self.engine.stats)

    @property
    def alive(self) -> bool:
        """Whether the step thread runs (False once closed, or if it died)."""
        return self.thread.is_alive()

    def close(self) -> None:
        self.stopping = True
        self.wakeup.set()
        self.thread.join(timeout=10)


def _settle(future: asyncio.Future, result, error: Exception | None) -> None:
    if not future.done():  # its awaiter may have gone
        future.set_exception(error) if error is not None else future.set_result(result)


class RequestStream:
    """One request's outputs, handed from the step thread to an event loop."""

    def __init__(self, owner: AsyncEngine, loop: asyncio.AbstractEventLoop):
        self.owner, self.loop = owner, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request: Request | None = None
        self.finished = False

    def push(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Outputs until the request finishes; leaving early cancels it and frees its cache."""
        try:
            while not self.finished:
                out = await self.queue.get()
                if isinstance(out, BaseException):
                    raise RuntimeError(f"engine failure: {out}") from out
                self.finished = out.finished
                yield out
        finally:
            self.cancel()

    def cancel(self) -> None:
        self.owner.streams.pop(self.request.request_id, None)
        if not self.finished:
            self.finished = True
            self.owner.engine.cancel(self.request)
            self.owner.wakeup.set()
