"""Quality of a compressed model against its reference on held-out text: perplexity of both,
and the per-token divergence of the candidate's next-token distribution from the reference's
(mean KL(P_ref || P_cand) over the full vocabulary, top-1 agreement). KL sees changes that
perplexity averages away ("Accuracy is not all you need", Dutta et al. 2024)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def window_sequences(stream: torch.Tensor, seq_len: int, max_sequences: int | None = None) -> torch.Tensor:
    """Non-overlapping [N, seq_len + 1] windows (inputs plus the next-token targets)."""
    n = (len(stream) - 1) // seq_len
    if max_sequences is not None:
        n = min(n, max_sequences)
    return torch.stack([stream[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)])


@torch.no_grad()
def compare_models(reference, candidate, windows: torch.Tensor, batch_size: int = 8) -> dict[str, float]:
    sums: dict[str, float] = {}
    for i in range(0, len(windows), batch_size):
        w = windows[i : i + batch_size]
        x, y = w[:, :-1], w[:, 1:]
        lp_ref = F.log_softmax(reference(x, use_cache=False).logits.float(), -1)
        lp_cand = F.log_softmax(candidate(x, use_cache=False).logits.float(), -1)
        for k, v in divergence_sums(lp_ref, lp_cand, y).items():
            sums[k] = sums.get(k, 0.0) + v
    return finish(sums)


def divergence_sums(lp_ref: torch.Tensor, lp_cand: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    return {
        "nll_ref": -lp_ref.gather(-1, targets[..., None]).sum().item(),
        "nll": -lp_cand.gather(-1, targets[..., None]).sum().item(),
        "kl": (lp_ref.exp() * (lp_ref - lp_cand)).sum(-1).sum().item(),
        "agree": (lp_ref.argmax(-1) == lp_cand.argmax(-1)).sum().item(),
        "count": targets.numel(),
    }


def finish(sums: dict[str, float]) -> dict[str, float]:
    count = sums["count"]
    return {
        "ppl_reference": math.exp(sums["nll_ref"] / count),
        "ppl": math.exp(sums["nll"] / count),
        "kl_mean": sums["kl"] / count,
        "top1_agreement": sums["agree"] / count,
        "tokens": count,
    }
