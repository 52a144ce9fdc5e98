"""One engine step through the model: a Schedule in, a StepOutput out.

A step runs all its tokens as one row through one forward, `model.model(ids, step=ctx)`: first
the decoding requests' rows (what the step's decoding puts there: one token each, or Medusa's
draft trees; sala/engine/decoding.py), then the prompt chunks. The StepContext
(sala/engine/context.py) says what each row is; the model's mixers hand it their q, k, v and
it runs their paged step. Which rows are read back is the StepOutput: the decode rows, the rows
that end a prompt (each samples its first token), the rows that score prompt tokens. Nothing
else needs to know the row order. A step with no prompt chunk may run through the decoding's
compiled graph instead (sala/engine/graphs.py).

The evaluation mode (`batch_invariant`, docs/design/batch-invariance.md) makes a request's
logits independent of what shares its step and of where its prompt was cut into chunks. Three
things would make them depend on it on CPU: a GEMM computes a matmul's rows in blocks (MKL's
AVX-512 kernels 4 rows, AMX tiles 16: measured on a Sapphire Rapids core, 8 rows was not
enough) and the rows left over after the last full block through a kernel whose sums round
differently, so the mode pads every step to a multiple of 16 rows; the chunked lightning form
sums in blocks counted from the start of each call, so the scheduler cuts prompts only at
multiples of that block (lightning.CHUNK_SIZE) and the mode runs each request's prompt chunk as
its own call, never as one padded batch (whose final states come from a different formula);
and compiled kernels are generated per shape, so the mode never compiles. Attention over pages
padded to the batch's widest needs nothing: masked keys add exact zeros
(tests/engine/test_engine.py checks all of it bitwise).
"""
from __future__ import annotations

import torch

from sala.engine.cache import CachePool
from sala.engine.config import EngineConfig
from sala.engine.context import Span, StepContext
from sala.engine.decoding import StepOutput
from sala.engine.request import Request
from sala.engine.scheduler import Schedule

INVARIANT_ROWS = 16


class ModelRunner:
    def __init__(self, config: EngineConfig, model, cache: CachePool):
        self.model, self.cache, self.batch_invariant = model, cache, config.batch_invariant

    @torch.inference_mode()
    def run(self, batch: Schedule) -> StepOutput:
        """Advance the cache by the batch's tokens (a draft tree's: by nothing until its commit)."""
        ids, ctx = batch.decoding.inputs(batch.decodes)
        if not batch.prefills and (out := batch.decoding.run_compiled(ids, ctx, batch.decodes)) is not None:
            return out
        return self._run_eager(batch, ids, ctx)

    def _run_eager(self, batch: Schedule, ids: torch.Tensor, ctx: StepContext) -> StepOutput:
        """The step through the eager forward: the decode rows in `ids` / `ctx`, the batch's
        prompt chunks appended after them."""
        cache, dev = self.cache, self.cache.device
        lead = ids.shape[0]
        out = StepOutput(ids, ctx)
        prompt_ids, positions, slots = [], [], [ctx.slot_mapping]
        sample_rows, prompt_rows, row = [], [], lead
        for r, start, end in batch.prefills:
            prompt_ids += r.token_slice(start, end)
            positions += range(start, end)
            slots.append(cache.rows(r, start, end))
            kv_rows = cache.rows(r, 0, end) if start or cache.compressed else None
            ctx.prefills.append(Span(start=row, length=end - start, past=start, state_slot=r.state_slot, kv_rows=kv_rows,
                                     prompt_len=len(r.prompt_ids)))
            self._prompt_logprob_rows(r, start, end, row, prompt_rows, out.prompt_targets)
            row += end - start
            if end == r.num_tokens:
                sample_rows.append(row - 1)
                out.sampled.append(r)
        pad = -row % INVARIANT_ROWS if self.batch_invariant else 0
        slots.append(torch.full((pad,), cache.scratch_row, dtype=torch.long, device=dev))
        step_ids = torch.cat([ids, torch.tensor(prompt_ids + [0] * pad, dtype=torch.long, device=dev)])
        ctx.positions = torch.cat([ctx.positions, torch.tensor(positions + [0] * pad, dtype=torch.long, device=dev)])
        ctx.slot_mapping = torch.cat(slots)

        hidden, logits = self.forward(step_ids, ctx, list(range(lead)) + sample_rows + prompt_rows)
        n = lead + len(out.sampled)
        out.decoded, out.logits, out.prompt_logits = logits[:lead], logits[lead:n], logits[n:]
        if batch.decoding.drafts:
            out.decoded_hidden, out.hidden = hidden[:lead], hidden[lead:n]
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
