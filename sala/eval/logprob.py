"""Accuracy from logprobs: a BF16 baseline of top-k logprobs, and how far another model's move.

Generative benchmarks are slow and noisy, first-token multiple choice hides flips. Instead the
reference model greedily continues a prompt set once; the top-256 logprobs of the last 128
positions of each prompt + continuation are stored (`Baseline`, an .npz with the prompt ids,
the model's identity and tokenizer hash). A model under test then scores the same token
sequences teacher-forced, so every position is compared; per position and aggregated
(`compare`): KL(baseline || test), cosine similarity of the probability vectors, top-1 flips,
the worst prompts. `decode_drift` goes past prefill: the model under test decodes on its own,
and the reference scores that path.

Both sides report only their top k, so each distribution is completed by spreading its
leftover mass evenly over the tokens it does not list (`divergence`). That KL is an estimate
of the full-vocabulary one; `kl_lower` is a rigorous lower bound (the KL of the coarser
partition {tokens both list} + {the rest}, exact from the reported values alone), and
`covered` the baseline mass of the tokens both list: the estimate is exact when it is 1, and
only the uncovered mass can move the true value away from it.

numpy only, no torch: a client machine scores any server (`LogprobSource`; HTTP sources live in
pipelines/logprob_client.py, the in-process engine in sala/eval/engine_source.py).
"""
from __future__ import annotations

import hashlib
import json
import math
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from sala.atomic import write_atomically

TOP_K = 256
LAST_POSITIONS = 128
BATCH_SIZES = (1, 8, 32)
FORMAT = "sala-logprob-baseline/1"
# Tokenized by every source to fingerprint its tokenizer: prose, code, digits, whitespace, unicode.
TOKENIZER_PROBE = ("The quick brown fox: def f(x):\n\treturn x ** 2  # 3.14159, 2048 tokens?\n"
                   "<|im_start|>user\nÜber naïve café — 東京 🙂<|im_end|>\n")


class BaselineError(ValueError):
    """A baseline file that cannot be used: corrupt, another format, or for another model/tokenizer."""


class SourceError(RuntimeError):
    """A logprob source answered something that cannot be scored (an error, too few top-k, ...)."""


@dataclass
class TopLogprobs:
    """One sequence's scored positions: row i holds the top-k of the distribution predicting token start + i."""

    ids: np.ndarray  # [n, k] int32, most likely first
    logprobs: np.ndarray  # [n, k] float32


@dataclass
class Identity:
    model: str
    tokenizer_hash: str
    vocab_size: int
    max_model_len: int


class LogprobSource(Protocol):
    """Something that runs a model: an HTTP server or the engine in this process."""

    def identity(self) -> Identity: ...

    def score(self, sequences: list[list[int]], starts: list[int], top_k: int) -> list[TopLogprobs]:
        """Teacher-forced top-k for tokens starts[i] .. len - 1 of each sequence, sent as one batch."""
        ...

    def generate(self, prompts: list[list[int]], max_tokens: int, top_k: int) -> list[tuple[list[int], TopLogprobs]]:
        """Greedy continuations (stopping as the model stops), with the top-k at each generated token."""
        ...


def tokenizer_hash(probe_ids: list[int]) -> str:
    return hashlib.sha256(json.dumps([int(t) for t in probe_ids]).encode()).hexdigest()[:16]


def check_top_k(top: TopLogprobs, want: int, what: str) -> None:
    if top.ids.shape[1] < want:
        raise SourceError(f"{what}: the source returned {top.ids.shape[1]} top logprobs per position where {want} "
                          f"were asked (vLLM: --max-logprobs {want}; SGLang: top_logprobs_num is capped by the server)")
    if not np.isfinite(top.logprobs).all():
        raise SourceError(f"{what}: the source returned non-finite logprobs")


