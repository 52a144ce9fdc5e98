"""One engine step through the model: every scheduled token of every request as one flat batch.

The linear parts of each layer (projections, MLP, norms) run once over all rows; only the
mixers look at which request a row belongs to: decode rows attend (sparse layers) or update
the state (lightning layers) together as a batch, each prompt chunk on its own against its
request's cached K/V or state. Layer math comes from the model's own `project`, `attend` and
`finish`; this file only decides where K/V and states come from and go to.

Batch invariance: MKL runs matmuls with fewer than 8 rows through a different kernel whose
sums round differently, so a request's logits would depend on how many others share its step.
Padding every matmul to at least `min_rows` rows keeps each row on the same kernel whatever
the batch, as it is in the model's own full forward over a prompt.
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
    decode_kv_slots: torch.Tensor  # [n_decode, longest context]
    decode_kv_mask: torch.Tensor  # [n_decode, 1, 1, longest context]
    decode_state_slots: torch.Tensor  # [n_decode]
    spans: list[tuple[Request, int, int, int]]  # prompt chunks: (request, first row, end row, first position)
    sample_rows: list[int]  # rows whose next-token logits are needed
    sampled: list[Request]  # the request of each sample row


class ModelRunner:
    def __init__(self, model, cache: CachePool, min_rows: int = 8):
        self.model, self.cache, self.min_rows = model, cache, min_rows
        self.device = cache.device

    def prepare(self, sched: Schedule) -> StepInputs:
        dec = sched.decodes
        ids = [r.output_ids[-1] for r in dec]
        pos = [r.num_computed for r in dec]
        slots = [r.slots[r.num_computed : r.num_computed + 1] for r in dec]
        spans, sample_rows, sampled = [], list(range(len(dec))), list(dec)
        row = len(dec)
        for r, start, end in sched.prefills:
            ids += r.prompt_ids[start:end]
            pos += range(start, end)
            slots.append(r.slots[start:end])
            spans.append((r, row, row + end - start, start))
            row += end - start
            if end == len(r.prompt_ids):
                sample_rows.append(row - 1)
                sampled.append(r)
        pad = max(0, self.min_rows - row)
        lengths = torch.tensor([p + 1 for p in pos[: len(dec)]], device=self.device)
        kv_slots = pad_sequence([r.slots[: r.num_computed + 1] for r in dec], batch_first=True) if dec else None
        return StepInputs(
            input_ids=torch.tensor(ids + [0] * pad, device=self.device),
            positions=torch.tensor(pos + [0] * pad, device=self.device)[None],
            n_real=row,
            write_slots=torch.cat(slots),
            decode_kv_slots=kv_slots,
            decode_kv_mask=None if kv_slots is None else
            (torch.arange(kv_slots.shape[1], device=self.device) < lengths[:, None])[:, None, None],
            decode_state_slots=torch.tensor([r.state_slot for r in dec], device=self.device),
            spans=spans,
            sample_rows=sample_rows,
            sampled=sampled,
        )

    @torch.inference_mode()
    def run(self, sched: Schedule) -> tuple[list[Request], torch.Tensor]:
        """Advance the cache by the scheduled tokens; returns (requests to sample, fp32 logits)."""
        step = self.prepare(sched)
        m = self.model.model
        h = m.embed_tokens(step.input_ids)[None] * self.model.config.scale_emb
        for i, layer in enumerate(m.layers):
            x = layer.input_layernorm(h)
            mix = self._lightning if layer.is_lightning else self._sparse
            h = h + mix(layer.self_attn, i, x, step) * layer.residual_scale
            h = h + layer.mlp(layer.post_attention_layernorm(h)) * layer.residual_scale
        n = len(step.sample_rows)
        rows = step.sample_rows + [0] * max(0, self.min_rows - n)
        return step.sampled, self.model.logits(m.norm(h[0, rows]))[:n]

    def _sparse(self, attn, i: int, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        q, k, v = attn.project(x, step.positions)  # q [1, Hq, rows, D]; k, v [1, Hkv, rows, D]
        n, d = step.n_real, len(step.decode_state_slots)
        self.cache.write_kv(i, step.write_slots, k[0, :, :n].transpose(0, 1), v[0, :, :n].transpose(0, 1))
        out = q.new_zeros(q.shape[2], q.shape[1], q.shape[3])  # [rows, Hq, D]
        gqa = attn.n_heads != attn.n_kv
        if d:
            kd, vd = self.cache.read_kv(i, step.decode_kv_slots)
            qd = q[0, :, :d].transpose(0, 1)[:, :, None]
            out[:d] = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=step.decode_kv_mask, enable_gqa=gqa)[:, :, 0]
        for r, a, b, past in step.spans:
            kp, vp = self.cache.read_kv(i, r.slots[None, : past + b - a])
            mask = causal_mask(b - a, past + b - a, past, None, x.device)
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
