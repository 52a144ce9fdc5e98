"""A request's state inside the engine, and what the engine hands back after each step."""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from sala.engine.detokenizer import IncrementalDetokenizer
from sala.medusa.accept import accept_length
from sala.sampling import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from sala.structured import Grammar

_ids = itertools.count()


@dataclass
class SpecStats:
    """A request's speculative decoding so far."""

    verify_steps: int = 0
    draft_tokens: int = 0  # tree nodes verified, the root not counted
    accepted_tokens: int = 0  # drafted tokens kept, the bonus token not counted
    accepted_per_depth: list[int] = field(default_factory=list)  # [d - 1]: verify steps that kept the depth-d draft

    @property
    def accept_length(self) -> float:
        return accept_length(self.verify_steps, self.accepted_tokens)

    def record(self, kept: int, draft_nodes: int, max_depth: int) -> None:
        """One verify step of a tree of draft_nodes + 1 nodes that kept `kept` of them, root included."""
        self.verify_steps += 1
        self.draft_tokens += draft_nodes
        self.accepted_tokens += kept - 1
        self.accepted_per_depth += [0] * (max_depth - len(self.accepted_per_depth))
        for d in range(kept - 1):
            self.accepted_per_depth[d] += 1

    def copy(self) -> SpecStats:
        return dataclasses.replace(self, accepted_per_depth=list(self.accepted_per_depth))


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
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    matched: int | str | None = None  # what ended a "stop": the stop string, or the token id (eos or a stop token)
    spec: SpecStats | None = None  # Medusa engines: verify steps and draft tokens so far


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
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    matched: int | str | None = None  # as RequestOutput.matched
    spec: SpecStats | None = None


# eq=False: a request is itself, not its fields. The scheduler's `in` and `remove` over its
# lists must find this request, never another whose prompt and state happen to be equal.
@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    on_output: Callable[[RequestOutput], None] | None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V and state are in the cache
    pages: list[int] = field(default_factory=list)  # K/V pool pages, allocated as the sequence grows
    state_slot: int = -1
    prefix_chain: list = field(default_factory=list)  # prefix-cache nodes of pages[:len(prefix_chain)] (sala/engine/prefix.py)
    num_cached_tokens: int | None = None  # tokens resumed from the prefix cache at first admission
    prompt_logprobs_next: int | None = None  # next prompt position whose logits score the following token
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens from prompt_logprobs_start
    finish_reason: str | None = None
    matched: int | str | None = None  # the stop string or token id that ended it
    cancelled: bool = False
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    grammar: Grammar | None = None  # structured outputs: what the output may continue with (sala/structured.py)
    drafts: torch.Tensor | None = None  # Medusa: each head's top-k tokens [K, topk], the next tree's candidates
    drafts_for: int = 0  # ... head k's for token drafts_for + k (a plain step decodes past them: tree_drafts)
    spec: SpecStats | None = None
    # Evaluation mode, after a preemption: the generated tokens are recomputed by decode steps, one
    # each, as they were first computed (a prefill of them rounds differently), so the cache holds
    # the bits it held before and what follows is what an undisturbed request computes.
    recompute_by_decode: bool = False

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
        """The token the next decode step feeds (position num_computed): the last one, except while
        generated tokens are recomputed by decode (`recompute_by_decode`)."""
        i = self.num_computed - len(self.prompt_ids)
        return self.output_ids[i] if i >= 0 else self.prompt_ids[self.num_computed]

    @property
    def prefill_end(self) -> int:
        """Where prompt chunks stop: the end of the tokens, or of the prompt with `recompute_by_decode`."""
        return len(self.prompt_ids) if self.recompute_by_decode else self.num_tokens

    @property
    def prefilling(self) -> bool:
        """More than one token still to compute before prefill_end: the next step runs a chunk, not one
        decode token. (A request one token short of it decodes that token, whether it is new, the
        prompt's last, or one it generated before a preemption.)"""
        return self.num_computed < self.prefill_end - 1

    def completion(self) -> Completion:
        now = time.perf_counter()
        first = self.first_token_at or now
        return Completion(request_id=self.request_id, prompt_ids=self.prompt_ids, token_ids=self.output_ids,
                          text=self.detokenizer.text, logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
                          finish_reason=self.finish_reason, time_to_first_token_s=first - self.arrival,
                          latency_s=now - self.arrival, num_cached_tokens=self.cached_prompt_tokens, matched=self.matched,
                          spec=self.spec)

    @property
    def cached_prompt_tokens(self) -> int:
        return min(self.num_cached_tokens or 0, len(self.prompt_ids))
