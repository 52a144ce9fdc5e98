"""How a step decodes: the strategy the engine holds, plain decoding or Medusa.

A step runs the running requests that are past their prompts (the decoding requests) and some
prompt chunks through one forward. The prompt chunks are the same whatever the strategy; what
the decoding requests contribute is the strategy's, through one interface, `DecodeStep`:

- `lookahead` and `rows`: what the scheduler reserves for a decoding request (positions past
  its next token, and rows of the step's token budget);
- `inputs`: the decode rows' token ids and the step context they run with, placed in front of
  the prompt chunks;
- `run_compiled`: a step with no prompt chunk through the strategy's compiled graph, or None
  for the eager forward (sala/engine/runner.py) to run it;
- `emit`: after the forward, what each decoding request gains: its tokens (and logprobs), with
  its cache advanced past them.

An engine holds one `Decoding`, which gives the scheduler each step's `DecodeStep`
(`for_step`, told whether prompt chunks may join the step). Plain decoding is one: every step
feeds each request its last token and samples the next. Medusa (sala/engine/medusa_decoding.py)
chooses per step between verifying draft trees and a plain step. The engine's step names neither.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from sala import sparse, structured
from sala.engine.config import EngineConfig
from sala.engine.context import StepContext
from sala.engine.graphs import CompiledDecode, CompiledStep, CudaGraphDecode
from sala.engine.request import Request
from sala.medusa.accept import Settled
from sala.sampling import TokenLogprob, sample, token_logprobs


@dataclass
class Emitted:
    """What one request gains from a step: tokens to append, each with its logprobs when asked for."""

    request: Request
    tokens: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass
class StepOutput:
    """What a step's forward produced, by what it is for."""

    ids: torch.Tensor  # the decode rows' token ids
    context: StepContext
    decoded: torch.Tensor | None = None  # [decode rows, V] fp32 logits of the decode rows
    decoded_hidden: torch.Tensor | None = None  # the heads' input at the decode rows (a drafting step)
    sampled: list[Request] = field(default_factory=list)  # prompts that ended: each draws its first token
    logits: torch.Tensor | None = None  # [len(sampled), V] fp32
    hidden: torch.Tensor | None = None  # the heads' input at the sampled rows (a drafting step)
    prompt_targets: list[tuple[Request, int]] = field(default_factory=list)  # (request, prompt token it scores)
    prompt_logits: torch.Tensor | None = None  # [len(prompt_targets), V] fp32
    decided: Settled | None = None  # a compiled Medusa verify step's acceptance, made in its graph


def draw(reqs: list[Request], logits: torch.Tensor, eos_ids: set[int]) -> list[Emitted]:
    """A token for each request from its row of logits (within its grammar, if it has one), with
    its logprobs (of the raw logits) when asked for."""
    if not reqs:
        return []
    tokens = sample(structured.masked(logits, reqs), reqs, eos_ids)
    scored: dict[int, TokenLogprob] = {}
    if want := [i for i, r in enumerate(reqs) if r.params.logprobs is not None]:
        lps = token_logprobs(logits[want], [tokens[i] for i in want], [reqs[i].params.logprobs for i in want])
        scored = dict(zip(want, lps))
    return [Emitted(r, [t], [scored.get(i)]) for i, (r, t) in enumerate(zip(reqs, tokens))]


class DecodeStep(Protocol):
    lookahead: int
    rows: int
    drafts: bool  # the eager forward returns the heads' input (Medusa drafts from it)

    def inputs(self, reqs: list[Request]) -> tuple[torch.Tensor, StepContext]: ...
    def run_compiled(self, ids: torch.Tensor, ctx: StepContext, reqs: list[Request]) -> StepOutput | None: ...
    def emit(self, reqs: list[Request], out: StepOutput, eos_ids: set[int]) -> list[Emitted]: ...


