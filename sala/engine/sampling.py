"""Next tokens from logits: greedy, or temperature / top-k / top-p sampling with a per-request seed.

Each sampling request owns a torch.Generator seeded once, so a seeded request draws the same
tokens whatever else shares its steps. Reported logprobs are those of the model's own
distribution (log_softmax of the raw logits, before temperature and truncation), as vLLM and
the OpenAI API report them.
"""
from __future__ import annotations

import torch

from sala.engine.params import SamplingParams
from sala.engine.request import Request, TokenLogprob


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [V] -> probabilities after temperature, top-k and top-p."""
    logits = logits / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is short of top_p.
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= p.top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def sample(logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits [n, V] fp32, one row per request -> (token ids, logprobs or None per request)."""
    tokens = logits.argmax(-1).tolist()
    for i, r in enumerate(requests):
        if not r.params.greedy:
            tokens[i] = int(torch.multinomial(filtered_probs(logits[i], r.params), 1, generator=r.generator))
    want = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    logprobs: list[TokenLogprob | None] = [None] * len(requests)
    if want:
        lp = torch.log_softmax(logits[want], dim=-1)
        k = max(requests[i].params.logprobs for i in want)
        top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        for row, i in enumerate(want):
            n = requests[i].params.logprobs
            top = list(zip(top_ids[row, :n].tolist(), top_lp[row, :n].tolist()))
            logprobs[i] = TokenLogprob(tokens[i], lp[row, tokens[i]].item(), top)
    return tokens, logprobs
