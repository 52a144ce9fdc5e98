"""The engine in this process as a sala.eval.logprob source: what the pipelines score without a server
(the quantize gate, the KV-cache plan ablation, Medusa), through the same requests a server runs."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from sala.engine import Engine, SamplingParams
from sala.eval.logprob import TOKENIZER_PROBE, Identity, TopLogprobs, tokenizer_hash


class EngineSource:
    """`temperature` > 0 makes `generate` sample (seeded) instead of decoding greedily: decode drift
    under sampling, e.g. Medusa's typical acceptance. Scoring is teacher-forced either way."""

    def __init__(self, engine: Engine, name: str, temperature: float = 0.0, seed: int = 0):
        self.engine, self.name, self.temperature, self.seed = engine, name, temperature, seed

    @classmethod
    def from_pretrained(cls, path: str | Path, name: str | None = None, **engine_kwargs) -> EngineSource:
        """Evaluation mode unless told otherwise: scores must not depend on what else shares a step."""
        engine_kwargs.setdefault("batch_invariant", True)
        return cls(Engine.from_pretrained(path, **engine_kwargs), name or Path(path).name)

    def identity(self) -> Identity:
        e = self.engine
        return Identity(self.name, tokenizer_hash(e.tokenizer(TOKENIZER_PROBE)["input_ids"]), e.model.config.vocab_size,
                        e.config.max_model_len)

    def score(self, sequences: list[list[int]], starts: list[int], top_k: int) -> list[TopLogprobs]:
        params = [SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=top_k, prompt_logprobs_start=s)
                  for s in starts]
        return [_arrays(c.prompt_logprobs, top_k) for c in self.engine.generate(sequences, params)]

    def generate(self, prompts: list[list[int]], max_tokens: int, top_k: int) -> list[tuple[list[int], TopLogprobs]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=self.temperature, logprobs=top_k,
                                seed=self.seed if self.temperature else None)
        done = self.engine.generate(prompts, params)
        return [(c.token_ids, _arrays(c.logprobs, top_k)) for c in done]


def _arrays(entries, top_k: int) -> TopLogprobs:
    ids = np.array([[t for t, _ in e.top] for e in entries], dtype=np.int32).reshape(len(entries), top_k)
    lps = np.array([[lp for _, lp in e.top] for e in entries], dtype=np.float32).reshape(len(entries), top_k)
    return TopLogprobs(ids, lps)

