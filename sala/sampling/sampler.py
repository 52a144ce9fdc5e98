"""Next tokens from logits for a whole step at once: the requests' logits controls first
(controls.py: logit_bias, min_tokens, penalties), then greedy rows by argmax, sampled
rows through temperature, min-p, top-k and top-p as batched tensor ops, then one inverse-CDF
draw per row.

Each sampling request owns a CPU torch.Generator seeded once and draws one uniform a step
from it, whatever device the logits are on: a seed gives the same tokens on CPU and CUDA (for
equal logits) and whatever else shares the step. Reported logprobs are those of the model's
own distribution (log_softmax of the raw logits, before temperature and truncation), as vLLM
and the OpenAI API report them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sala.sampling.controls import adjust_logits
from sala.sampling.params import SamplingParams, Sequence


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely (token id, logprob), most likely first


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [n, V] -> probabilities [n, V] after each row's temperature, min-p, top-k and top-p."""
    dev, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], device=dev, dtype=logits.dtype)
    logits = logits / temperature[:, None]
    if any(p.min_p > 0 for p in params):
        # p(token) < min_p * p(most likely)  <=>  logit < max logit + log(min_p)   (vLLM applies it before top-k/p)
        floor = torch.tensor([math.log(p.min_p) if p.min_p > 0 else float("-inf") for p in params], device=dev,
                             dtype=logits.dtype)
        logits = logits.masked_fill(logits < logits.max(-1, keepdim=True).values + floor[:, None], float("-inf"))
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        k = torch.tensor(top_k, device=dev)
        kth = logits.topk(max(top_k), dim=-1).values.gather(1, (k - 1).clamp(min=0)[:, None])
        kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.top_p < 1 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=probs.dtype)[:, None]
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is short of top_p.
        drop = ((sorted_probs.cumsum(-1) - sorted_probs) >= top_p) & (top_p < 1)
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [n, V], u [n] float64 uniforms -> the first token of each row whose cumulative mass
    exceeds u * total: tokens of zero mass are never drawn."""
    cdf = probs.double().cumsum(-1)
    drawn = torch.searchsorted(cdf, (u.to(cdf.device) * cdf[:, -1])[:, None], right=True)[:, 0]
    return drawn.clamp(max=probs.shape[-1] - 1)


def sample(logits: torch.Tensor, requests: list[Sequence], eos_ids: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """logits [n, V] fp32, one row per request -> the next token of each (eos_ids: what min_tokens holds back)."""
    logits = adjust_logits(logits, requests, eos_ids)
    # max's indices are argmax's (the first maximum of a row), at a third of its time on CPU (measured at 64 x 2048).
    tokens = logits.max(-1).indices
    rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        probs = filtered_probs(logits[index], [requests[i].params for i in rows])
        tokens[index] = inverse_cdf(probs, uniforms([requests[i] for i in rows]))
    return tokens.tolist()


def uniforms(requests: list[Sequence]) -> torch.Tensor:
    """[n] float64: the next uniform of each request's generator (a request draws one a step)."""
    return torch.cat([torch.rand(1, generator=r.generator, dtype=torch.float64) for r in requests])


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_k: list[int]) -> list[TokenLogprob]:
    """Row i: the logprob of tokens[i] under log_softmax(logits[i]) and the top_k[i] most likely."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits, dim=-1)
    k = max(top_k)
    top_lp, top_ids = lp.topk(k, dim=-1)
    chosen = lp[torch.arange(len(tokens), device=lp.device), torch.tensor(tokens, device=lp.device)].tolist()
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    return [TokenLogprob(t, c, list(zip(top_ids[i][:n], top_lp[i][:n])))
            for i, (t, c, n) in enumerate(zip(tokens, chosen, top_k))]
