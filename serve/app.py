"""Ray Serve app: the SALA engine behind an OpenAI-compatible and an SGLang-style HTTP API.

    serve run serve/config.yaml                                   # tiny-sala on 127.0.0.1:8000
    python -m serve.app --model models:/sala@champion --port 8000  # the same, from Python

One deployment holds one engine and its FastAPI ingress, so tokens go from the engine's step
thread to the HTTP stream without crossing processes. Endpoints: /v1/models,
/v1/completions, /v1/chat/completions, /generate, /health and /metrics (Prometheus).
With SALA_API_KEY set (or `api_key=`), /v1/* and /generate need `Authorization: Bearer KEY`.
A client that goes away mid-request cancels its engine requests, which frees their cache.
"""
# No `from __future__ import annotations` here: Serve's class-based routes need FastAPI to see
# the real `Request` class in their signatures, not a string.
import argparse
import asyncio
import hmac
import json
import logging
import os
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import ValidationError
from ray import serve

from sala.engine import AsyncEngine, Engine, InvalidParam, QueueFull, RequestOutput, RequestStream, SamplingParams
from serve.protocol import (
    PARAM_NAMES,
    APIError,
    ChatCompletionRequest,
    Choice,
    CompletionRequest,
    GenerateRequest,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    schema_error,
    sglang_finish_reason,
    sglang_logprobs,
    usage,
)

