"""Per-request sampling parameters, checked once at the door.

Defaults follow the OpenAI API (temperature 1, top_p 1, 16 tokens), so the HTTP layer can pass
a request's fields through unchanged. temperature == 0 means greedy. A bad value raises
InvalidParam naming the field, which the server turns into an HTTP 400 with that `param`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 256


class InvalidParam(ValueError):
    """A request field with a value the engine cannot honour; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob plus k alternatives
    prompt_logprobs_start: int | None = None  # logprobs (with `logprobs` alternatives) of prompt tokens from here on
    skip_special_tokens: bool = True  # leave special tokens (chat-template markers, eos) out of the text, as vLLM does

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self, vocab_size: int) -> SamplingParams:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidParam("max_tokens", f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise InvalidParam("temperature", f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise InvalidParam("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidParam("top_k", f"top_k must be a non-negative integer (0 = off), got {self.top_k!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidParam("logprobs", f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs!r}")
        if self.prompt_logprobs_start is not None and self.prompt_logprobs_start < 0:
            raise InvalidParam("prompt_logprobs_start", f"prompt_logprobs_start must be >= 0, got {self.prompt_logprobs_start!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParam("stop", "stop must be a list of non-empty strings")
        bad = [t for t in self.stop_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidParam("stop_token_ids", f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
        return self
