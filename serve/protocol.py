"""The API's request bodies (OpenAI /v1/completions and /v1/chat/completions, SGLang's
/generate and the rest), their translation into SamplingParams, and the pieces responses are
made of (usage, logprobs, finish reasons). The same over HTTP and through a DeploymentHandle;
serve/errors.py holds how a refused one is answered.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from sala.engine import InvalidParam, RequestOutput, SamplingParams, SpecStats, TokenLogprob
from serve.token_bytes import TokenBytes


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a field this server does not know is a 400, never ignored


class StreamOptions(_Body):
    include_usage: bool | None = False


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias, token ids as JSON object keys -> {token id: bias}."""
    out = {}
    for key, value in (bias or {}).items():
        try:
            out[int(key)] = value
        except ValueError:
            raise InvalidParam("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
    return out


class _OpenAISampling(_Body):
    model: str | None = None  # as in vLLM: omitted means the server's (first) model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # the end user, for abuse monitoring: logged with the request id
    # Extensions, as vLLM and SGLang name them:
    top_k: int | None = None  # -1 or 0 = off
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False  # vLLM's name ...
    no_stop_trim: bool | None = False  # ... and SGLang's, for keeping the matched stop in the text

    @property
    def choices_per_prompt(self) -> int:
        return 1 if self.n is None else self.n

    def sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            skip_special_tokens=self.skip_special_tokens is not False,
            logprobs=logprobs,
            min_tokens=self.min_tokens or 0,
            logit_bias=logit_bias_ids(self.logit_bias),
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            no_stop_trim=bool(self.include_stop_str_in_output or self.no_stop_trim),
        )


