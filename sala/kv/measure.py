"""Calibration and measurement of cache plans on held-out windows.

`calibrate_amax`: max |K| and |V| per sparse layer and kv head over calibration windows (what
FP8 scales and NVFP4 global scales are built from, sala/kv/formats.py).

`plan_logprobs`: the model's next-token log-probabilities over a cache stored as a plan says,
in the shape serving uses it: each window's first `prefix` tokens are prefilled, then the rest
are fed one decode step at a time (teacher-forced), so quantized K/V are what later tokens
attend to and a bf16 state is rounded after every token, as in the engine.

The damage is scored by sala.eval.logprob, the same metrics the logprob evaluation reports for
any model or server: `reference_baseline` keeps the unquantized cache's top-256 at every
measured position as a logprob Baseline (small enough to ship to every ablation task), and
`measure_plan` scores a plan's top-256 against it (mean KL, flips, cosine, covered mass) and
adds the perplexity of the tokens that followed.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from sala.eval import logprob as lp
from sala.kv.plan import KVPlan, apply_to_model


def amax_observer(seen: dict[int, list[torch.Tensor]], layer: int):
    """A sparse attention's kv_quant hook that keeps the running max |K| and |V| per kv head of `layer` in `seen`."""
    def observe(k, v):  # [B, H, T, D]
        amax = torch.stack([k.detach().float().abs().amax((0, 2, 3)), v.detach().float().abs().amax((0, 2, 3))])
        seen[layer] = [torch.maximum(seen[layer][0], amax)] if layer in seen else [amax]
        return k, v
    return observe


def amax_table(seen: dict[int, list[torch.Tensor]]) -> dict[int, dict[str, list[float]]]:
    """What amax observers saw, as a KVPlan keeps it."""
    return {i: {"k": a[0][0].tolist(), "v": a[0][1].tolist()} for i, a in seen.items()}


@torch.no_grad()
def calibrate_amax(model, windows: torch.Tensor, batch_size: int = 8) -> dict[int, dict[str, list[float]]]:
    seen: dict[int, list[torch.Tensor]] = {}
    layers = [(i, layer.self_attn) for i, layer in enumerate(model.model.layers) if not layer.is_lightning]
    saved = [attn.kv_quant for _, attn in layers]
    try:
        for i, attn in layers:
            attn.kv_quant = amax_observer(seen, i)
        for b in range(0, len(windows), batch_size):
            model(windows[b : b + batch_size], use_cache=False)
    finally:
        for (_, attn), s in zip(layers, saved):
            attn.kv_quant = s
    return amax_table(seen)


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


def _top(logprobs: torch.Tensor, top_k: int) -> list[lp.TopLogprobs]:
    """[N, P, V] -> each window's top-k rows, as a logprob source reports them."""
    values, ids = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
    return [lp.TopLogprobs(i.numpy().astype(np.int32), v.numpy()) for i, v in zip(ids, values)]


def _token_logprobs(logprobs: torch.Tensor, windows: torch.Tensor, prefix: int) -> np.ndarray:
    return logprobs.gather(-1, windows[:, prefix:, None])[..., 0].double().numpy()


def reference_baseline(model, windows: torch.Tensor, prefix: int, top_k: int = lp.TOP_K,
                       name: str = "unquantized cache") -> lp.Baseline:
    """The unquantized cache's predictions of tokens prefix .. T-1 of windows [N, T] as a logprob
    Baseline: window i is sequence i, scored from token `prefix`; meta["ppl"] its perplexity."""
    full = plan_logprobs(model, windows, None, prefix)
    tops = _top(full, top_k)
    n, length = windows.shape
    return lp.Baseline([w.numpy().astype(np.int32) for w in windows], np.full(n, prefix), np.full(n, prefix),
                       np.concatenate([t.ids for t in tops]), np.concatenate([t.logprobs for t in tops]),
                       {"model": name, "vocab_size": full.shape[-1], "top_k": tops[0].ids.shape[1],
                        "positions": length - prefix, "ppl": lp.perplexity(_token_logprobs(full, windows, prefix))})


def measure_plan(model, windows: torch.Tensor, plan: KVPlan, reference: lp.Baseline, prefix: int) -> dict[str, float]:
    """A plan's damage against `reference` (reference_baseline of the same windows): the logprob
    evaluation's summary (kl_mean, flip_rate, cosine_mean, ...), top-1 agreement, perplexity."""
    full = plan_logprobs(model, windows, plan, prefix)
    summary = lp.score(reference, _top(full, reference.top_ids.shape[1])).summary()
    return summary | {"top1_agreement": 1.0 - summary["flip_rate"], "ppl": lp.perplexity(_token_logprobs(full, windows, prefix)),
                      "ppl_reference": reference.meta["ppl"]}