# ---------------------------------------------------------------------------------- baseline
@dataclass
class Baseline:
    sequences: list[np.ndarray]  # prompt + greedy continuation, int32
    prompt_lens: np.ndarray  # [N]
    starts: np.ndarray  # [N] first scored token of each sequence
    top_ids: np.ndarray  # [M, K] int32, M = sum of len - start
    top_logprobs: np.ndarray  # [M, K] float32
    meta: dict = field(default_factory=dict)

    @property
    def offsets(self) -> np.ndarray:
        """Row range of sequence i: offsets[i] .. offsets[i + 1]."""
        return np.concatenate([[0], np.cumsum([len(s) - st for s, st in zip(self.sequences, self.starts)])])

    def save(self, path: str | Path) -> Path:
        """Written to a temporary name, fsynced and renamed: an interrupted save leaves the old file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        lens = np.array([len(s) for s in self.sequences], dtype=np.int64)
        arrays = {"tokens": np.concatenate(self.sequences).astype(np.int32), "seq_lens": lens,
                  "prompt_lens": self.prompt_lens.astype(np.int64), "starts": self.starts.astype(np.int64),
                  "top_ids": self.top_ids.astype(np.int32), "top_logprobs": self.top_logprobs.astype(np.float32),
                  "meta": np.array(json.dumps({**self.meta, "format": FORMAT}, sort_keys=True))}
        return write_atomically(path, lambda f: np.savez_compressed(f, **arrays))

    @classmethod
    def load(cls, path: str | Path) -> Baseline:
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                a = {k: z[k] for k in ("tokens", "seq_lens", "prompt_lens", "starts", "top_ids", "top_logprobs", "meta")}
        except FileNotFoundError:
            raise BaselineError(f"{path}: no such baseline file") from None
        except (zipfile.BadZipFile, ValueError, KeyError, OSError, EOFError) as e:
            raise BaselineError(f"{path}: not a readable logprob baseline ({type(e).__name__}: {e})") from None
        try:
            meta = json.loads(str(a["meta"]))
        except ValueError as e:
            raise BaselineError(f"{path}: its metadata is not JSON ({e})") from None
        if meta.get("format") != FORMAT:
            raise BaselineError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
        lens, starts, prompt_lens = a["seq_lens"], a["starts"], a["prompt_lens"]
        n, k = len(lens), a["top_ids"].shape[-1] if a["top_ids"].ndim == 2 else -1
        rows = int((lens - starts).sum()) if len(starts) == n else -1
        problems = [m for bad, m in [
            (lens.sum() != len(a["tokens"]), "token count differs from the sequence lengths"),
            (len(starts) != n or len(prompt_lens) != n, "per-sequence arrays differ in length"),
            (a["top_ids"].shape != (rows, k) or a["top_logprobs"].shape != (rows, k), "top-k arrays do not match the positions"),
            (rows >= 0 and ((starts < 1) | (starts >= lens)).any(), "scored positions outside their sequences"),
            (not np.isfinite(a["top_logprobs"]).all() or (a["top_logprobs"] > 1e-4).any(), "logprobs not finite and <= 0"),
            (a["top_ids"].size and (a["top_ids"].min() < 0 or a["top_ids"].max() >= meta.get("vocab_size", 0)),
             "token ids outside the vocabulary"),
        ] if bad]
        if problems:
            raise BaselineError(f"{path}: corrupt baseline: {problems[0]}")
        return cls(np.split(a["tokens"], np.cumsum(lens)[:-1]), prompt_lens, starts, a["top_ids"], a["top_logprobs"], meta)

    def check_source(self, ident: Identity, path: str = "baseline") -> None:
        """A baseline scores only a model with the same tokenizer and vocabulary, whose context holds its sequences."""
        m = self.meta
        if ident.tokenizer_hash != m["tokenizer_hash"] or ident.vocab_size != m["vocab_size"]:
            raise BaselineError(f"{path} was collected from {m['model']} (tokenizer {m['tokenizer_hash']}, vocabulary "
                                f"{m['vocab_size']}); the source under test is {ident.model} (tokenizer "
                                f"{ident.tokenizer_hash}, vocabulary {ident.vocab_size}): another tokenizer, the token "
                                f"ids would not mean the same text")
        longest = max(len(s) for s in self.sequences)
        if longest + 1 > ident.max_model_len:
            raise SourceError(f"{path} holds sequences of up to {longest} tokens; {ident.model}'s context is "
                              f"{ident.max_model_len} (scoring needs one more)")


def batches(n: int, size: int):
    for i in range(0, n, size):
        yield range(i, min(i + size, n))


def scored_start(length: int, positions: int) -> int:
    """The first scored token: the last `positions` tokens, never the first (nothing predicts it)."""
    return max(1, length - positions)


def score_all(source: LogprobSource, sequences: list[list[int]], starts: list[int], top_k: int, batch_size: int,
              progress: Callable[[int, int], None] | None = None) -> list[TopLogprobs]:
    out: list[TopLogprobs] = []
    for idx in batches(len(sequences), batch_size):
        got = source.score([sequences[i] for i in idx], [starts[i] for i in idx], top_k)
        if len(got) != len(idx):
            raise SourceError(f"the source answered {len(got)} sequences for a batch of {len(idx)}")
        for i, top in zip(idx, got):
            want = len(sequences[i]) - starts[i]
            if len(top.ids) != want:
                raise SourceError(f"sequence {i}: the source scored {len(top.ids)} positions where {want} were asked")
            check_top_k(top, top_k, f"sequence {i}")
            out.append(TopLogprobs(top.ids[:, :top_k].astype(np.int32), top.logprobs[:, :top_k].astype(np.float32)))
        if progress:
            progress(len(out), len(sequences))
    return out


def continue_greedily(source: LogprobSource, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
                      progress: Callable[[int, int], None] | None = None) -> list[list[int]]:
    out: list[list[int]] = []
    for idx in batches(len(prompts), batch_size):
        out += [tokens for tokens, _ in source.generate([prompts[i] for i in idx], max_new_tokens, 0)]
        if progress:
            progress(len(out), len(prompts))
    return out


def collect_baseline(source: LogprobSource, prompts: list[list[int]], *, max_new_tokens: int = 64,
                     batch_sizes: tuple[int, ...] = BATCH_SIZES, top_k: int = TOP_K, positions: int = LAST_POSITIONS,
                     settings: dict | None = None, progress: Callable[[str, int, int], None] | None = None
                     ) -> dict[int, Baseline]:
    """The reference continues every prompt greedily (once, in batches of the largest size), then
    scores prompt + continuation teacher-forced at each batch size: one Baseline per batch size."""
    ident = source.identity()
    too_long = [i for i, p in enumerate(prompts) if len(p) + max_new_tokens + 1 > ident.max_model_len]
    if too_long:
        raise SourceError(f"prompt {too_long[0]} has {len(prompts[too_long[0]])} tokens: with {max_new_tokens} new tokens "
                          f"it does not fit {ident.model}'s context of {ident.max_model_len}")
    if any(len(p) == 0 for p in prompts):
        raise SourceError("a prompt is empty")
    step = (lambda stage: (lambda done, total: progress(stage, done, total))) if progress else (lambda stage: None)
    continuations = continue_greedily(source, prompts, max_new_tokens, max(batch_sizes), step("generate"))
    sequences = [list(p) + c for p, c in zip(prompts, continuations)]
    starts = [scored_start(len(s), positions) for s in sequences]
    out = {}
    for b in batch_sizes:
        tops = score_all(source, sequences, starts, top_k, b, step(f"score batch {b}"))
        out[b] = Baseline([np.asarray(s, dtype=np.int32) for s in sequences], np.array([len(p) for p in prompts]),
                          np.array(starts), np.concatenate([t.ids for t in tops]), np.concatenate([t.logprobs for t in tops]),
                          {"model": ident.model, "tokenizer_hash": ident.tokenizer_hash, "vocab_size": ident.vocab_size,
                           "top_k": top_k, "positions": positions, "batch_size": b, "max_new_tokens": max_new_tokens,
                           "settings": settings or {}})
    return out


# ------------------------------------------------------------------------------- divergence
@dataclass
class Divergence:
    """Per position: KL(P || Q) estimate and rigorous lower bound, cosine, flip, covered mass."""

    kl: np.ndarray
    kl_lower: np.ndarray
    kl_tail: np.ndarray  # uncovered mass x the covered tokens' conditional KL: the error bound reported
    cosine: np.ndarray
    flip: np.ndarray  # bool: the most likely tokens differ
    covered: np.ndarray  # P's mass on the tokens both list

    def __len__(self) -> int:
        return len(self.kl)

    @classmethod
    def concat(cls, parts: list[Divergence]) -> Divergence:
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("kl", "kl_lower", "kl_tail", "cosine", "flip", "covered")))


def _lookup(keys_sorted: np.ndarray, values_sorted: np.ndarray, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(found, value) of each query in a sorted key array."""
    pos = np.searchsorted(keys_sorted, queries).clip(max=len(keys_sorted) - 1)
    found = keys_sorted[pos] == queries
    return found, np.where(found, values_sorted[pos], 0.0)