class CompletionRequest(_OpenAISampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False  # the prompt before the completion, with its logprobs (the first null) when logprobs is set
    return_tokens_as_token_ids: bool = False  # extension (vLLM): logprob tokens as "token_id:<id>", never ambiguous
    suffix: str | None = None
    best_of: int | None = None  # 1 (or none) only, as load testers send it

    def prompts(self) -> list[str | list[int]]:
        if self.suffix is not None or self.best_of not in (None, 1):
            field = "suffix" if self.suffix is not None else "best_of"
            raise InvalidParam(field, f"{field} is not supported by this server")
        p = self.prompt
        out = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not out or any(len(x) == 0 for x in out):
            raise InvalidParam("prompt", "prompt is empty")
        return out


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


# Chat fields this server knows but cannot honour yet, with the values that ask for nothing.
NOT_IMPLEMENTED = {"response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none",),
                   "parallel_tool_calls": (False, True), "functions": ([],), "function_call": ("none",)}


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None

    def refuse_not_implemented(self) -> None:
        for name, harmless in NOT_IMPLEMENTED.items():
            value = getattr(self, name)
            if value is not None and value not in harmless:
                what = "structured output (JSON mode, json_schema)" if name == "response_format" else "tool and function calling"
                raise InvalidParam(name, f"{name} is not supported by this server: {what} is not implemented")

    def top_k_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParam("top_logprobs", "top_logprobs requires logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    """vLLM's and SGLang's /tokenize: a prompt (SGLang: or a list of them) or chat messages (vLLM)."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True  # for messages, as vLLM
    return_token_strs: bool = False  # vLLM

    def texts(self, chat_template) -> tuple[list[str], bool]:
        """-> (texts, batched): the texts to tokenize, and whether the answer is a list of them.
        chat_template(messages, add_generation_prompt=...) is the text the messages make."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidParam("prompt", "give exactly one of prompt or messages")
        if self.messages is not None:
            if not self.messages:
                raise InvalidParam("messages", "messages is empty")
            return [chat_template(self.messages, add_generation_prompt=self.add_generation_prompt)], False
        return ([self.prompt], False) if isinstance(self.prompt, str) else (list(self.prompt), True)


class DetokenizeRequest(_Body):
    """vLLM's and SGLang's /detokenize: token ids (SGLang: or a list of lists) -> text."""

    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = False  # as given: the text the ids stand for


class GenerateSampling(_Body):
    """SGLang's sampling_params; unknown keys are an error (a typo must not silently fall back)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None


class GenerateRequest(_Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSampling = GenerateSampling()
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None  # request id(s), one per prompt: /abort_request cancels by it

    def prompts(self) -> list[str | list[int]]:
        if (self.text is None) == (self.input_ids is None):
            raise InvalidParam("text", "give exactly one of text or input_ids")
        p = self.text if self.text is not None else self.input_ids
        out = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not out or any(len(x) == 0 for x in out):
            raise InvalidParam("text" if self.text is not None else "input_ids", "prompt is empty")
        return out

    def sampling(self) -> SamplingParams:
        s = self.sampling_params
        if not self.return_logprob and (self.top_logprobs_num or self.logprob_start_len >= 0):
            raise InvalidParam("return_logprob", "top_logprobs_num and logprob_start_len need return_logprob: true")
        return SamplingParams(
            max_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=max(s.top_k, 0),
            seed=s.sampling_seed, stop=[s.stop] if isinstance(s.stop, str) else list(s.stop or []),
            stop_token_ids=list(s.stop_token_ids or []), ignore_eos=s.ignore_eos, skip_special_tokens=s.skip_special_tokens,
            logprobs=self.top_logprobs_num if self.return_logprob else None,
            prompt_logprobs_start=self.logprob_start_len if self.return_logprob and self.logprob_start_len >= 0 else None,
            min_tokens=s.min_new_tokens, min_p=s.min_p, no_stop_trim=s.no_stop_trim, repetition_penalty=s.repetition_penalty,
            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty, logit_bias=logit_bias_ids(s.logit_bias),
        )

    def rids(self, num_prompts: int) -> list[str] | None:
        """The rid of each prompt (None: the server makes ids)."""
        if self.rid is None:
            return None
        rids = [self.rid] if isinstance(self.rid, str) else self.rid
        if len(rids) != num_prompts or len(set(rids)) != len(rids) or not all(rids):
            raise InvalidParam("rid", f"rid must be one distinct non-empty id per prompt ({num_prompts}), got {self.rid!r}")
        return rids


class AbortRequest(_Body):
    """SGLang's /abort_request: cancel the request(s) with this rid, or every running one."""

    rid: str = ""
    abort_all: bool = False


@dataclass
class Choice:
    """One choice's outputs, accumulated as they arrive."""

    index: int
    request_id: str = ""  # the engine's id of the request
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    matched: int | str | None = None  # the stop string or token id that ended it
    stop_token_ids: tuple[int, ...] = ()  # the request's own, to tell them from eos
    spec: SpecStats | None = None  # a Medusa engine's verify steps and draft tokens

    @property
    def stop_reason(self) -> int | str | None:
        """vLLM's stop_reason: the stop string or stop_token_ids entry that ended the choice; None
        for eos, a length finish, or an unfinished choice."""
        return self.matched if isinstance(self.matched, str) or self.matched in self.stop_token_ids else None

    def add(self, out: RequestOutput) -> None:
        self.request_id = out.request_id
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.spec = out.spec
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.prompt_logprobs += out.prompt_logprobs
        self.finish_reason = out.finish_reason
        self.matched = out.matched


def usage(choices: list[Choice], prompt_tokens: int, n: int = 1) -> dict:
    """OpenAI's usage; cached_tokens counts each prompt once (its first choice's), like prompt_tokens."""
    completion = sum(len(c.token_ids) for c in choices)
    cached = sum(c.num_cached_tokens for c in choices[::n])
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
           "prompt_tokens_details": {"cached_tokens": cached}}
    return out | spec_stats(choices)


def spec_stats(choices: list[Choice]) -> dict:
    """Medusa's per-request counters (none without Medusa), SGLang's names: verify steps, drafted
    and accepted tokens (the bonus token not counted), and the engine's accept length of their sum."""
    stats = [c.spec for c in choices if c.spec is not None]
    if not stats:
        return {}
    total = SpecStats(sum(s.verify_steps for s in stats), sum(s.draft_tokens for s in stats),
                      sum(s.accepted_tokens for s in stats))
    return {"spec_verify_ct": total.verify_steps, "spec_draft_token_num": total.draft_tokens,
            "spec_accept_token_num": total.accepted_tokens, "spec_accept_length": total.accept_length}


class TokenText:
    """Token id -> its text, as shown in logprobs (`.bytes`: the bytes it stands for)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}
        self.bytes = TokenBytes(tokenizer)

    def __call__(self, token_id: int) -> str:
        if token_id not in self.cache:
            self.cache[token_id] = self.tokenizer.decode([token_id])
        return self.cache[token_id]


def token_id_text(token_id: int) -> str:
    """vLLM's return_tokens_as_token_ids spelling: distinct ids stay distinct keys whatever their text."""
    return f"token_id:{token_id}"


def completion_logprobs(text_of: Callable[[int], str], entries: list[TokenLogprob], offset: int,
                        first_token: int | None = None) -> dict:
    """OpenAI completion logprobs of `entries`; an echoed prompt passes its first token, which has no
    logprob and comes first with nulls (as vLLM and SGLang answer, and lm-evaluation-harness reads)."""
    head = [] if first_token is None else [first_token]
    tokens = [text_of(t) for t in head + [e.token_id for e in entries]]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [None] * len(head) + [e.logprob for e in entries],
            "top_logprobs": [None] * len(head) + [{text_of(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}


def chat_logprobs(text_of: TokenText, entries: list[TokenLogprob]) -> dict:
    def one(token_id: int, logprob: float) -> dict:
        t = text_of(token_id)
        return {"token": t, "logprob": logprob, "bytes": list(text_of.bytes(token_id))}

    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]}


def sglang_logprobs(text_of: TokenText, entries: list[TokenLogprob], with_text: bool) -> tuple[list, list]:
    """-> (token_logprobs [[logprob, id, text]], top_logprobs [[[logprob, id, text], ...]])."""
    def one(token_id: int, logprob: float | None) -> list:
        return [logprob, token_id, text_of(token_id) if with_text else None]

    return [one(e.token_id, e.logprob) for e in entries], [[one(t, lp) for t, lp in e.top] for e in entries]


def sglang_finish_reason(c: Choice) -> dict | None:
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.token_ids)}
    if c.finish_reason == "stop":
        return {"type": "stop", "matched": c.matched}
    return {"type": "abort"} if c.finish_reason else None
