"""SalaServer: the Serve deployment holding one engine, answering over HTTP and through handles.

Its methods are the API, called the way Ray Serve LLM's LLMServer is: through a
DeploymentHandle with a request object (serve/protocol.py's models, or a dict of their fields),
`completions`, `chat` and `generate` as async generators of response objects (dicts, as they go
out as JSON: one response, or a stream's chunks), so another deployment or Ray Data's
ServeDeploymentProcessorConfig can call them without HTTP:

    handle = serve.get_deployment_handle("SalaServer", app_name="sala").options(stream=True)
    async for response in handle.completions.remote({"prompt": "def fib(n):", "max_tokens": 16}): ...

A refused request raises APIError (a ValueError) before the first response; a full queue
raises the engine's QueueFull. The HTTP API (serve/http.py) is a thin layer over these same
methods, built for each replica with its auth and body limit; handle calls are not
authenticated (whoever reaches the Ray cluster reaches its deployments).
A caller that goes away mid-request cancels its engine requests, which frees their cache.
"""
from __future__ import annotations

import logging
import time
from functools import partial
from typing import AsyncIterator, Callable

from fastapi import FastAPI
from pydantic import BaseModel
from ray import serve

from registry.models import model_name, resolve_model_path
from sala.checkpoint import gpu_device
from sala.engine import Engine, InvalidParam
from serve.chat_tools import ChatTools
from serve.client import EngineClient
from serve.errors import client_error, parse
from serve.http import build_api
from serve.metrics import Metrics
from serve.openai_api import OpenAIAPI
from serve.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
)
from serve.replica_routing import ServedPrompts, relay
from serve.router import RoutedRequest, SummaryRequest
from serve.sglang_api import ServerFacts, SGLangAPI

# What Ray Data's ServeDeploymentProcessorConfig adds to every row's request, besides its fields.
RAY_DATA_KEYS = ("request_id", "idx_in_batch")


def served_names(served_model_name: str | list[str] | None) -> list[str]:
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    if any(not isinstance(n, str) or not n for n in names):
        raise ValueError(f"served_model_name must be a non-empty string or a list of them, got {served_model_name!r}")
    return names


def as_json(value):
    """`value` with numpy arrays and scalars as the lists and numbers JSON has: Ray Data's
    columnar blocks hand a row's nested lists (a schema's "required", chat messages) over as
    numpy arrays, which a JSON schema's text cannot be made of."""
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    if type(value).__module__ == "numpy":
        return as_json(value.tolist())
    return value


def request_of(model: type[BaseModel], request) -> BaseModel:
    """A handle caller's request as `model`: an instance of it, or a dict of its fields."""
    if isinstance(request, model):
        return request
    if isinstance(request, dict):
        return parse(model, {k: as_json(v) for k, v in request.items() if k not in RAY_DATA_KEYS})
    raise TypeError(f"expected a {model.__name__} or a dict of its fields, got {type(request).__name__}")


