"""Per-request sampling parameters, checked once at the door.

Defaults follow the OpenAI API (temperature 1, top_p 1, 16 tokens), so the HTTP layer can pass
a request's fields through unchanged. temperature == 0 means greedy. A bad value raises
InvalidParam naming the field, which the server turns into an HTTP 400 with that `param`.

The logits controls (logit_bias, min_tokens, the three penalties) and min_p follow vLLM's
definitions (sala/sampling/controls.py applies them); each is off at its default, and a
step none of whose requests sets one pays nothing for them.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

MAX_TOP_LOGPROBS = 256
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it
MAX_CONSTRAINT_CHARS = 65536  # a schema, regex or grammar (or all choices) longer than this is refused


class InvalidParam(ValueError):
    """A request field with a value the engine cannot honour; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


# The fields of StructuredOutputs that are constraints: a request gives exactly one.
CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputs:
    """One constraint on a request's output, as vLLM's StructuredOutputsParams: exactly one of
    json (a JSON schema, a dict or its JSON text), json_object (any JSON object), regex (the whole
    output matches it), choice (the output is one of these strings), grammar (EBNF, in the GBNF
    dialect xgrammar reads) and structural_tag (xgrammar's structural tag, {"type":
    "structural_tag", "format": {...}}, a dict or its JSON text: free text and tagged regions,
    such as tool calls, each held to its own format). Frozen and hashable: the compiled grammar's
    cache key (sala/structured.py), a schema or tag kept as its JSON text (its keys in their
    order: the output writes an object's properties in the schema's order).

    reasoning_end: the text that ends the model's reasoning (`</think>`), when the output starts
    inside it; the constraint holds from there on, the reasoning before it is free."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict | None = None
    reasoning_end: str | None = None

    def __post_init__(self):
        for name in ("json", "structural_tag"):
            if isinstance(getattr(self, name), dict):
                object.__setattr__(self, name, json.dumps(getattr(self, name), separators=(",", ":")))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def given(self) -> list[str]:
        """The constraint fields that are set."""
        return [name for name in CONSTRAINT_KINDS if getattr(self, name) not in (None, False)]

    @property
    def kind(self) -> str:
        """The one constraint field that is set (validate() has checked there is one)."""
        return self.given[0]

    def validate(self) -> StructuredOutputs:
        given = self.given
        if len(given) != 1:
            raise InvalidParam("structured_outputs", f"give exactly one of {', '.join(CONSTRAINT_KINDS)}; "
                                                     f"got {', '.join(given) or 'none'}")
        kind = given[0]
        if kind == "choice":
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise InvalidParam("structured_outputs", "choice must be a non-empty list of non-empty strings")
        elif kind != "json_object" and not (isinstance(getattr(self, kind), str) and getattr(self, kind)):
            raise InvalidParam("structured_outputs", f"{kind} must be a non-empty string")
        if kind in ("json", "structural_tag"):
            try:
                value = json.loads(getattr(self, kind))
            except ValueError as e:
                raise InvalidParam("structured_outputs", f"{kind} is not valid JSON: {e}") from None
            except RecursionError:
                raise InvalidParam("structured_outputs", f"{kind} is nested too deeply") from None
            if kind == "json" and not isinstance(value, (dict, bool)):
                raise InvalidParam("structured_outputs", f"json must be a JSON schema (an object), got {type(value).__name__}")
            if kind == "structural_tag" and not (isinstance(value, dict) and isinstance(value.get("format"), dict)):
                raise InvalidParam("structured_outputs", 'structural_tag must be an object {"type": "structural_tag", '
                                                         '"format": {...}}')
        if self.reasoning_end is not None and not (isinstance(self.reasoning_end, str) and self.reasoning_end):
            raise InvalidParam("structured_outputs", "reasoning_end must be a non-empty string")
        size = sum(map(len, self.choice)) if kind == "choice" else 0 if kind == "json_object" else len(getattr(self, kind))
        if size > MAX_CONSTRAINT_CHARS:
            raise InvalidParam("structured_outputs", f"the {kind} constraint has {size} characters; the limit is "
                                                     f"{MAX_CONSTRAINT_CHARS}")
        return self


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
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (after temperature)
    min_tokens: int = 0  # no eos / stop token before this many tokens, and stop strings only from then on
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]
    repetition_penalty: float = 1.0  # > 1: tokens of the prompt or output so far get logit / p if positive, * p if not
    presence_penalty: float = 0.0  # subtracted from the logit of every token already in the output
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    no_stop_trim: bool = False  # keep the matched stop string (or stop token's text) at the end of the text
    structured_outputs: StructuredOutputs | None = None  # a JSON schema, regex, grammar or choice the output follows

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler must change this request's logits before choosing (min_p aside)."""
        return bool(self.logit_bias or self.min_tokens or self.repetition_penalty != 1 or self.presence_penalty
                    or self.frequency_penalty)

    def validate(self, vocab_size: int) -> SamplingParams:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidParam("max_tokens", f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0 <= self.temperature < math.inf:
            raise InvalidParam("temperature", f"temperature must be finite and >= 0, got {self.temperature!r}")
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
        if not 0 <= self.min_p <= 1:
            raise InvalidParam("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidParam("min_tokens", f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                                             f"got {self.min_tokens!r}")
        if not self.repetition_penalty > 0 or not math.isfinite(self.repetition_penalty):
            raise InvalidParam("repetition_penalty", f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidParam(name, f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or not 0 <= token < vocab_size:
                raise InvalidParam("logit_bias", f"logit_bias key {token!r} is not a token id in [0, {vocab_size})")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidParam("logit_bias", f"logit_bias for token {token} must be in [-100, 100], got {bias!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise InvalidParam("structured_outputs", "structured_outputs must be a StructuredOutputs")
            self.structured_outputs.validate()
            if self.min_tokens:  # it could ban the only tokens the grammar allows (its end)
                raise InvalidParam("min_tokens", "min_tokens cannot be combined with structured outputs: the "
                                                 "constraint decides where the output ends")
        return self


class Sequence(Protocol):
    """A request as sampling reads it (the engine's Request is one): its parameters, its
    generator (sampled requests only) and its tokens so far (penalties, min_tokens)."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    output_ids: list[int]
