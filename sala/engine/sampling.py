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


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """logits [n, V] fp32, one row per request -> the next token of each."""
    tokens = logits.argmax(-1).tolist()
    for i, r in enumerate(requests):
        if not r.params.greedy:
            tokens[i] = int(torch.multinomial(filtered_probs(logits[i], r.params), 1, generator=r.generator))
    return tokens


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_k: list[int]) -> list[TokenLogprob]:
    """Row i: the logprob of tokens[i] under log_softmax(logits[i]) and the top_k[i] most likely."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits, dim=-1)
    k = max(top_k)
    top_lp, top_ids = lp.topk(k, dim=-1)
    chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    return [TokenLogprob(t, c, list(zip(top_ids[i, :n].tolist(), top_lp[i, :n].tolist())))
            for i, (t, c, n) in enumerate(zip(tokens, chosen, top_k))]
