"""One engine step through the model: a Schedule in, a StepOutput out.

A step runs all its tokens as one row through one forward, `model.model(ids, step=ctx)`: first
one decode token per decoding request (or, with Medusa, each request's draft tree), then the
prompt chunks. The StepContext (sala/engine/context.py) says what each row is; the model's
mixers hand it their q, k, v and it runs their paged step. Which rows are read back is the
StepOutput: the rows that sample a token, the rows that score prompt tokens, the verified
trees. Nothing else needs to know the row order.

Decode-only steps take a fast path (sala/engine/graphs.py): compiled with inductor on CPU,
replayed from CUDA graphs on CUDA. Medusa's verify steps go through the engine's Speculation
(sala/engine/speculation.py), which builds the tree's context and has compiled paths of its own.

Batch invariance (engine.md, Determinism) is a mode, `batch_invariant=True`: a request's logits
must not depend on what else shares its step, nor on where its prompt was cut into chunks.
Three things would make them depend on it on CPU: a GEMM computes a matmul's rows in blocks
(MKL's AVX-512 kernels 4 rows, AMX tiles 16: measured on a Sapphire Rapids core, 8 rows was
not enough) and the rows left over after the last full block through a kernel whose sums round
differently, so the mode pads every step to a multiple of 16 rows; the chunked
lightning form sums in blocks counted from the start of each call, so the scheduler cuts
prompts only at multiples of that block (lightning.CHUNK_SIZE) and the mode runs each
request's prompt chunk as its own call, never as one padded batch (whose final states come
from a different formula); and compiled kernels are generated per shape, so the mode never
compiles. Attention over pages padded to the batch's widest needs nothing: masked keys add
exact zeros (tests/engine/test_engine.py checks all of it bitwise).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sala import sparse
from sala.engine.cache import CachePool
from sala.engine.context import Span, StepContext
from sala.engine.graphs import CompiledDecode, CudaGraphDecode
from sala.engine.request import Request
from sala.engine.scheduler import Schedule
from sala.engine.speculation import Speculation, Verified

INVARIANT_ROWS = 16


@dataclass
class StepOutput:
    """What a step's forward produced, by what it is for."""

    sampled: list[Request] = field(default_factory=list)  # requests that draw their next token now
    logits: torch.Tensor | None = None  # [len(sampled), V] fp32
    # Medusa: the heads' input at the sampled rows, to draft their next trees (None: a compiled
    # plain decode step, after which the requests keep their drafts)
    hidden: torch.Tensor | None = None
    prompt_targets: list[tuple[Request, int]] = field(default_factory=list)  # (request, prompt token it scores)
    prompt_logits: torch.Tensor | None = None  # [len(prompt_targets), V] fp32
    verified: Verified | None = None  # Medusa: the draft trees this step verified