log = logging.getLogger("sala.serve")
api = FastAPI(title="sala", docs_url=None, redoc_url=None)
MAX_N = 16
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """HTTP-side counters and latency histograms, the engine's own totals read at scrape time, and
    the replica process's memory and CPU (process_resident_memory_bytes, ...)."""

    def __init__(self, engine: Engine):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("sala_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("sala_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("sala_inter_token_latency_seconds", "Gap between consecutive tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        r.register(EngineCollector(engine))
        ProcessCollector(registry=r)


class EngineCollector:
    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        e = self.engine
        yield GaugeMetricFamily("sala_queue_depth", "Requests waiting for admission", value=e.scheduler.num_waiting)
        yield GaugeMetricFamily("sala_running_requests", "Requests holding cache", value=len(e.scheduler.running))
        yield CounterMetricFamily("sala_prompt_tokens", "Prompt tokens of accepted requests", value=e.num_prompt_tokens)
        yield CounterMetricFamily("sala_generation_tokens", "Tokens generated", value=e.num_generated_tokens)
        finished = CounterMetricFamily("sala_finished_requests", "Finished requests by reason", labels=["reason"])
        for reason in ("stop", "length", "cancelled"):
            finished.add_metric([reason], e.num_finished[reason])
        yield finished


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


@serve.deployment(max_ongoing_requests=256, health_check_period_s=10, health_check_timeout_s=30)
@serve.ingress(api)
class SalaServer:
    def __init__(self, model: str | None = None, served_model_name: str | None = None, api_key: str | None = None,
                 max_body_bytes: int = 1 << 20, max_tokens_limit: int = 1024, num_threads: int | None = None,
                 engine_kwargs: dict | None = None):
        import torch

        from pipelines.registry import resolve_model_path

        if num_threads:
            torch.set_num_threads(num_threads)
        path = resolve_model_path(model)
        self.engine = AsyncEngine(Engine.from_pretrained(path, **(engine_kwargs or {})))
        self.tokenizer = self.engine.engine.tokenizer
        self.text_of = TokenText(self.tokenizer)
        self.name = served_model_name or ("tiny-sala" if model is None else model if model.startswith("models:/") else Path(model).name)
        self.api_key = api_key or None
        self.max_body_bytes, self.max_tokens_limit = max_body_bytes, max_tokens_limit
        self.max_model_len = self.engine.engine.max_model_len
        self.metrics = Metrics(self.engine.engine)

    def check_health(self) -> None:
        if not self.engine.thread.is_alive():
            raise RuntimeError("engine step thread has stopped")

    # ---- plumbing shared by the endpoints -------------------------------------------------

    async def _handle(self, endpoint: str, request: Request, body_cls, handler: Callable) -> Response:
        try:
            if self.api_key and not hmac.compare_digest(request.headers.get("authorization", ""), f"Bearer {self.api_key}"):
                raise APIError(401, "Incorrect API key provided", code="invalid_api_key")
            body = body_cls.model_validate(await self._json(request)) if body_cls else None
            response = await handler(body)
        except ValidationError as e:
            response = self._error(schema_error(e))
        except InvalidParam as e:
            response = self._error(APIError(400, str(e), param=PARAM_NAMES.get(endpoint, {}).get(e.param, e.param)))
        except QueueFull as e:
            response = self._error(APIError(503, f"server busy: {e}", "server_error", code="queue_full", headers={"Retry-After": "1"}))
        except APIError as e:
            response = self._error(e)
        except Exception:
            log.exception("request to %s failed", endpoint)
            response = self._error(APIError(500, "internal server error", "server_error"))
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    @staticmethod
    def _error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), e.status, headers=e.headers)

    async def _json(self, request: Request):
        too_large = APIError(413, f"request body exceeds {self.max_body_bytes} bytes", code="request_too_large")
        if int(request.headers.get("content-length") or 0) > self.max_body_bytes:
            raise too_large
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise too_large
        try:
            return json.loads(body)
        except ValueError as e:
            raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None

    def _check_model(self, model: str) -> None:
        if model != self.name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.name}`",
                           param="model", code="model_not_found")

    def _max_tokens(self, requested: int | None, default: int | None, prompt_len: int, param: str = "max_tokens") -> int:
        if requested is None:
            return max(1, min(default or self.max_tokens_limit, self.max_tokens_limit, self.max_model_len - prompt_len))
        if isinstance(requested, int) and requested > self.max_tokens_limit:
            raise InvalidParam(param, f"{param}={requested} exceeds this server's limit of {self.max_tokens_limit}")
        return requested

    def _submit(self, prompts: list[str | list[int]], n: int, params_for: Callable[[list[int]], SamplingParams]) -> list[RequestStream]:
        """Queue n requests per prompt (seeded choices get seed + j); all or none."""
        if not 1 <= n <= MAX_N:
            raise InvalidParam("n", f"n must be between 1 and {MAX_N}, got {n}")
        streams: list[RequestStream] = []
        try:
            for prompt in prompts:
                ids = self.engine.engine.encode(prompt)
                params = params_for(ids)
                for j in range(n):
                    seeded = replace(params, seed=params.seed + j) if params.seed is not None else params
                    streams.append(self.engine.submit(ids, seeded))
        except BaseException:
            for s in streams:
                s.cancel()
            raise
        return streams

    async def _merged(self, streams: list[RequestStream], start: float) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) from all streams as they come; records TTFT and inter-token latency."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: RequestStream):
            try:
                async for out in s.outputs():
                    queue.put_nowait((i, out))
            except Exception as e:
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        last = [None] * len(streams)
        unfinished = len(streams)
        try:
            while unfinished:
                i, out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                if out.token_ids:
                    now = time.perf_counter()
                    (self.metrics.ttft if last[i] is None else self.metrics.itl).observe(now - (last[i] or start))
                    last[i] = now
                unfinished -= out.finished
                yield i, out
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                s.cancel()

    def _stream(self, events: AsyncIterator[str]) -> StreamingResponse:
        async def body():
            try:
                async for e in events:
                    yield e
            except Exception as e:  # after the 200 has gone out: report in-band, then end the stream
                log.exception("stream failed")
                yield sse(APIError(500, str(e), "server_error").body())
            yield sse("[DONE]")

        return StreamingResponse(body(), media_type="text/event-stream")

    # ---- endpoints --------------------------------------------------------------------------

    @api.get("/health")
    async def health(self) -> Response:
        alive = self.engine.thread.is_alive()
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, 200 if alive else 503)

    @api.get("/metrics")
    async def prometheus(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        async def handler(_):
            return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model", "created": 0,
                                                             "owned_by": "sala", "max_model_len": self.max_model_len}]})

        return await self._handle("models", request, None, handler)

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._handle("completions", request, CompletionRequest, self._completions)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle("chat", request, ChatCompletionRequest, self._chat)

    @api.post("/generate")
    async def generate(self, request: Request) -> Response:
        return await self._handle("generate", request, GenerateRequest, self._generate)

    async def _completions(self, body: CompletionRequest) -> Response:
        start = time.perf_counter()
        self._check_model(body.model)
        prompts = body.prompts()
        streams = self._submit(prompts, body.n, lambda ids: body.sampling(self._max_tokens(body.max_tokens, 16, len(ids)), body.logprobs))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.name}
        choices = [Choice(i) for i in range(len(streams))]
        prompt_tokens = sum(s.num_prompt_tokens for s in streams)
        if body.stream:
            async def events():
                for_usage = body.stream_options and body.stream_options.include_usage
                async for i, out in self._merged(streams, start):
                    offset = len(choices[i].text)
                    choices[i].add(out)
                    lp = completion_logprobs(self.text_of, out.logprobs, offset) if body.logprobs is not None else None
                    yield sse({**head, "choices": [{"index": i, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason}]})
                if for_usage:
                    yield sse({**head, "choices": [], "usage": usage(choices, prompt_tokens)})

            return self._stream(events())
        async for i, out in self._merged(streams, start):
            choices[i].add(out)
        return JSONResponse({**head, "choices": [
            {"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
             "logprobs": completion_logprobs(self.text_of, c.logprobs, 0) if body.logprobs is not None else None}
            for c in choices], "usage": usage(choices, prompt_tokens)})

    async def _chat(self, body: ChatCompletionRequest) -> Response:
        start = time.perf_counter()
        self._check_model(body.model)
        top = body.top_k_logprobs()
        text = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages],
                                                  tokenize=False, add_generation_prompt=True)
        requested, param = (body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens is not None \
            else (body.max_tokens, "max_tokens")
        streams = self._submit([text], body.n, lambda ids: body.sampling(self._max_tokens(requested, None, len(ids), param), top))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "chat.completion", "created": created, "model": self.name}
        choices = [Choice(i) for i in range(len(streams))]
        prompt_tokens = streams[0].num_prompt_tokens
        if body.stream:
            async def events():
                chunk = {**head, "object": "chat.completion.chunk"}
                for i in range(len(choices)):
                    yield sse({**chunk, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]})
                async for i, out in self._merged(streams, start):
                    choices[i].add(out)
                    lp = chat_logprobs(self.text_of, out.logprobs) if top is not None else None
                    delta = {"content": out.text} if out.text or not out.finished else {}
                    yield sse({**chunk, "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": out.finish_reason}]})
                if body.stream_options and body.stream_options.include_usage:
                    yield sse({**chunk, "choices": [], "usage": usage(choices, prompt_tokens)})

            return self._stream(events())
        async for i, out in self._merged(streams, start):
            choices[i].add(out)
        return JSONResponse({**head, "choices": [
            {"index": c.index, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
             "logprobs": chat_logprobs(self.text_of, c.logprobs) if top is not None else None}
            for c in choices], "usage": usage(choices, prompt_tokens)})

    async def _generate(self, body: GenerateRequest) -> Response:
        start = time.perf_counter()
        prompts = body.prompts()
        params = body.sampling()
        if params.max_tokens > self.max_tokens_limit:
            raise InvalidParam("max_tokens", f"max_new_tokens={params.max_tokens} exceeds this server's limit of {self.max_tokens_limit}")
        streams = self._submit(prompts, body.sampling_params.n, lambda ids: params)
        choices = [Choice(i) for i in range(len(streams))]
        single = len(streams) == 1

        def result(c: Choice) -> dict:
            s = streams[c.index]
            meta = {"id": s.request.request_id, "finish_reason": sglang_finish_reason(c), "prompt_tokens": c.num_prompt_tokens,
                    "completion_tokens": len(c.token_ids), "cached_tokens": 0, "e2e_latency": time.perf_counter() - start}
            if body.return_logprob:
                with_text = body.return_text_in_logprobs
                meta["output_token_logprobs"], meta["output_top_logprobs"] = sglang_logprobs(self.text_of, c.logprobs, with_text)
                inp, inp_top = sglang_logprobs(self.text_of, c.prompt_logprobs, with_text)
                if body.logprob_start_len == 0:  # the first prompt token has no logprob
                    first = s.request.prompt_ids[0]
                    inp, inp_top = [[None, first, self.text_of(first) if with_text else None]] + inp, [None] + inp_top
                meta["input_token_logprobs"], meta["input_top_logprobs"] = inp, inp_top
            out = {"text": c.text, "output_ids": c.token_ids, "meta_info": meta}
            return out if single else {"index": c.index, **out}

        if body.stream:
            async def events():
                async for i, out in self._merged(streams, start):
                    choices[i].add(out)
                    yield sse(result(choices[i]))

            return self._stream(events())
        async for i, out in self._merged(streams, start):
            choices[i].add(out)
        return JSONResponse(result(choices[0]) if single else [result(c) for c in choices])


def build_app(model: str | None = None, *, served_model_name: str | None = None, api_key: str | None = None,
              num_cpus: float = 1.0, num_threads: int | None = None, max_body_bytes: int = 1 << 20,
              max_tokens_limit: int = 1024, **engine_kwargs):
    """The Serve application for `serve.run`; api_key defaults to $SALA_API_KEY (unset: no auth)."""
    api_key = os.environ.get("SALA_API_KEY") if api_key is None else api_key
    return SalaServer.options(ray_actor_options={"num_cpus": num_cpus}).bind(
        model, served_model_name, api_key, max_body_bytes, max_tokens_limit, num_threads, engine_kwargs)


def app_builder(args: dict):
    """`serve run serve/config.yaml` entry point: the YAML's `args` are build_app's keyword arguments."""
    return build_app(**args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve.app", description="Serve a SALA checkpoint over HTTP")
    ap.add_argument("--model", help="checkpoint directory or models:/name@alias (default: tiny-sala)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--num-cpus", type=float, default=1.0, help="CPUs the replica reserves in Ray")
    ap.add_argument("--num-threads", type=int, help="torch threads in the replica (default: torch's choice)")
    ap.add_argument("--max-tokens-limit", type=int, default=1024)
    args = ap.parse_args(argv)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(args.model, num_cpus=args.num_cpus, num_threads=args.num_threads,
                        max_tokens_limit=args.max_tokens_limit), name="sala", route_prefix="/")
    print(f"serving on http://{args.host}:{args.port} (Ctrl-C to stop)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
