"""Per-request changes to a step's logits before a token is chosen: logit_bias, min_tokens and
the repetition, presence and frequency penalties, batched over the rows that ask for any.

Definitions follow vLLM (and, for the penalties, the OpenAI API), applied in its order:
1. logit_bias: the bias is added to its token's logit.
2. repetition_penalty p (Keskar et al., CTRL; as transformers and vLLM): every token of the
   prompt or of the output so far has its logit divided by p when positive, multiplied by p
   when not.
3. frequency_penalty f and presence_penalty a (OpenAI): logit -= f * count + a * (count > 0),
   count being the token's occurrences in the output so far (not the prompt).
4. min_tokens: while fewer tokens than that have been generated, the stop tokens (the request's
   stop_token_ids, and the eos ids unless ignore_eos) are -inf, so none can be chosen.

Rows that set none of them are not touched and a step where no row sets one returns the logits
as they are, so the plain decode path pays one Python pass over its requests. Everything runs on
the logits' device; token lists reach it as one padded tensor per step, as in vLLM's sampler.
"""
from __future__ import annotations

import torch

from sala.sampling.params import Sequence


def _token_table(seqs: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), longest] token ids, padded with `pad` (one past the vocabulary)."""
    width = max(1, max(map(len, seqs)))
    return torch.tensor([s + [pad] * (width - len(s)) for s in seqs], dtype=torch.long, device=device)


def adjust_logits(logits: torch.Tensor, requests: list[Sequence], eos_ids: set[int] | frozenset[int]) -> torch.Tensor:
    """logits [n, V], one row per request -> the logits to choose from (a new tensor when any row
    changes: the caller's logits still give the reported, unadjusted logprobs)."""
    rows = [i for i, r in enumerate(requests) if r.params.adjusts_logits]
    if not rows:
        return logits
    dev, vocab = logits.device, logits.shape[-1]
    reqs = [requests[i] for i in rows]
    params = [r.params for r in reqs]
    index = torch.tensor(rows, device=dev)
    sub = logits[index]  # a copy

    bias = [(j, t, b) for j, p in enumerate(params) for t, b in p.logit_bias.items()]
    if bias:
        j, t, b = zip(*bias)
        sub.index_put_((torch.tensor(j, device=dev), torch.tensor(t, device=dev)),
                       torch.tensor(b, device=dev, dtype=sub.dtype), accumulate=True)

    if any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params):
        outputs = _token_table([r.output_ids for r in reqs], vocab, dev)
        counts = torch.zeros(len(reqs), vocab + 1, device=dev, dtype=sub.dtype)
        counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=sub.dtype))
        counts = counts[:, :vocab]
        if any(p.repetition_penalty != 1 for p in params):
            seen = torch.zeros(len(reqs), vocab + 1, device=dev, dtype=torch.bool)
            seen.scatter_(1, _token_table([r.prompt_ids for r in reqs], vocab, dev), True)
            seen = seen[:, :vocab] | (counts > 0)
            penalty = torch.tensor([p.repetition_penalty for p in params], device=dev, dtype=sub.dtype)[:, None]
            sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
        frequency = torch.tensor([p.frequency_penalty for p in params], device=dev, dtype=sub.dtype)[:, None]
        presence = torch.tensor([p.presence_penalty for p in params], device=dev, dtype=sub.dtype)[:, None]
        sub = sub - frequency * counts - presence * (counts > 0).to(sub.dtype)

    banned = [(j, t) for j, (r, p) in enumerate(zip(reqs, params)) if len(r.output_ids) < p.min_tokens
              for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))]
    if banned:
        j, t = zip(*banned)
        sub[torch.tensor(j, device=dev), torch.tensor(t, device=dev)] = float("-inf")
    return logits.index_copy(0, index, sub)
