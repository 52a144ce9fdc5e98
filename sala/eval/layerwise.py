"""A checkpoint scored one decoder layer at a time: what the quantize gate runs on models larger
than memory, since it never holds more of a model than one layer and lm_head's rows in chunks.

`LayerwiseModel` runs token batches through the checkpoint (sala.checkpoint.CheckpointReader)
layer by layer, keeping every batch's hidden states (fp32), and turns final hidden states into
log-probabilities a few positions at a time, reading lm_head in vocabulary chunks, so that the
full-vocabulary logits (73,448 a position for the 9B model) are never held for all positions at
once. Unquantized weights load in `weights_dtype` (the reference "as served in BF16": rounded
to BF16) and everything computes in fp32; an NVFP4 checkpoint's Linears run on the W4A16 path.

`gate_scores` is the quantize pipeline's gate: the reference's top-k logprobs of the last
positions of each prompt (teacher-forced: a prompt is scored as it is, no continuation is
generated) and its final hidden states on held-out windows are computed once and kept; then the
candidate runs the same sequences, and sala.eval.logprob scores its top-k against the
reference's (mean KL, flips, cosine), while the held-out windows give both perplexities, the
full-vocabulary mean KL and top-1 agreement (sala.eval.compare). The two models are never in
memory together.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from sala.eval import logprob as lp
from sala.eval.compare import divergence_sums, finish

POSITIONS_PER_CHUNK = 64  # rows of logits held at once: 64 x 73,448 fp32 = 19 MB at the 9B vocabulary
VOCAB_PER_CHUNK = 8192  # lm_head rows upcast at once: 8192 x 4096 fp32 = 134 MB at the 9B width


class LayerwiseModel:
    def __init__(self, reader, weights_dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
        self.reader, self.config = reader, reader.config
        self.weights_dtype, self.device = weights_dtype, torch.device(device)

    @torch.no_grad()
    def hidden(self, batches: list[torch.Tensor], observe: Callable[[int, torch.nn.Module], None] | None = None
               ) -> list[torch.Tensor]:
        """Final (normed) hidden states [B, T, H] of each batch of token ids [B, T]: each layer read
        once and run over every batch, then dropped. observe(i, layer) sees layer i before it runs."""
        r, dtype = self.reader, self.weights_dtype
        h = [r.embeddings(ids, dtype).float().to(self.device) * self.config.scale_emb for ids in batches]
        ropes = [r.skeleton.model.rope(torch.arange(x.shape[1], device=self.device).expand(x.shape[0], -1)) for x in h]
        for i in range(self.config.num_hidden_layers):
            layer = r.layer(i, dtype, self.device).float()
            if observe is not None:
                observe(i, layer)
            h = [layer(x, rope, None, None, x.shape[1]) for x, rope in zip(h, ropes)]
            del layer
        norm = r.module("model.norm", dtype, self.device).float()
        return [norm(x) for x in h]

    @torch.no_grad()
    def logprobs(self, hidden: torch.Tensor):
        """Log-probabilities [n, V] of final hidden states [N, H], yielded POSITIONS_PER_CHUNK rows at a time."""
        head = "lm_head.weight"
        vocab = self.reader.tensors.shape(head)[0]
        for p in range(0, len(hidden), POSITIONS_PER_CHUNK):
            x = hidden[p : p + POSITIONS_PER_CHUNK] / self.config.logit_divisor
            logits = torch.cat([x @ self._head_rows(head, v, min(v + VOCAB_PER_CHUNK, vocab)).T
                                for v in range(0, vocab, VOCAB_PER_CHUNK)], dim=-1)
            yield F.log_softmax(logits, dim=-1)

    def _head_rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        rows = self.reader.tensors.row_block(name, lo, hi)
        return rows.to(self.reader.dtype(self.weights_dtype)).float().to(self.device)

    def top_logprobs(self, prompts: list[list[int]], starts: list[int], top_k: int) -> list[lp.TopLogprobs]:
        """Teacher-forced top-k of tokens starts[i] .. len - 1 of each prompt; prompts of one length
        run as one batch (no padding), so a quantized weight is dequantized once per length, not per prompt."""
        by_length: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_length.setdefault(len(p), []).append(i)
        groups = list(by_length.values())
        out: dict[int, lp.TopLogprobs] = {}
        for idx, hidden in zip(groups, self.hidden([torch.tensor([prompts[i] for i in idx]) for idx in groups])):
            for row, i in enumerate(idx):
                tops = [chunk.topk(top_k, dim=-1) for chunk in self.logprobs(hidden[row, starts[i] - 1 : len(prompts[i]) - 1])]
                out[i] = lp.TopLogprobs(torch.cat([t.indices for t in tops]).int().cpu().numpy(),
                                        torch.cat([t.values for t in tops]).cpu().numpy())
        return [out[i] for i in range(len(prompts))]


def gate_scores(reference, candidate, prompts: list[list[int]], windows: torch.Tensor, *,
                positions: int = lp.LAST_POSITIONS, top_k: int = lp.TOP_K, batch_size: int = 8,
                device: str | torch.device = "cpu", progress: Callable[[str], None] | None = None) -> tuple[dict, dict]:
    """(logprob score summary, held-out quality) of `candidate` against `reference` (CheckpointReaders),
    both with their unquantized weights in BF16, as served (an NVFP4 candidate's are stored so).
    Held-out `windows` [N, T + 1] are inputs plus next-token targets, run in batches of `batch_size`."""
    say = progress or (lambda stage: None)
    top_k = min(top_k, reference.config.vocab_size)
    starts = [lp.scored_start(len(p), positions) for p in prompts]
    inputs = [windows[i : i + batch_size, :-1] for i in range(0, len(windows), batch_size)]
    say("reference")
    ref = LayerwiseModel(reference, torch.bfloat16, device)
    ref_tops = ref.top_logprobs(prompts, starts, top_k)
    ref_hidden = ref.hidden(inputs)
    baseline = lp.Baseline([np.asarray(p, dtype=np.int32) for p in prompts], np.array([len(p) for p in prompts]),
                           np.array(starts), np.concatenate([t.ids for t in ref_tops]),
                           np.concatenate([t.logprobs for t in ref_tops]),
                           {"model": str(reference.path), "vocab_size": reference.config.vocab_size, "top_k": top_k,
                            "positions": positions})
    say("candidate")
    cand = LayerwiseModel(candidate, torch.bfloat16, device)
    summary = lp.score(baseline, cand.top_logprobs(prompts, starts, top_k)).summary()
    return summary, finish(heldout_sums(ref, cand, inputs, windows, ref_hidden, batch_size)) if len(windows) else {}


def heldout_sums(ref: LayerwiseModel, cand: LayerwiseModel, inputs: list[torch.Tensor], windows: torch.Tensor,
                 ref_hidden: list[torch.Tensor], batch_size: int) -> dict[str, float]:
    """divergence_sums of the candidate against the reference over every held-out position, a chunk at a time."""
    sums: dict[str, float] = {}
    for b, (h_ref, h_cand) in enumerate(zip(ref_hidden, cand.hidden(inputs))):
        targets = windows[b * batch_size : (b + 1) * batch_size, 1:].reshape(-1)
        h_ref, h_cand = h_ref.reshape(-1, h_ref.shape[-1]), h_cand.reshape(-1, h_cand.shape[-1])
        for p, (lp_ref, lp_cand) in enumerate(zip(ref.logprobs(h_ref), cand.logprobs(h_cand))):
            rows = targets[p * POSITIONS_PER_CHUNK : (p + 1) * POSITIONS_PER_CHUNK].to(lp_ref.device)
            for k, v in divergence_sums(lp_ref, lp_cand, rows).items():
                sums[k] = sums.get(k, 0.0) + v
    return sums
