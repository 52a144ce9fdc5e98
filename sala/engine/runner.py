"""One engine step through the model: every scheduled token of every request as one flat batch.

The linear parts of each layer (projections, MLP, norms) run once over all rows; only the
mixers look at which request a row belongs to: decode rows attend (sparse layers) or update
the state (lightning layers) together as a batch, each prompt chunk on its own against its
request's cached K/V or state. Layer math comes from the model's own `project`, `attend` and
`finish`; this file only decides where K/V and states come from and go to.

Batch invariance (engine.md, Determinism), on by default: a request's logits must not depend
on what else shares its step. Two reductions would make them depend on it on CPU: MKL computes
a matmul's rows in blocks of 4 and, in small matmuls, the rows left over after the last full
block through a kernel whose sums round differently; and attention
over keys padded to the batch's longest context sums in a different order than over the
request's own keys. So every matmul is padded to a multiple of 8 rows, and decode attention runs
per request on its exact context. `batch_invariant=False` batches decode attention over padded
keys instead (tests/test_engine.py prints the logprob difference this makes). Padding to a
multiple of 8 rows also covers CPUs whose GEMM kernels work on 8-row blocks. Where a prompt
is split into chunks depends on the token budget and the load, so exactness holds for prompts
prefilled in one step (chunk boundaries move rounding, not results beyond it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from sala.engine.cache import CachePool
from sala.engine.request import Request
from sala.engine.scheduler import Schedule
from sala.model import causal_mask


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [rows]; rows beyond n_real are padding
    positions: torch.Tensor  # [1, rows]
    n_real: int
    write_slots: torch.Tensor  # [n_real] KV-pool row of each real token
    decode_kv_slots: torch.Tensor | None  # [n_decode, longest context], when decode attention is batched
    decode_kv_mask: torch.Tensor | None  # [n_decode, 1, 1, longest context]
    decode_state_slots: torch.Tensor  # [n_decode]
    spans: list[tuple[Request, int, int, int]]  # prompt chunks: (request, first row, end row, first position)
    decode_spans: list[tuple[Request, int, int, int]]  # decode rows as one-token spans, when attended per request
    sample_rows: list[int]  # rows whose next-token logits are sampled from
    sampled: list[Request]  # the request of each sample row
    prompt_rows: list[int]  # rows whose logits score the next prompt token (prompt logprobs)
    prompt_targets: list[tuple[Request, int]]  # (request, that next prompt token) of each prompt row


class ModelRunner:
    def __init__(self, model, cache: CachePool, batch_invariant: bool = True):
        self.model, self.cache, self.batch_invariant = model, cache, batch_invariant
        self.row_multiple = 8 if batch_invariant else 1
        self.device = cache.device

    def _padding(self, rows: int) -> int:
        return -rows % self.row_multiple

    def prepare(self, sched: Schedule) -> StepInputs:
        dec = sched.decodes
        ids = [r.output_ids[-1] for r in dec]
        pos = [r.num_computed for r in dec]
        slots = [r.slots[r.num_computed : r.num_computed + 1] for r in dec]
        spans, sample_rows, sampled, prompt_rows, prompt_targets = [], list(range(len(dec))), list(dec), [], []
        row = len(dec)
        for r, start, end in sched.prefills:
            ids += r.prompt_ids[start:end]
            pos += range(start, end)
            slots.append(r.slots[start:end])
            spans.append((r, row, row + end - start, start))
            if r.params.prompt_logprobs_start is not None:
                # position p's logits score prompt token p + 1
                first = max(start, r.params.prompt_logprobs_start - 1)
                for p in range(first, min(end, len(r.prompt_ids) - 1)):
                    prompt_rows.append(row + p - start)
                    prompt_targets.append((r, r.prompt_ids[p + 1]))
            row += end - start
            if end == len(r.prompt_ids):
                sample_rows.append(row - 1)
                sampled.append(r)
        pad = self._padding(row)
        kv_slots = kv_mask = None
        if dec and not self.batch_invariant:
            lengths = torch.tensor([p + 1 for p in pos[: len(dec)]], device=self.device)
            kv_slots = pad_sequence([r.slots[: r.num_computed + 1] for r in dec], batch_first=True)
            kv_mask = (torch.arange(kv_slots.shape[1], device=self.device) < lengths[:, None])[:, None, None]
        return StepInputs(
            input_ids=torch.tensor(ids + [0] * pad, device=self.device),
            positions=torch.tensor(pos + [0] * pad, device=self.device)[None],
            n_real=row,
            write_slots=torch.cat(slots),
            decode_kv_slots=kv_slots,
            decode_kv_mask=kv_mask,
            decode_state_slots=torch.tensor([r.state_slot for r in dec], device=self.device),
            spans=spans,
            decode_spans=[] if kv_slots is not None else [(r, i, i + 1, r.num_computed) for i, r in enumerate(dec)],
            sample_rows=sample_rows,
            sampled=sampled,
            prompt_rows=prompt_rows,
            prompt_targets=prompt_targets,
        )

    @torch.inference_mode()
    def run(self, sched: Schedule) -> tuple[StepInputs, torch.Tensor]:
        """Advance the cache by the scheduled tokens; returns the step and fp32 logits of its
        sample rows followed by its prompt rows."""
        step = self.prepare(sched)
        m = self.model.model
        h = m.embed_tokens(step.input_ids)[None] * self.model.config.scale_emb
        for i, layer in enumerate(m.layers):
            x = layer.input_layernorm(h)
            mix = self._lightning if layer.is_lightning else self._sparse
            h = h + mix(layer.self_attn, i, x, step) * layer.residual_scale
            h = h + layer.mlp(layer.post_attention_layernorm(h)) * layer.residual_scale
        rows = step.sample_rows + step.prompt_rows
        n = len(rows)
        return step, self.model.logits(m.norm(h[0, rows + [0] * self._padding(n)]))[:n]

    def _sparse(self, attn, i: int, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        q, k, v = attn.project(x, step.positions)  # q [1, Hq, rows, D]; k, v [1, Hkv, rows, D]
        n, d = step.n_real, len(step.decode_state_slots)
        self.cache.write_kv(i, step.write_slots, k[0, :, :n].transpose(0, 1), v[0, :, :n].transpose(0, 1))
        out = q.new_zeros(q.shape[2], q.shape[1], q.shape[3])  # [rows, Hq, D]
        gqa = attn.n_heads != attn.n_kv
        if step.decode_kv_slots is not None:
            kd, vd = self.cache.read_kv(i, step.decode_kv_slots)
            qd = q[0, :, :d].transpose(0, 1)[:, :, None]
            out[:d] = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=step.decode_kv_mask, enable_gqa=gqa)[:, :, 0]
        for r, a, b, past in step.decode_spans + step.spans:
            kp, vp = self.cache.read_kv(i, r.slots[None, : past + b - a])
            mask = causal_mask(b - a, past + b - a, past, None, x.device) if b - a > 1 else None  # one query sees all
            o = F.scaled_dot_product_attention(q[:, :, a:b], kp, vp, attn_mask=mask, enable_gqa=gqa)
            out[a:b] = o[0].transpose(0, 1)
        return attn.finish(out.reshape(1, out.shape[0], -1), x)

    def _lightning(self, attn, i: int, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        q, k, v = attn.project(x, step.positions)  # fp32 [1, H, rows, D]
        d = len(step.decode_state_slots)
        out = torch.zeros_like(q)
        if d:
            slots = step.decode_state_slots
            o, s = attn.attend(*(t[0, :, :d].transpose(0, 1)[:, :, None] for t in (q, k, v)), self.cache.read_state(i, slots))
            out[0, :, :d] = o[:, :, 0].transpose(0, 1)
            self.cache.write_state(i, slots, s)
        for r, a, b, past in step.spans:
            slot = torch.tensor([r.state_slot], device=x.device)
            state = self.cache.read_state(i, slot) if past else None
            o, s = attn.attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], state)
            out[:, :, a:b] = o
            self.cache.write_state(i, slot, s)
        return attn.finish(out, x)