def _sorted_rows(ids: np.ndarray, values: np.ndarray, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Row r's ids as keys r * vocab + id, sorted within rows, hence globally: one searchsorted for all rows."""
    order = np.argsort(ids, axis=1)
    rows = np.arange(len(ids), dtype=np.int64)[:, None] * vocab
    return (np.take_along_axis(ids, order, 1) + rows).ravel(), np.take_along_axis(values, order, 1).ravel()


def _leftover(probs: np.ndarray, vocab: int) -> np.ndarray:
    """Mass a row's top-k leaves out, at least the float32 precision of the reported logprobs
    (entropy * 2^-24 <= log(V) * 2^-24): below that the reported values cannot tell it from zero."""
    return np.maximum(1.0 - probs.sum(1), math.log(vocab) * 2.0 ** -24)


def divergence(p_ids: np.ndarray, p_lp: np.ndarray, q_ids: np.ndarray, q_lp: np.ndarray, vocab: int,
               chunk: int = 8192) -> Divergence:
    """Row-wise divergence of P (baseline) from Q (test), each given as its top-k [n, k]. Each
    distribution is completed by its leftover mass spread evenly over the vocab - k tokens it does
    not list; KL, cosine over the whole vocabulary of those completed vectors in closed form."""
    parts = [_divergence(p_ids[i:i + chunk], p_lp[i:i + chunk], q_ids[i:i + chunk], q_lp[i:i + chunk], vocab)
             for i in range(0, len(p_ids), chunk)]
    return Divergence.concat(parts) if parts else Divergence(*(np.zeros(0),) * 4, np.zeros(0, bool), np.zeros(0))


def _complete(lp: np.ndarray, missing: np.ndarray, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A distribution listed by its top k, on the `missing` tokens the other side lists and it does
    not [n, m], and on all tokens neither lists. A missing token ranks below this side's k-th, so
    it holds at most that token's probability: each gets min(k-th, leftover / its count), and
    what leftover remains is spread evenly over the vocabulary's other tokens.
    -> (log value on the missing tokens [n], log value on each other token [n], count of others [n])."""
    n, k = lp.shape
    m = missing.sum(1)
    left = _leftover(np.exp(lp.astype(np.float64)), vocab)
    kth = np.exp(lp.min(1).astype(np.float64))
    on_missing = np.minimum(kth, left / np.maximum(m, 1))
    others = np.maximum(vocab - k - m, 0)
    rest = np.maximum(left - m * on_missing, left * 2.0 ** -24)
    return np.log(on_missing), np.log(rest / np.maximum(others, 1)), others


def _divergence(p_ids, p_lp, q_ids, q_lp, vocab) -> Divergence:
    n, kp = p_ids.shape
    p_lp, q_lp = p_lp.astype(np.float64), q_lp.astype(np.float64)
    p, q = np.exp(p_lp), np.exp(q_lp)
    rows = np.arange(n, dtype=np.int64)[:, None] * vocab
    q_keys, q_vals = _sorted_rows(q_ids.astype(np.int64), q_lp, vocab)
    p_keys, _ = _sorted_rows(p_ids.astype(np.int64), p_lp, vocab)
    in_q, q_lp_at_p = _lookup(q_keys, q_vals, (p_ids + rows).ravel())
    in_q, q_lp_at_p = in_q.reshape(n, kp), q_lp_at_p.reshape(n, kp)
    in_p, _ = _lookup(p_keys, np.zeros(len(p_keys)), (q_ids + rows).ravel())
    only_q = ~in_p.reshape(n, q_ids.shape[1])
    only_p = ~in_q
    # Completed distributions: listed values, the boundary rule on the other side's tokens, the rest even.
    lp_miss, lp_rest, rest = _complete(p_lp, only_q, vocab)  # P on tokens only Q lists; P on tokens neither lists
    lq_miss, lq_rest, rest_q = _complete(q_lp, only_p, vocab)
    assert (rest == rest_q).all()
    lq_hat = np.where(in_q, q_lp_at_p, lq_miss[:, None])  # Q on P's tokens
    a_miss, a_rest, b_rest = np.exp(lp_miss), np.exp(lp_rest), np.exp(lq_rest)
    kl = ((p * (p_lp - lq_hat)).sum(1) + (only_q * a_miss[:, None] * (lp_miss[:, None] - q_lp)).sum(1)
          + rest * a_rest * (lp_rest - lq_rest))
    dot = (p * np.exp(lq_hat)).sum(1) + (only_q * a_miss[:, None] * q).sum(1) + rest * a_rest * b_rest
    norm_p = np.sqrt((p * p).sum(1) + only_q.sum(1) * a_miss ** 2 + rest * a_rest ** 2)
    norm_q = np.sqrt((q * q).sum(1) + only_p.sum(1) * np.exp(lq_miss) ** 2 + rest * b_rest ** 2)
    # Lower bound: the KL between the two-part coarsening {tokens both list individually, the rest}.
    common_p = (p * in_q).sum(1)
    rest_p = np.maximum(1.0 - common_p, 0.0)
    rest_q_mass = np.maximum(1.0 - (np.exp(q_lp_at_p) * in_q).sum(1), math.log(vocab) * 2.0 ** -24)
    kl_lower = ((in_q * p * (p_lp - q_lp_at_p)).sum(1)
                + np.where(rest_p > 0, rest_p * np.log(np.maximum(rest_p, 1e-300) / rest_q_mass), 0.0))
    # What the uncovered mass would add if it diverged as the tokens both list do (their conditional KL).
    common_q = np.maximum(1.0 - rest_q_mass, 1e-300)
    cond = (in_q * (p / np.maximum(common_p, 1e-300)[:, None]) * (p_lp - q_lp_at_p
            - np.log(np.maximum(common_p, 1e-300) / common_q)[:, None])).sum(1)
    flip = p_ids[np.arange(n), p_lp.argmax(1)] != q_ids[np.arange(n), q_lp.argmax(1)]
    return Divergence(np.maximum(kl, 0.0), np.maximum(kl_lower, 0.0), rest_p * np.maximum(cond, 0.0),
                      dot / (norm_p * norm_q), flip, common_p)


def full_divergence(p_logprobs: np.ndarray, q_logprobs: np.ndarray) -> Divergence:
    """The same quantities from full-vocabulary logprobs [n, V]: what `divergence` approximates."""
    p, q = np.exp(p_logprobs.astype(np.float64)), np.exp(q_logprobs.astype(np.float64))
    kl = (p * (p_logprobs - q_logprobs)).sum(1)
    cos = (p * q).sum(1) / (np.linalg.norm(p, axis=1) * np.linalg.norm(q, axis=1))
    return Divergence(kl, kl, np.zeros(len(p)), cos, p_logprobs.argmax(1) != q_logprobs.argmax(1), np.ones(len(p)))


def top_k(logprobs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """[n, V] -> (ids, logprobs) [n, k] most likely first, as a server reports them."""
    ids = np.argsort(-logprobs, axis=1, kind="stable")[:, :k]
    return ids.astype(np.int32), np.take_along_axis(logprobs, ids, 1).astype(np.float32)


def perplexity(token_logprobs: np.ndarray) -> float:
    """exp(mean negative log-likelihood) of the tokens that actually followed, given their logprobs."""
    return float(np.exp(-np.mean(token_logprobs, dtype=np.float64)))


# ---------------------------------------------------------------------------------- reports
@dataclass
class Report:
    """A comparison's result: per-position arrays plus aggregates; `ok` only when every position was scored."""

    divergence: Divergence
    sequence_of_row: np.ndarray  # [M] which sequence each position belongs to
    position_from_end: np.ndarray  # [M] 0 = the last scored token
    num_sequences: int
    meta: dict = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        d = self.divergence
        kl = d.kl
        return {"kl_mean": float(kl.mean()), "kl_median": float(np.median(kl)), "kl_p99": float(np.quantile(kl, 0.99)),
                "kl_max": float(kl.max()), "kl_lower_mean": float(d.kl_lower.mean()),
                "cosine_mean": float(d.cosine.mean()), "cosine_min": float(d.cosine.min()),
                "flip_rate": float(d.flip.mean()), "covered_mass_mean": float(d.covered.mean()),
                "covered_mass_min": float(d.covered.min()), "positions": int(len(d)), "sequences": self.num_sequences}

    def per_sequence(self) -> list[dict]:
        d, seq = self.divergence, self.sequence_of_row
        counts = np.bincount(seq, minlength=self.num_sequences)
        kl = np.bincount(seq, weights=d.kl, minlength=self.num_sequences) / np.maximum(counts, 1)
        flips = np.bincount(seq, weights=d.flip.astype(float), minlength=self.num_sequences)
        first_flip = np.full(self.num_sequences, -1)
        for r in np.flatnonzero(d.flip)[::-1]:
            first_flip[seq[r]] = r - np.searchsorted(seq, seq[r])
        return [{"sequence": i, "kl_mean": float(kl[i]), "kl_max": float(d.kl[seq == i].max()) if counts[i] else 0.0,
                 "flips": int(flips[i]), "first_flip": int(first_flip[i]), "positions": int(counts[i])}
                for i in range(self.num_sequences)]

    def worst(self, n: int = 10) -> list[dict]:
        return sorted(self.per_sequence(), key=lambda r: -r["kl_mean"])[:n]

    def kl_by_position(self) -> np.ndarray:
        """Mean KL by distance from the end of the sequence (index 0 = last scored token)."""
        counts = np.bincount(self.position_from_end)
        return np.bincount(self.position_from_end, weights=self.divergence.kl) / np.maximum(counts, 1)


def score(baseline: Baseline, tops: list[TopLogprobs]) -> Report:
    """The test model's teacher-forced top-k for every baseline sequence -> Report. Raises rather
    than score a partial answer: every sequence, every position, the baseline's k."""
    if len(tops) != len(baseline.sequences):
        raise SourceError(f"{len(tops)} scored sequences for a baseline of {len(baseline.sequences)}")
    k = baseline.top_ids.shape[1]
    off = baseline.offsets
    for i, t in enumerate(tops):
        if len(t.ids) != off[i + 1] - off[i]:
            raise SourceError(f"sequence {i}: {len(t.ids)} scored positions, the baseline has {off[i + 1] - off[i]}")
        check_top_k(t, k, f"sequence {i}")
    q_ids = np.concatenate([t.ids[:, :k] for t in tops])
    q_lp = np.concatenate([t.logprobs[:, :k] for t in tops])
    div = divergence(baseline.top_ids, baseline.top_logprobs, q_ids, q_lp, baseline.meta["vocab_size"])
    counts = np.diff(off)
    seq = np.repeat(np.arange(len(counts)), counts)
    from_end = np.concatenate([np.arange(c)[::-1] for c in counts]) if len(counts) else np.zeros(0, int)
    return Report(div, seq, from_end, len(counts), {"baseline_model": baseline.meta["model"], "top_k": k})


def compare(baseline: Baseline, source: LogprobSource, batch_size: int | None = None,
            progress: Callable[[int, int], None] | None = None) -> Report:
    """Score `source` against `baseline`: the baseline's token sequences, teacher-forced, sent in
    batches of the baseline's own batch size unless told otherwise."""
    ident = source.identity()
    baseline.check_source(ident)
    k = baseline.top_ids.shape[1]
    seqs = [s.tolist() for s in baseline.sequences]
    tops = score_all(source, seqs, baseline.starts.tolist(), k, batch_size or baseline.meta.get("batch_size", 8), progress)
    report = score(baseline, tops)
    report.meta["model"] = ident.model
    return report


# ------------------------------------------------------------------------------ decode drift
@dataclass
class Drift:
    """The test model decoding on its own: where it leaves the baseline's continuation, and the
    reference's KL from it along its own path (by decode step)."""

    first_divergence: np.ndarray  # [N] decode step of the first token that differs; the continuation length if none
    continuation_lens: np.ndarray  # [N] baseline continuation lengths
    kl_by_step: np.ndarray  # mean KL(reference || test) at decode step t, over sequences that reached it
    divergence: Divergence  # every decode position of every sequence

    def summary(self) -> dict[str, float]:
        same = self.first_divergence >= self.continuation_lens
        return {"drift_identical_share": float(same.mean()), "drift_first_divergence_mean": float(self.first_divergence.mean()),
                "drift_kl_mean": float(self.divergence.kl.mean()) if len(self.divergence) else 0.0,
                "drift_flip_rate": float(self.divergence.flip.mean()) if len(self.divergence) else 0.0}


def decode_drift(baseline: Baseline, test: LogprobSource, reference: LogprobSource, batch_size: int | None = None) -> Drift:
    """The test model continues each baseline prompt greedily (as many tokens as the baseline did);
    the reference scores that path teacher-forced, so KL(reference || test) is measured along the
    tokens the test model actually produced, where prefill-only scoring never looks."""
    baseline.check_source(test.identity())
    baseline.check_source(reference.identity(), "baseline (reference source)")
    k = baseline.top_ids.shape[1]
    b = batch_size or baseline.meta.get("batch_size", 8)
    prompts = [s[:n].tolist() for s, n in zip(baseline.sequences, baseline.prompt_lens)]
    conts = [s[n:].tolist() for s, n in zip(baseline.sequences, baseline.prompt_lens)]
    max_new = max(len(c) for c in conts)
    paths, test_tops = [], []
    for idx in batches(len(prompts), b):
        for i, (tokens, top) in zip(idx, test.generate([prompts[i] for i in idx], max_new, k)):
            n = min(len(tokens), len(conts[i])) or min(len(tokens), 1)
            check_top_k(top, k, f"sequence {i} (decode)")
            paths.append(prompts[i] + tokens[:n])
            test_tops.append(TopLogprobs(top.ids[:n, :k], top.logprobs[:n, :k]))
    first = np.array([next((t for t, (x, y) in enumerate(zip(p[len(pr):], c)) if x != y), min(len(p) - len(pr), len(c)))
                      for p, pr, c in zip(paths, prompts, conts)])
    ref_tops = score_all(reference, paths, [len(pr) for pr in prompts], k, b)
    parts, steps = [], []
    for r, t in zip(ref_tops, test_tops):
        parts.append(divergence(r.ids, r.logprobs, t.ids, t.logprobs, baseline.meta["vocab_size"]))
        steps.append(np.arange(len(t.ids)))
    div = Divergence.concat(parts)
    step = np.concatenate(steps)
    by_step = np.bincount(step, weights=div.kl) / np.maximum(np.bincount(step), 1)
    return Drift(first, np.array([len(c) for c in conts]), by_step, div)


def untied_departures(baseline: Baseline, drift: Drift) -> list[int]:
    """Sequences whose greedy path (`decode_drift` of a source decoding greedily) leaves the
    baseline's continuation at a step where the baseline's two most likely tokens were not exactly
    tied: what a lossless decoder of the same model (greedy speculative decoding) must never do.
    At an exact tie (BF16 logits) the last bit of a hidden state may break it either way. A
    departure outside the baseline's scored positions cannot be checked and is counted."""
    off, out = baseline.offsets, []
    for i, (step, n) in enumerate(zip(drift.first_divergence, drift.continuation_lens)):
        if step >= n:
            continue
        row = off[i] + baseline.prompt_lens[i] + step - baseline.starts[i]
        if row < off[i] or baseline.top_logprobs[row, 0] != baseline.top_logprobs[row, 1]:
            out.append(i)
    return out


# ------------------------------------------------------------------------------------ files
def baseline_path(directory: str | Path, batch_size: int) -> Path:
    return Path(directory) / f"baseline_bs{batch_size}.npz"


def load_baselines(directory: str | Path) -> dict[int, Baseline]:
    """Every baseline_bs<b>.npz of a directory, by batch size; they must describe the same sequences."""
    directory = Path(directory)
    files = sorted(directory.glob("baseline_bs*.npz"))
    if not files:
        raise BaselineError(f"{directory}: no baseline_bs<batch>.npz files (collect them with `pipelines/evaluate.py baseline`)")
    out = {}
    for f in files:
        b = Baseline.load(f)
        out[int(b.meta["batch_size"])] = b
    first = next(iter(out.values()))
    for b in out.values():
        if len(b.sequences) != len(first.sequences) or any(len(x) != len(y) or (x != y).any()
                                                            for x, y in zip(b.sequences, first.sequences)):
            raise BaselineError(f"{directory}: the baselines of different batch sizes hold different sequences")
    return out