# Serve notices a replica whose process died at its next health check, and only then starts
# another: every 2 s (a check reads one flag), not Serve's 10.
@serve.deployment(max_ongoing_requests=256, health_check_period_s=2, health_check_timeout_s=30)
@serve.ingress()
class SalaServer:
    def __init__(self, model: str | None = None, served_model_name: str | list[str] | None = None, api_key: str | None = None,
                 max_body_bytes: int = 1 << 20, max_tokens_limit: int = 1024, num_threads: int | None = None,
                 num_gpus: float = 0, batch_invariant: bool = False, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, engine_kwargs: dict | None = None):
        import torch

        if num_threads:
            torch.set_num_threads(num_threads)
        device = gpu_device(num_gpus)  # before the download: a replica without CUDA fails at once
        path = resolve_model_path(model)
        engine = Engine.from_pretrained(path, device=device, batch_invariant=batch_invariant, **(engine_kwargs or {}))
        # Most of a replica's start-up, of which Serve itself says only that the replica "has taken
        # more than 30s to initialize": say what it is and how long it takes.
        serve_log = logging.getLogger("ray.serve")
        serve_log.info("warming up the engine for %s: compiling its steps, usually 15-60 s on CPU, or loading the "
                       "graphs an earlier start compiled, a few seconds", path)
        start = time.perf_counter()
        engine.warmup()
        serve_log.info("engine warmed up in %.1f s; %s", time.perf_counter() - start, engine.decoding.describe())
        self.metrics = Metrics(engine.info())
        self.client = EngineClient(engine, self.metrics, max_tokens_limit)
        names = served_names(served_model_name) or [model_name(model, path)]
        self.api_key, self.max_body_bytes = api_key or None, max_body_bytes
        tools = ChatTools.of(engine.tokenizer, engine.eos_ids, tool_call_parser, reasoning_parser)
        serve_log.info("chat: %s", tools.describe())
        self.openai = OpenAIAPI(self.client, names, tools)
        self.sglang = SGLangAPI(self.client, ServerFacts(str(path), names, batch_invariant, max_tokens_limit, max_body_bytes,
                                                         self.api_key is not None))
        self.served = ServedPrompts()

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve's hook for the replica's HTTP app (after __init__): ours, with this server's auth and limits."""
        return build_api(self, self.api_key, self.max_body_bytes)

    def check_health(self) -> None:
        if not self.client.alive:
            raise RuntimeError("engine step thread has stopped")

    # ---- the API: async generators of response objects ----------------------------------------

    async def completions(self, request: CompletionRequest | dict, *, prompt_key: str | None = None) -> AsyncIterator[dict]:
        """OpenAI's /v1/completions: the response, or with `stream` its chunks."""
        async for out in self._run("completions", CompletionRequest, request, self.openai.completions, prompt_key):
            yield out

    async def chat(self, request: ChatCompletionRequest | dict, *, prompt_key: str | None = None) -> AsyncIterator[dict]:
        """OpenAI's /v1/chat/completions: the response, or with `stream` its chunks."""
        async for out in self._run("chat", ChatCompletionRequest, request, self.openai.chat, prompt_key):
            yield out

    async def generate(self, request: GenerateRequest | dict, *, prompt_key: str | None = None) -> AsyncIterator[dict | list]:
        """SGLang's /generate: the response (a list for several prompts), or with `stream` one per output."""
        async for out in self._run("generate", GenerateRequest, request, self.sglang.generate, prompt_key):
            yield out

    async def _run(self, endpoint: str, model: type[BaseModel], request, run: Callable, prompt_key: str | None):
        """`run`'s responses to `request`, a bad value in it an APIError naming the field as
        `endpoint` spells it. With the prefix router's `prompt_key` (a request it relayed here),
        the first prompt's tokens are recorded under it."""
        body = request_of(model, request)
        try:
            async for out in run(body, None if prompt_key is None else partial(self.served.add, prompt_key)):
                yield out
        except InvalidParam as e:
            raise client_error(e, endpoint, body) from None

    # ---- the API: the rest ---------------------------------------------------------------------

    @staticmethod
    def _answer(endpoint: str, fn: Callable[[BaseModel], dict], body: BaseModel) -> dict:
        try:
            return fn(body)
        except InvalidParam as e:
            raise client_error(e, endpoint, body) from None

    async def models(self) -> dict:
        return self.openai.models()

    async def tokenize(self, request: TokenizeRequest | dict) -> dict:
        return self._answer("tokenize", self.openai.tokenize, request_of(TokenizeRequest, request))

    async def detokenize(self, request: DetokenizeRequest | dict) -> dict:
        return self._answer("detokenize", self.openai.detokenize, request_of(DetokenizeRequest, request))

    async def abort(self, request: AbortRequest | dict) -> dict:
        return self._answer("abort", self.sglang.abort, request_of(AbortRequest, request))

    async def flush_cache(self) -> dict:
        return await self.sglang.flush_cache()

    async def model_info(self) -> dict:
        return self.sglang.model_info()

    async def server_info(self) -> dict:
        return await self.sglang.server_info()

    async def prometheus(self) -> bytes:
        return self.metrics.exposition(await self.client.stats())

    # ---- the prefix router's hooks (serve/router.py, serve/replica_routing.py) -------------------

    async def routed(self, request: RoutedRequest) -> AsyncIterator[dict]:
        """An HTTP request relayed by PrefixRoutingIngress, run through this replica's app."""
        async for message in relay(self.app, request, self.served):  # self.app: the app __serve_build_asgi_app__ built
            yield message

    async def prefix_summary(self, request: SummaryRequest) -> tuple[str, list[int]]:
        """For the router (PrefixRoutingIngress.refresh): this replica's id and the blocks of the
        prompts relayed to it that its prefix cache still holds."""
        held = await self.served.summary(self.client, request.block_chars)
        return serve.get_replica_context().replica_id.unique_id, held
