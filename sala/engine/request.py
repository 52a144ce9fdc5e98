"""A request's state inside the engine, and what the engine hands back after each step."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from sala.engine.detokenizer import IncrementalDetokenizer
from sala.engine.params import SamplingParams

_ids = itertools.count()


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely (token id, logprob), most likely first


@dataclass
class RequestOutput:
    """What one step produced for one request; `text` and `token_ids` are the new part only."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob]  # with the first token, when asked for
    finished: bool
    finish_reason: str | None  # "stop" (eos, stop token or string), "length", "cancelled"
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass
class Completion:
    """A finished request, as `Engine.generate` returns it."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob]
    finish_reason: str
    time_to_first_token_s: float
    latency_s: float


# eq=False: a request is itself, not its fields. The scheduler's `in` and `remove` over its
# lists must find this request, never another whose prompt and state happen to be equal.
@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    on_output: Callable[[RequestOutput], None]
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V and state are in the cache
    pages: list[int] = field(default_factory=list)  # K/V pool pages, allocated as the sequence grows
    page_table: torch.Tensor | None = None  # `pages` on the cache's device
    state_slot: int = -1
    prompt_logprobs_next: int | None = None  # next prompt position whose logits score the following token
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens from prompt_logprobs_start
    finish_reason: str | None = None
    cancelled: bool = False
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    @property
    def capacity(self) -> int:
        """Positions it may reach: the prompt plus every token it may generate."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens start .. end - 1 of prompt + output (a preempted request recomputes both)."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.output_ids)[start:end]

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def prefilling(self) -> bool:
        """More than the last token still to compute: the next step runs a chunk, not one decode token.
        (A request one token short of done decodes that token, whether it is new or the prompt's last.)"""
        return self.num_computed < self.num_tokens - 1

    def completion(self) -> Completion:
        now = time.perf_counter()
        first = self.first_token_at or now
        return Completion(self.request_id, self.prompt_ids, self.output_ids, self.detokenizer.text, self.logprobs,
                          self.prompt_logprobs, self.finish_reason, first - self.arrival, now - self.arrival)
