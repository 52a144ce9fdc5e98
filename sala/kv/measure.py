"""Calibration and measurement of cache plans on held-out windows.

`calibrate_amax`: max |K| and |V| per sparse layer and kv head over calibration windows (what
FP8 scales and NVFP4 global scales are built from, sala/kv/formats.py).

`plan_logprobs`: the model's next-token log-probabilities over a cache stored as a plan says,
in the shape serving uses it: each window's first `prefix` tokens are prefilled, then the rest
are fed one decode step at a time (teacher-forced), so quantized K/V are what later tokens
attend to and a bf16 state is rounded after every token, as in the engine. They come a batch of
windows at a time and are reduced to what is kept before the next batch, so a measurement holds
one batch's [BATCH, T - prefix, V] fp32 log-probs whatever the number of windows
(`measure_bytes`: at the 9B's 73,448 ids and 65 positions, 0.43 GiB).

The damage is scored by sala.eval.logprob, the same metrics the logprob evaluation reports for
any model or server: `reference_baseline` keeps the unquantized cache's top-256 at every
measured position as a logprob Baseline (small enough to ship to every ablation task), and
`measure_plan` scores a plan's top-256 against it (mean KL, flips, cosine, covered mass) and
adds the perplexity of the tokens that followed.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from sala.eval import logprob as lp
from sala.footprint import forward_bytes
from sala.kv.plan import KVPlan, apply_to_model

BATCH = 8  # windows a forward runs at once


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
def calibrate_amax(model, windows: torch.Tensor, batch_size: int = BATCH) -> dict[int, dict[str, list[float]]]:
    seen: dict[int, list[torch.Tensor]] = {}
    layers = [(i, layer.self_attn) for i, layer in enumerate(model.model.layers) if not layer.is_lightning]
    saved = [attn.kv_quant for _, attn in layers]
    try:
        for i, attn in layers:
            attn.kv_quant = amax_observer(seen, i)
        for b in range(0, len(windows), batch_size):
            model(windows[b : b + batch_size], use_cache=False, logits_to_keep=1)  # K/V are observed; logits unused
    finally:
        for (_, attn), s in zip(layers, saved):
            attn.kv_quant = s
    return amax_table(seen)


@torch.no_grad()
def plan_logprobs(model, windows: torch.Tensor, plan: KVPlan | None, prefix: int,
                  batch_size: int = BATCH) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """For each batch of windows [b, T] (of windows [N, T]): the batch and the [b, T - prefix, V]
    fp32 log-probabilities of its tokens prefix .. T-1."""
    apply_to_model(model, plan)
    try:
        for b in range(0, len(windows), batch_size):
            w = windows[b : b + batch_size]
            cache = model.new_cache()
            logits = [model(w[:, :prefix], past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]]
            for t in range(prefix, w.shape[1] - 1):
                logits.append(model(w[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
            yield w, F.log_softmax(torch.stack(logits, 1).float(), -1)
    finally:
        apply_to_model(model, None)


def _top(logprobs: torch.Tensor, top_k: int) -> list[lp.TopLogprobs]:
    """[N, P, V] -> each window's top-k rows, as a logprob source reports them."""
    values, ids = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
    return [lp.TopLogprobs(i.numpy().astype(np.int32), v.numpy()) for i, v in zip(ids, values)]


def _scored(model, windows: torch.Tensor, plan: KVPlan | None, prefix: int, top_k: int):
    """What is kept of a plan's log-probabilities: each window's top-k rows, the log-probabilities
    of the tokens that followed [N, T - prefix] and the vocabulary size."""
    tops, followed, vocab = [], [], 0
    for w, logprobs in plan_logprobs(model, windows, plan, prefix):
        tops += _top(logprobs, top_k)
        followed.append(logprobs.gather(-1, w[:, prefix:, None])[..., 0].double().numpy())
        vocab = logprobs.shape[-1]
    return tops, np.concatenate(followed), vocab


def reference_baseline(model, windows: torch.Tensor, prefix: int, top_k: int = lp.TOP_K,
                       name: str = "unquantized cache") -> lp.Baseline:
    """The unquantized cache's predictions of tokens prefix .. T-1 of windows [N, T] as a logprob
    Baseline: window i is sequence i, scored from token `prefix`; meta["ppl"] its perplexity."""
    tops, followed, vocab = _scored(model, windows, None, prefix, top_k)
    n, length = windows.shape
    return lp.Baseline([w.numpy().astype(np.int32) for w in windows], np.full(n, prefix), np.full(n, prefix),
                       np.concatenate([t.ids for t in tops]), np.concatenate([t.logprobs for t in tops]),
                       {"model": name, "vocab_size": vocab, "top_k": tops[0].ids.shape[1],
                        "positions": length - prefix, "ppl": lp.perplexity(followed)})


def measure_plan(model, windows: torch.Tensor, plan: KVPlan, reference: lp.Baseline, prefix: int) -> dict[str, float]:
    """A plan's damage against `reference` (reference_baseline of the same windows): the logprob
    evaluation's summary (kl_mean, flip_rate, cosine_mean, ...), top-1 agreement, perplexity."""
    tops, followed, _ = _scored(model, windows, plan, prefix, reference.top_ids.shape[1])
    summary = lp.score(reference, tops).summary()
    return summary | {"top1_agreement": 1.0 - summary["flip_rate"], "ppl": lp.perplexity(followed),
                      "ppl_reference": reference.meta["ppl"]}


# ------------------------------------------------------------------------------ memory
def measure_bytes(config, windows: int, length: int, prefix: int, dtype: torch.dtype) -> dict[str, int]:
    """What reference_baseline or measure_plan holds at its peak over `windows` windows of
    `length` tokens, by part: a batch's log-probs (each step's fp32 logits, then stacked, then
    their log-softmax: 12 bytes a vocabulary entry of each position), its cache (an fp32 state
    per lightning layer, fp32 K/V per sparse layer at most), the prefill's activations, and the
    top-k rows kept of every window (int32 ids and fp32 log-probs)."""
    rows, positions = min(windows, BATCH), length - prefix
    state = len(config.lightning_layers) * config.lightning_nh * config.lightning_head_dim**2 * 4
    kv = len(config.sparse_layers) * 2 * config.num_key_value_heads * config.head_dim * 4 * length
    return {"log-probs": rows * positions * config.vocab_size * 12, "cache": rows * (state + kv),
            "activations": forward_bytes(config, rows, prefix, dtype), "top-k rows": windows * positions * lp.TOP_K * 8}


def calibrate_bytes(config, windows: int, length: int, dtype: torch.dtype) -> dict[str, int]:
    """What calibrate_amax holds at its peak: a batch's forward of `length` tokens (logits of the last token only)."""
    return {"activations": forward_bytes(config, min(windows, BATCH), length, dtype)}
