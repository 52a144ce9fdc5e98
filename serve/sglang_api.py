"""SGLang's dialect over the engine client: /generate, /abort_request, /flush_cache,
/get_model_info and /get_server_info.

generate is an async generator of response objects: one (a list of them for a batch of
prompts), or with `stream` one per output as it comes. A bad request raises before the first.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from sala.engine import InvalidParam
from serve.client import MAX_N, EngineClient
from serve.protocol import AbortRequest, Choice, GenerateRequest, sglang_finish_reason, sglang_logprobs, spec_stats


@dataclass(frozen=True)
class ServerFacts:
    """What /get_model_info and /get_server_info say of the server beyond its engine."""

    model_path: str
    names: list[str]
    batch_invariant: bool
    max_tokens_limit: int
    max_body_bytes: int
    api_key_required: bool


class SGLangAPI:
    def __init__(self, client: EngineClient, facts: ServerFacts):
        self.client, self.facts, self.text_of = client, facts, client.text_of

    async def generate(self, body: GenerateRequest, on_prompt: Callable[[list[int]], None] | None = None
                       ) -> AsyncIterator[dict | list[dict]]:
        start = time.perf_counter()
        prompts = body.prompts()
        params = body.sampling()
        limit = self.client.max_tokens_limit
        if params.max_tokens > limit:
            raise InvalidParam("max_tokens", f"max_new_tokens={params.max_tokens} exceeds this server's limit of {limit}")
        queued = await self.client.submit(prompts, body.sampling_params.n, lambda ids: params, body.rids(len(prompts)), on_prompt)
        choices = self.client.choices(queued)
        single = len(queued) == 1

        def result(c: Choice) -> dict:
            meta = {"id": c.request_id, "finish_reason": sglang_finish_reason(c), "prompt_tokens": c.num_prompt_tokens,
                    "completion_tokens": len(c.token_ids), "cached_tokens": c.num_cached_tokens,
                    "e2e_latency": time.perf_counter() - start, **spec_stats([c])}
            if body.return_logprob:
                with_text = body.return_text_in_logprobs
                meta["output_token_logprobs"], meta["output_top_logprobs"] = sglang_logprobs(self.text_of, c.logprobs, with_text)
                inp, inp_top = sglang_logprobs(self.text_of, c.prompt_logprobs, with_text)
                if body.logprob_start_len == 0:  # the first prompt token has no logprob
                    first = queued[c.index].prompt_ids[0]
                    inp, inp_top = [[None, first, self.text_of(first) if with_text else None]] + inp, [None] + inp_top
                meta["input_token_logprobs"], meta["input_top_logprobs"] = inp, inp_top
            out = {"text": c.text, "output_ids": c.token_ids, "meta_info": meta}
            return out if single else {"index": c.index, **out}

        if body.stream:
            async for i, out in self.client.merged(queued, start):
                choices[i].add(out)
                yield result(choices[i])
            return
        async for i, out in self.client.merged(queued, start):
            choices[i].add(out)
        yield result(choices[0]) if single else [result(c) for c in choices]

    def abort(self, body: AbortRequest) -> dict:
        if body.abort_all:
            ids = self.client.running()
        elif body.rid:
            ids = [body.rid, *(f"{body.rid}-{j}" for j in range(MAX_N))]  # and its choices, when n > 1
        else:
            raise InvalidParam("rid", "give the rid to abort, or abort_all: true")
        return {"aborted": [i for i in ids if self.client.abort(i)]}

    async def flush_cache(self) -> dict:
        """Drop every cached prefix page no running request holds."""
        return {"flushed_pages": await self.client.flush_prefix_cache()}

    def model_info(self) -> dict:
        f, info = self.facts, self.client.info
        return {"model_path": f.model_path, "tokenizer_path": f.model_path, "is_generation": True,
                "served_model_names": f.names, "max_model_len": info.max_model_len, "vocab_size": info.vocab_size}

    async def server_info(self) -> dict:
        f, info, stats = self.facts, self.client.info, await self.client.stats()
        return {"model_path": f.model_path, "served_model_names": f.names, "device": info.device,
                "max_model_len": info.max_model_len, "max_running_requests": info.max_seqs,
                "max_total_num_tokens": info.max_kv_tokens, "page_size": info.page_size,
                "chunked_prefill_size": info.max_batch_tokens, "max_queued_requests": info.max_waiting,
                "max_tokens_limit": f.max_tokens_limit, "max_body_bytes": f.max_body_bytes, "max_n": MAX_N,
                "batch_invariant": f.batch_invariant, "compiled_decode": info.compiled_decode,
                "api_key_required": f.api_key_required, "running_requests": stats.running, "queued_requests": stats.waiting}