class Decoding(Protocol):
    """The engine's decoding strategy."""

    totals: object  # its counters (Engine.warmup leaves them as they were)

    def for_step(self, decoding: list[Request], prompts: bool = False) -> DecodeStep: ...
    def admit(self, req: Request) -> None: ...
    def compiled_steps(self) -> list[CompiledStep | CudaGraphDecode]: ...
    def took(self, batch, seconds: float) -> None: ...
    def warmup(self, engine, prompt: list[int], params) -> None: ...
    def stats(self): ...
    def describe(self) -> str: ...


class PlainDecoding:
    """One token per request per step: the decode row feeds its last token, the next is sampled.
    Decode-only steps run compiled on CPU, from CUDA graphs on CUDA (sala/engine/graphs.py)."""

    lookahead, rows, drafts = 0, 1, False
    totals = None

    def __init__(self, config: EngineConfig, runner):
        self.config, self.cache = config, runner.cache
        self.fast_decode = None
        if config.compiled:
            cuda = config.device.type == "cuda"
            self.fast_decode = CudaGraphDecode(runner, config.max_seqs) if cuda else CompiledDecode(config, runner)

    def for_step(self, decoding: list[Request], prompts: bool = False) -> PlainDecoding:
        return self

    def admit(self, req: Request) -> None:
        """Every request's parameters are honoured."""

    def compiled_steps(self) -> list:
        return [self.fast_decode] if self.fast_decode is not None else []

    def took(self, batch, seconds: float) -> None:
        """Plain decoding decides nothing by how long its steps take."""

    def inputs(self, reqs: list[Request]) -> tuple[torch.Tensor, StepContext]:
        """Each request's next token at its next position, reading its pages."""
        cache, dev = self.cache, self.cache.device
        width = max((len(r.pages) for r in reqs), default=0)

        def longs(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=dev)

        ctx = StepContext(cache=cache, positions=longs([r.num_computed for r in reqs]),
                          slot_mapping=longs([cache.row(r, r.num_computed) for r in reqs]),
                          block_tables=longs([r.pages + [cache.scratch_page] * (width - len(r.pages))
                                              for r in reqs]).view(len(reqs), width),
                          context_lens=longs([r.num_computed + 1 for r in reqs]),
                          state_slots=longs([r.state_slot for r in reqs]), batch_invariant=self.config.batch_invariant)
        if self._sparse_decodes(reqs):  # InfLLM-v2 needs each prompt's length; such steps run eagerly
            ctx.decode_prompt_lens = [len(r.prompt_ids) for r in reqs]
        return longs([r.last_token for r in reqs]), ctx

    def _sparse_decodes(self, reqs: list[Request]) -> bool:
        """Whether a decode row attends sparsely (InfLLM-v2)."""
        dense_len = self.config.model.sparse_config["dense_len"]
        return self.cache.compressed and any(sparse.call_length(r.num_computed, len(r.prompt_ids)) >= dense_len
                                             for r in reqs)

    def run_compiled(self, ids: torch.Tensor, ctx: StepContext, reqs: list[Request]) -> StepOutput | None:
        if self.fast_decode is None or ctx.decode_prompt_lens is not None:
            return None
        logits = self.fast_decode(ids, ctx)
        return None if logits is None else StepOutput(ids, ctx, decoded=logits)

    def emit(self, reqs: list[Request], out: StepOutput, eos_ids: set[int]) -> list[Emitted]:
        """Each request's decode token is in the cache; a token for those past what they had
        generated (a preempted request recomputing its generated tokens gains none)."""
        for r in reqs:
            r.num_computed += 1
        new = [i for i, r in enumerate(reqs) if r.num_computed == r.num_tokens]
        if len(new) < len(reqs):
            return draw([reqs[i] for i in new], out.decoded[new], eos_ids)
        return draw(reqs, out.decoded, eos_ids)

    def warmup(self, engine, prompt: list[int], params) -> None:
        """Compile (CPU) or capture (CUDA) the decode step, through the engine's own API."""
        if self.fast_decode is not None:
            engine.generate([prompt], params)

    def stats(self) -> None:
        return None

    def describe(self) -> str:
        return "plain decoding, one token a request a step"
