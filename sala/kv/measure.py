"""Calibration and measurement of cache plans on held-out windows.

`calibrate_amax`: max |K| and |V| per sparse layer and kv head over calibration windows (what
FP8 scales and NVFP4 global scales are built from, sala/kv/formats.py).

`plan_logprobs`: the model's next-token log-probabilities over a cache stored as a plan says,
in the shape serving uses it: each window's first `prefix` tokens are prefilled, then the rest
are fed one decode step at a time (teacher-forced), so quantized K/V are what later tokens
attend to and a bf16 state is rounded after every token, as in the engine. `measure_plan`
compares those against the unquantized cache's with sala.eval.compare (mean KL, top-1
agreement, perplexity).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sala.eval.compare import compare_logprobs
from sala.kv.plan import KVPlan, apply_to_model


@torch.no_grad()
def calibrate_amax(model, windows: torch.Tensor, batch_size: int = 8) -> dict[int, dict[str, list[float]]]:
    seen: dict[int, list[torch.Tensor]] = {}

    def observer(i):
        def observe(k, v):  # [B, H, T, D]
            amax = torch.stack([k.detach().float().abs().amax((0, 2, 3)), v.detach().float().abs().amax((0, 2, 3))])
            seen[i] = [torch.maximum(seen[i][0], amax)] if i in seen else [amax]
            return k, v
        return observe

    layers = [(i, layer.self_attn) for i, layer in enumerate(model.model.layers) if not layer.is_lightning]
    saved = [attn.kv_quant for _, attn in layers]
    try:
        for i, attn in layers:
            attn.kv_quant = observer(i)
        for b in range(0, len(windows), batch_size):
            model(windows[b : b + batch_size], use_cache=False)
    finally:
        for (_, attn), s in zip(layers, saved):
            attn.kv_quant = s
    return {i: {"k": a[0][0].tolist(), "v": a[0][1].tolist()} for i, a in seen.items()}


@torch.no_grad()
def plan_logprobs(model, windows: torch.Tensor, plan: KVPlan | None, prefix: int, batch_size: int = 8) -> torch.Tensor:
    """[N, T - prefix, V] fp32 log-probabilities of tokens prefix .. T-1 of windows [N, T]."""
    apply_to_model(model, plan)
    try:
        out = []
        for b in range(0, len(windows), batch_size):
            w = windows[b : b + batch_size]
            cache = model.new_cache()
            logits = [model(w[:, :prefix], past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]]
            for t in range(prefix, w.shape[1] - 1):
                logits.append(model(w[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
            out.append(F.log_softmax(torch.stack(logits, 1).float(), -1))
        return torch.cat(out)
    finally:
        apply_to_model(model, None)


def measure_plan(model, windows: torch.Tensor, plan: KVPlan, reference: torch.Tensor, prefix: int) -> dict[str, float]:
    """Mean KL to `reference` (plan_logprobs with no plan), top-1 agreement, perplexity."""
    return compare_logprobs(reference, plan_logprobs(model, windows, plan, prefix), windows[:, prefix:])