class ModelRunner:
    def __init__(self, model, cache: CachePool, batch_invariant: bool = False, compile: bool = True,
                 max_decode_batch: int = 32, speculation: Speculation | None = None):
        self.model, self.cache, self.batch_invariant, self.speculation = model, cache, batch_invariant, speculation
        self.fast_decode = None
        if compile and not batch_invariant:
            self.fast_decode = CudaGraphDecode(self, max_decode_batch) if cache.device.type == "cuda" else CompiledDecode(self)

    @property
    def compile_seconds(self) -> float | None:
        """Seconds spent compiling (CPU) or capturing (CUDA) the fast paths so far; None before any."""
        steps = [self.fast_decode] + (self.speculation.compiled_steps if self.speculation else [])
        seconds = [s.seconds for s in steps if s is not None and s.seconds is not None]
        return sum(seconds) if seconds else None

    @torch.inference_mode()
    def run(self, batch: Schedule) -> StepOutput:
        """Advance the cache by the batch's tokens (a draft tree: by nothing until its commit)."""
        if batch.speculative and batch.decodes:
            tokens, ctx = self.speculation.tree_context(batch.decodes)
            if not batch.prefills and (verified := self.speculation.run_compiled(tokens, ctx, batch.decodes)):
                return StepOutput(verified=verified)
            return self._run_eager(batch, tokens.flatten(), ctx)
        ids, ctx = self.decode_context(batch.decodes)
        if self.fast_decode is not None and not batch.prefills and ctx.decode_prompt_lens is None:
            if (logits := self.fast_decode(ids, ctx)) is not None:
                return StepOutput(list(batch.decodes), logits)
        return self._run_eager(batch, ids, ctx)

    # ---------------------------------------------------------------- step contexts
    def decode_context(self, reqs: list[Request]) -> tuple[torch.Tensor, StepContext]:
        """Each request's next token at its next position, reading its pages."""
        cache, dev = self.cache, self.cache.device
        width = max((len(r.pages) for r in reqs), default=0)
        ctx = StepContext(cache, torch.tensor([r.num_computed for r in reqs], dtype=torch.long, device=dev),
                          torch.tensor([cache.row(r, r.num_computed) for r in reqs], dtype=torch.long, device=dev),
                          torch.tensor([r.pages + [cache.scratch_page] * (width - len(r.pages)) for r in reqs],
                                       dtype=torch.long, device=dev).view(len(reqs), width),
                          torch.tensor([r.num_computed + 1 for r in reqs], dtype=torch.long, device=dev),
                          torch.tensor([r.state_slot for r in reqs], dtype=torch.long, device=dev),
                          batch_invariant=self.batch_invariant)
        if self._sparse_decodes(reqs):  # InfLLM-v2 needs each prompt's length; such steps run eagerly
            ctx.decode_prompt_lens = [len(r.prompt_ids) for r in reqs]
        return torch.tensor([r.last_token for r in reqs], dtype=torch.long, device=dev), ctx

    def _sparse_decodes(self, reqs: list[Request]) -> bool:
        """Whether a decode row attends sparsely (InfLLM-v2)."""
        dense_len = self.model.config.sparse_config["dense_len"]
        return self.cache.compressed and any(sparse.call_length(r.num_computed, len(r.prompt_ids)) >= dense_len
                                             for r in reqs)

    def _run_eager(self, batch: Schedule, ids: torch.Tensor, ctx: StepContext) -> StepOutput:
        """The step through the eager forward: the decode (or tree) rows in `ids` / `ctx`, the
        batch's prompt chunks appended after them."""
        cache, dev, tree = self.cache, self.cache.device, ctx.tree
        lead = tree.num_rows if tree else len(batch.decodes)
        out = StepOutput(sampled=[] if tree else list(batch.decodes))
        prompt_ids, positions, slots = [], [], [ctx.slot_mapping]
        sample_rows, prompt_rows, row = list(range(len(out.sampled))), [], lead
        for r, start, end in batch.prefills:
            prompt_ids += r.token_slice(start, end)
            positions += range(start, end)
            slots.append(cache.rows(r, start, end))
            kv_rows = cache.rows(r, 0, end) if start or cache.compressed else None
            ctx.prefills.append(Span(row, end - start, start, r.state_slot, kv_rows, len(r.prompt_ids)))
            self._prompt_logprob_rows(r, start, end, row, prompt_rows, out.prompt_targets)
            row += end - start
            if end == r.num_tokens:
                sample_rows.append(row - 1)
                out.sampled.append(r)
        pad = -row % INVARIANT_ROWS if self.batch_invariant else 0
        slots.append(torch.full((pad,), cache.scratch_row, dtype=torch.long, device=dev))
        ids = torch.cat([ids, torch.tensor(prompt_ids + [0] * pad, dtype=torch.long, device=dev)])
        ctx.positions = torch.cat([ctx.positions, torch.tensor(positions + [0] * pad, dtype=torch.long, device=dev)])
        ctx.slot_mapping = torch.cat(slots)

        hidden, logits = self.forward(ids, ctx, list(range(lead if tree else 0)) + sample_rows + prompt_rows)
        first = lead if tree else 0
        n = len(out.sampled)
        out.logits, out.prompt_logits = logits[first : first + n], logits[first + n :]
        if self.speculation is not None:
            out.hidden = hidden[first : first + n]
        if tree:
            r = tree.num_requests
            out.verified = Verified(list(batch.decodes), ids[:lead].view(r, -1), ctx, logits[:lead].view(r, tree.num_nodes, -1),
                                    hidden[:lead].view(r, tree.num_nodes, -1))
        return out

    @staticmethod
    def _prompt_logprob_rows(r: Request, start: int, end: int, row: int, prompt_rows: list, targets: list) -> None:
        """Rows of this chunk whose logits score the next prompt token (position p scores token p + 1),
        each position once even when a preempted request recomputes its prompt."""
        if r.prompt_logprobs_next is None:
            return
        last = min(end, len(r.prompt_ids) - 1)
        for p in range(max(start, r.prompt_logprobs_next), last):
            prompt_rows.append(row + p - start)
            targets.append((r, r.prompt_ids[p + 1]))
        r.prompt_logprobs_next = max(r.prompt_logprobs_next, last)

    # ---------------------------------------------------------------- the forward
    def forward(self, ids: torch.Tensor, ctx: StepContext, rows: list[int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The heads' input (final hidden / muP logit divisor) and fp32 logits of `rows` (all
        when None). In the batch-invariant mode the rows read back are padded to a multiple of 16
        too, so that lm_head sees the same blocks whatever else is read."""
        hidden = self.model.model(ids[None], step=ctx)[0]
        n = hidden.shape[0] if rows is None else len(rows)
        if rows is not None:
            pad = -n % INVARIANT_ROWS if self.batch_invariant else 0
            hidden = hidden[torch.tensor(rows + [0] * pad, dtype=torch.long, device=hidden.device)]  # may be empty
        hidden = hidden / self.model.config.logit_divisor
        return hidden[:n], self.model.lm_head(hidden).float()[:n]
