"""OpenAI's dialect over the engine client: /v1/models, /v1/completions, /v1/chat/completions,
and vLLM's /tokenize and /detokenize (SGLang answers those alike).

completions and chat are async generators of response objects (dicts, as they go out as JSON):
one response, or with `stream` its chunks in order (the HTTP layer frames them as SSE and adds
`[DONE]`). A bad request raises before the first one.
"""
from __future__ import annotations

import inspect
import logging
import time
import uuid
from dataclasses import replace
from typing import AsyncIterator, Callable

from jinja2 import TemplateError

from sala.engine import InvalidParam, RequestOutput, SamplingParams
from serve.chat_output import ChatOutput
from serve.chat_tools import ChatTools
from serve.client import EngineClient
from serve.errors import APIError
from serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    Tool,
    chat_logprobs,
    completion_logprobs,
    token_id_text,
    usage,
)

log = logging.getLogger("sala.serve")
OnPrompt = Callable[[list[int]], None] | None


class OpenAIAPI:
    def __init__(self, client: EngineClient, names: list[str], tools: ChatTools):
        # As vLLM's --served-model-name: requests may use any of the names, responses carry the one asked for.
        self.client, self.names, self.tools = client, names, tools
        self.tokenizer, self.text_of = client.tokenizer, client.text_of
        # What chat_template_kwargs cannot set: the messages, and apply_chat_template's own arguments (tools, tokenize, ...).
        self.reserved = {"messages"} | {name for name, p in inspect.signature(self.tokenizer.apply_chat_template).parameters.items()
                                        if p.kind is not p.VAR_KEYWORD}

    def check_model(self, model: str | None) -> str:
        """The name to answer with: the requested one, or the first served name when none is given."""
        if model is None:
            return self.names[0]
        if model not in self.names:
            model = model.encode("utf-8", "backslashreplace").decode()  # a lone surrogate cannot go out as JSON
            raise APIError(404, f"The model `{model}` does not exist; this server serves {', '.join(f'`{n}`' for n in self.names)}",
                           param="model", code="model_not_found")
        return model

    def models(self) -> dict:
        info = self.client.info
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "sala",
                                            "max_model_len": info.max_model_len, "vocab_size": info.vocab_size}
                                           for name in self.names]}

    def chat_text(self, messages: list[ChatMessage], add_generation_prompt: bool, tools: list[Tool] | None = None,
                  template_kwargs: dict | None = None) -> str:
        """The prompt the chat template makes of `messages` (and of `tools`, and of
        chat_template_kwargs' variables); InvalidParam("messages") when the template refuses them
        (raise_exception), e.g. roles out of order."""
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        rendered = [m.for_template(i) for i, m in enumerate(messages)]
        try:
            return self.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      tools=tool_dicts, **(template_kwargs or {}))
        except (TemplateError, TypeError) as e:  # TypeError: a template's expression on a value it cannot take
            raise InvalidParam("messages", f"the chat template refused the messages: {e}") from None

    @staticmethod
    def _log_user(rid: str, user: str | None) -> None:
        if user is not None:  # OpenAI's `user`: who asked, for abuse monitoring
            log.info("%s for user %r", rid, user)

    async def completions(self, body: CompletionRequest, on_prompt: OnPrompt = None) -> AsyncIterator[dict]:
        start = time.perf_counter()
        name = self.check_model(body.model)
        prompts = body.prompts()
        n = body.choices_per_prompt
        with_logprobs = body.logprobs is not None
        # echo with max_tokens 0 scores the prompt alone (as vLLM): the engine samples one token, left out.
        score_only = body.echo and body.max_tokens == 0

        def params_for(ids: list[int]) -> SamplingParams:
            params = body.sampling(1 if score_only else self.client.max_tokens(body.max_tokens, 16, len(ids)), body.logprobs)
            return replace(params, prompt_logprobs_start=0) if body.echo and with_logprobs else params

        queued = await self.client.submit(prompts, n, params_for, on_prompt=on_prompt)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        self._log_user(rid, body.user)
        head = {"id": rid, "object": "text_completion", "created": created, "model": name}
        choices = self.client.choices(queued)
        prompt_tokens = sum(len(q.prompt_ids) for q in queued[::n])  # each prompt once, whatever n (as OpenAI)
        text_of = token_id_text if body.return_tokens_as_token_ids else self.text_of
        sent = [""] * len(queued)  # each choice's text so far, echoed prompt included
        lps: list[dict | None] = [None] * len(queued)

        def piece(i: int, out: RequestOutput) -> dict:
            """Choice i's part of this output; the echoed prompt (text, logprobs) comes before its first one."""
            first = not choices[i].token_ids
            if score_only:
                out = replace(out, token_ids=[], text="", logprobs=[], finish_reason="length" if out.finished else None)
            choices[i].add(out)
            text, entries, first_token = out.text, out.logprobs, None
            if body.echo and first:
                prompt, ids = prompts[i // n], queued[i].prompt_ids
                text = (prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)) + text
                entries, first_token = out.prompt_logprobs + entries, ids[0]
            lp = completion_logprobs(text_of, entries, len(sent[i]), first_token) if with_logprobs else None
            sent[i] += text
            if lp is not None:
                lps[i] = lp if lps[i] is None else {k: lps[i][k] + lp[k] for k in lp}
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": out.finish_reason,
                    "stop_reason": choices[i].stop_reason}

        if body.stream:
            async for i, out in self.client.merged(queued, start):
                yield {**head, "choices": [piece(i, out)]}
            if body.stream_options and body.stream_options.include_usage:
                yield {**head, "choices": [], "usage": usage(choices, prompt_tokens, n)}
            return
        async for i, out in self.client.merged(queued, start):
            piece(i, out)
        yield {**head, "choices": [
            {"index": c.index, "text": sent[c.index], "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
             "logprobs": lps[c.index]}
            for c in choices], "usage": usage(choices, prompt_tokens, n)}

    async def chat(self, body: ChatCompletionRequest, on_prompt: OnPrompt = None) -> AsyncIterator[dict]:
        start = time.perf_counter()
        name = self.check_model(body.model)
        body.refuse_deprecated()
        if reserved := sorted(self.reserved & (body.chat_template_kwargs or {}).keys()):
            raise InvalidParam("chat_template_kwargs", f"chat_template_kwargs cannot set {reserved[0]!r}: the request "
                                                       "sets it")
        tools = self.tools.with_format(body.tool_call_parser)
        mode, functions = body.tool_call(), body.tool_functions()
        body.set_tools_constraint(tools.constraint(mode, functions, body.parallel_tool_calls is not False))
        body.constraint()  # a bad one refused before the tools are rendered into the prompt
        top = body.top_k_logprobs()
        text = self.chat_text(body.messages, add_generation_prompt=True, tools=body.tools,
                              template_kwargs=body.chat_template_kwargs)
        opened = tools.reasoning is not None and tools.reasoning.opened_by(text)  # a constraint holds after the reasoning
        reasoning = tools.reasoning if body.separate_reasoning is not False else None
        requested, param = (body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens is not None \
            else (body.max_tokens, "max_tokens")

        def params_for(ids: list[int]) -> SamplingParams:
            params = body.sampling(self.client.max_tokens(requested, None, len(ids), param), top)
            return tools.sampling(params, mode, bool(functions), opened)

        queued = await self.client.submit([text], body.choices_per_prompt, params_for, on_prompt=on_prompt)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self._log_user(rid, body.user)
        head = {"id": rid, "object": "chat.completion", "created": created, "model": name}
        choices = self.client.choices(queued)
        outputs = [ChatOutput(tools.parser(mode), functions, reasoning, opened) for _ in choices]
        prompt_tokens = len(queued[0].prompt_ids)

        def finish_reason(i: int) -> str | None:
            reason = choices[i].finish_reason
            return "tool_calls" if reason == "stop" and outputs[i].called else reason

        if body.stream:
            chunk = {**head, "object": "chat.completion.chunk"}

            def event(i: int, delta: dict, lp: dict | None = None, finished: bool = False) -> dict:
                return {**chunk, "choices": [{"index": i, "delta": delta, "logprobs": lp,
                                              "finish_reason": finish_reason(i) if finished else None,
                                              "stop_reason": choices[i].stop_reason if finished else None}]}

            # A choice's role chunk goes out with its first output, not before: a stream's first
            # event carries output, so until then the request may still go to another replica
            # (serve/router.py, RelayedResponse).
            announced = set()
            async for i, out in self.client.merged(queued, start):
                if i not in announced:
                    announced.add(i)
                    yield event(i, {"role": "assistant", "content": None if mode else ""})
                choices[i].add(out)
                lp = chat_logprobs(self.text_of, out.logprobs) if top is not None else None
                deltas = outputs[i].feed(out.text, out.finished)
                for k, delta in enumerate(deltas):  # this output's logprobs and finish go with its last delta
                    last = k == len(deltas) - 1
                    yield event(i, delta, lp if last else None, out.finished and last)
                if not deltas and (lp is not None or out.finished):
                    yield event(i, {}, lp, out.finished)
            if body.stream_options and body.stream_options.include_usage:
                yield {**chunk, "choices": [], "usage": usage(choices, prompt_tokens, body.n)}
            return
        async for i, out in self.client.merged(queued, start):
            choices[i].add(out)
        for c in choices:
            outputs[c.index].feed(c.text, True)
        yield {**head, "choices": [
            {"index": c.index, "message": outputs[c.index].message(), "finish_reason": finish_reason(c.index),
             "stop_reason": c.stop_reason, "logprobs": chat_logprobs(self.text_of, c.logprobs) if top is not None else None}
            for c in choices], "usage": usage(choices, prompt_tokens, body.n)}

    def tokenize(self, body: TokenizeRequest) -> dict:
        """As vLLM and SGLang answer: {tokens, count, max_model_len} (lists of them for a list of prompts)."""
        self.check_model(body.model)
        texts, batched = body.texts(self.chat_text)
        try:
            ids = [self.client.encode(t, body.add_special_tokens) for t in texts]
        except InvalidParam as e:  # text the engine refuses (a lone surrogate): the messages', when they were given
            if body.messages is None:
                raise
            raise InvalidParam("messages", str(e)) from None
        out = {"tokens": ids, "count": [len(x) for x in ids], "max_model_len": self.client.info.max_model_len}
        if body.return_token_strs:
            out["token_strs"] = [self.tokenizer.convert_ids_to_tokens(x) for x in ids]
        return out if batched else {k: v if k == "max_model_len" else v[0] for k, v in out.items()}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        """As vLLM ({"prompt"}) and SGLang ({"text"}) answer, both keys; a list of lists gives lists."""
        self.check_model(body.model)
        batched = bool(body.tokens) and isinstance(body.tokens[0], list)
        seqs = body.tokens if batched else [body.tokens]
        vocab = self.client.info.vocab_size
        if any(not 0 <= t < vocab for seq in seqs for t in seq):
            raise InvalidParam("tokens", f"token ids must be in [0, {vocab})")
        texts = [self.tokenizer.decode(seq, skip_special_tokens=body.skip_special_tokens) for seq in seqs]
        text = texts if batched else texts[0]
        return {"prompt": text, "text": text}
