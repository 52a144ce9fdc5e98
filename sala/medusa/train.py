"""Training Medusa heads on a frozen backbone (Medusa-1).

Data: rows of text with a task type (sala/eval/calibration.py's Row). Each row gives windows of
`prompt_len` tokens; with self-distillation (the default) the model's own continuation of each
window (greedy, or sampled at `temperature`) replaces the text after it, so the heads learn
what the model will actually say; otherwise the given text is used as it is.

Loss: head k (0-based) at position t is trained to predict token t + k + 2, weighted
decay^(k+1) (0.8^k for head k = 1..K in the paper's numbering): far heads are harder and
matter less, since they only count once every nearer head was right.

Validation-matched weighting: training windows are drawn with weight p_val(bucket) / p_train(bucket)
over buckets of (task type, length bin of the source row), the length bins cut at the
validation windows' p10 / p50 / p90, so the training mix matches the mix of the validation
windows the heads will be judged on instead of whatever the source happens to hold; a bucket
too thin to stand for its share falls back to task type alone (matched_weights).

The backbone is frozen, so it runs once per row under no_grad (`encode`) and its hidden states
are kept in its dtype (rows x seq_len x hidden: 40 MB for tiny-sala's 600 windows in fp32, 0.9 GB
for 854 windows at the 9B's width in bf16; the heads read them in fp32); only the heads (and,
unless shared, their vocabulary projections) get gradients. State (heads, optimizer, step,
sampler position) is saved as safetensors + JSON every `checkpoint_every` steps, so a run
resumes where it stopped.

Memory (`training_bytes`): besides the backbone, the heads with their gradients and AdamW's
moments (fp32), the encoded windows, and the larger of a training step and an evaluation batch,
which hold all K heads' logits over the vocabulary: at the 9B's 73,448 ids, 128-token windows
and 4 heads, 0.38 GiB a row in a training step (the logits, the log-softmax kept for backward,
the gradients) and 0.28 GiB a row when evaluating, which takes twice the training batch's rows
(at most 32).
"""
from __future__ import annotations

import json
import math
import random
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from sala.eval.calibration import Row
from sala.medusa.accept import accept_length as medusa_accept_length
from sala.medusa.heads import MedusaConfig, MedusaHeads
from sala.medusa.tree import by_acceptance
from sala.sampling import SamplingParams

ENCODE_BATCH = 32  # windows the backbone encodes at once
EVAL_BATCH = 32  # windows an evaluation batch takes at most


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 16
    lr: float = 1e-3  # Medusa's: the backbone is frozen, so ~50x a full fine-tune's
    weight_decay: float = 0.0
    warmup: int = 20
    decay: float = 0.8
    checkpoint_every: int = 50
    seed: int = 0


# ------------------------------------------------------------------------------ data
@dataclass
class Sequence:
    ids: list[int]
    task: str
    chars: int  # length of the source row, for length bins


def windows(rows: list[Row], tokenizer, prompt_len: int, seq_len: int, per_row: int) -> tuple[list[Sequence], list[list[int]]]:
    """Up to `per_row` windows of seq_len tokens per row (BOS first); also each window's first
    prompt_len tokens (the prompts a self-distillation run continues)."""
    seqs, prompts = [], []
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    for r in rows:
        ids = tokenizer(r.text, add_special_tokens=False, verbose=False)["input_ids"]
        body = seq_len - len(bos)
        starts = list(range(0, max(len(ids) - body, 0) + 1, body))[:per_row] if len(ids) >= prompt_len else []
        for s in starts:
            w = bos + ids[s : s + body]
            seqs.append(Sequence(w, r.task, len(r.text)))
            prompts.append(w[:prompt_len])
    return seqs, prompts


def self_distilled(seqs: list[Sequence], continuations: list[list[int]], prompt_len: int) -> list[Sequence]:
    """Each window's prompt followed by the model's own continuation of it."""
    return [Sequence(s.ids[:prompt_len] + list(c), s.task, s.chars) for s, c in zip(seqs, continuations)]


def length_edges(val: list[Sequence]) -> list[float]:
    """Length-bin cuts: the validation windows' source-row length at p10, p50 and p90."""
    lengths = sorted(s.chars for s in val)
    return sorted({float(lengths[min(len(lengths) - 1, int(p * len(lengths)))]) for p in (0.1, 0.5, 0.9)})


def bucket(task: str, chars: int, edges: list[float]) -> tuple[str, int]:
    return task, sum(chars > e for e in edges)


MIN_BUCKET_ROWS = 16


def matched_weights(train: list[Sequence], val: list[Sequence], min_rows: int = MIN_BUCKET_ROWS) -> list[float]:
    """Row weights making the (task, length bin) mix of the training windows that of the
    validation windows: the windows accept length is measured on (validation rows too short for
    a window's prompt are not among them, so matching the raw rows' mix would chase rows that
    are never evaluated). A task whose validation windows fall in a length bin holding fewer
    than `min_rows` of its training windows is matched by task alone (all its windows alike):
    otherwise those few windows would carry the bin's whole validation share and be drawn over
    and over (measured on tiny-sala: per length bin alone, an effective sample of 9 of 854
    windows; matching the raw rows' mix, 3 windows drew 80% of the batches, an effective 5, and
    the heads overfit them). Validation tasks no training window has are dropped (the rest
    renormalised); raises if none is left."""
    if not val:
        raise ValueError("validation-matched weighting needs validation windows")
    edges = length_edges(val)
    fine = [bucket(s.task, s.chars, edges) for s in train]
    val_fine = [bucket(s.task, s.chars, edges) for s in val]
    count = Counter(fine)
    thin = {task for task, b in val_fine if 0 < sum(n for (t, _), n in count.items() if t == task) and count[task, b] < min_rows}

    def key(k):
        return (k[0], None) if k[0] in thin else k

    keys = [key(k) for k in fine]
    train_count = Counter(keys)
    val_mix = Counter(key(k) for k in val_fine)
    weights = [val_mix[k] / len(val) / train_count[k] for k in keys]
    if not any(weights):
        raise ValueError("no training row shares a task type with the validation set: "
                         "validation-matched weighting has nothing to draw")
    return weights


def effective_rows(weights: list[float] | None, n: int) -> float:
    """Kish's effective sample size (sum w)^2 / sum w^2 of a weighted draw over n rows."""
    if weights is None:
        return float(n)
    return sum(weights) ** 2 / max(sum(w * w for w in weights), 1e-30)


def batch_tensors(seqs: list[Sequence], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(s.ids) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s.ids)] = torch.tensor(s.ids)
        mask[i, : len(s.ids)] = True
    return ids, mask


@dataclass
class Encoded:
    """Rows through the frozen backbone: ids and mask [N, S], the heads' input hidden [N, S, d]
    in the backbone's dtype."""

    ids: torch.Tensor
    mask: torch.Tensor
    hidden: torch.Tensor

    def __len__(self) -> int:
        return self.ids.shape[0]


@torch.no_grad()
def encode(model, seqs: list[Sequence], pad_id: int, batch_size: int = ENCODE_BATCH) -> Encoded:
    ids, mask = batch_tensors(seqs, pad_id)
    hidden = None  # filled a batch at a time: never the batches and their concatenation at once
    for i in range(0, len(seqs), batch_size):
        h = backbone_hidden(model, ids[i : i + batch_size])
        if hidden is None:
            hidden = h.new_empty(len(seqs), *h.shape[1:])
        hidden[i : i + len(h)] = h
    return Encoded(ids, mask, hidden)


class RowSampler:
    """Batches of row indices drawn with replacement by row weight (uniform when None); its
    position is part of the saved state, so a resumed run draws what the first would have."""

    def __init__(self, n: int, weights: list[float] | None, batch_size: int, seed: int):
        self.n, self.weights, self.batch_size, self.seed = n, weights, batch_size, seed
        self.drawn = 0

    def next(self) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + self.drawn)
        self.drawn += 1
        return rng.choices(range(self.n), weights=self.weights, k=self.batch_size)


# ------------------------------------------------------------------------------ loss and metrics
@torch.no_grad()
def backbone_hidden(model, ids: torch.Tensor) -> torch.Tensor:
    """What lm_head and the heads read: the final hidden divided by the muP logit divisor."""
    mask = torch.ones_like(ids)
    return model.model(ids, attention_mask=mask) / model.config.logit_divisor


def head_losses(heads: MedusaHeads, model, hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor):
    """Per-head cross-entropy [K] and top-1 / top-5 hits over valid positions. Head k at t -> token t + k + 2."""
    logits = heads(hidden, model.lm_head)  # [K, B, S, V]
    losses, top1, top5 = [], [], []
    for k in range(logits.shape[0]):
        shift = k + 2
        lg, tgt = logits[k, :, :-shift], ids[:, shift:]
        valid = mask[:, shift:] & mask[:, :-shift]
        losses.append(F.cross_entropy(lg[valid], tgt[valid]))
        ranks = lg[valid].topk(5, dim=-1).indices == tgt[valid][:, None]
        top1.append(ranks[:, 0].float().mean())
        top5.append(ranks.any(-1).float().mean())
    return torch.stack(losses), torch.stack(top1), torch.stack(top5)


@torch.no_grad()
def evaluate(heads: MedusaHeads, model, data: Encoded, batch_size: int = EVAL_BATCH) -> dict:
    """Per-head loss, top-1 and top-5 accuracy, and path acceptance on `data`: for each path
    (ranks of heads 0, 1, ...) the share of positions where a greedy verify would keep it, i.e.
    where every head's token of that rank is the text's, counted at the positions every head has
    a target at; likeliest first (what MedusaConfig.path_acceptance holds)."""
    k, topk = heads.config.num_heads, heads.config.topk
    sums = torch.zeros(3, k)
    count = torch.zeros(k)
    paths: Counter = Counter()
    positions = 0
    for i in range(0, len(data), batch_size):
        ids, mask, hidden = data.ids[i : i + batch_size], data.mask[i : i + batch_size], data.hidden[i : i + batch_size]
        logits = heads(hidden, model.lm_head)
        ranks = []  # [B, S - k - 1] per head: the rank of its target in its top-k (topk: not in it)
        for h in range(k):
            shift = h + 2
            valid = mask[:, shift:] & mask[:, :-shift]
            lg, tgt = logits[h, :, :-shift][valid], ids[:, shift:][valid]
            top = lg.topk(topk, dim=-1).indices == tgt[:, None]
            sums[0, h] += F.cross_entropy(lg, tgt, reduction="sum")
            sums[1, h] += top[:, 0].sum()
            sums[2, h] += top[:, :5].any(-1).sum()
            count[h] += tgt.numel()
            hit = logits[h, :, : ids.shape[1] - k - 1].topk(topk, dim=-1).indices == ids[:, shift : ids.shape[1] - k - 1 + shift, None]
            ranks.append(torch.where(hit.any(-1), hit.int().argmax(-1), topk))
        every = mask[:, : ids.shape[1] - k - 1] & mask[:, k + 1 :]  # every head's target is text
        positions += int(every.sum())
        for row in torch.stack(ranks, -1)[every].tolist():
            for depth in range(k):
                if row[depth] == topk:
                    break
                paths[tuple(row[: depth + 1])] += 1
        del logits, lg, top, hit  # else held while the next batch's logits are made: two batches' at once
    c = count.clamp(min=1)
    acceptance = {p: n / max(positions, 1) for p, n in paths.items()}
    return {"loss": (sums[0] / c).tolist(), "top1": (sums[1] / c).tolist(), "top5": (sums[2] / c).tolist(),
            "path_acceptance": [[p, acceptance[tuple(p)]] for p in by_acceptance(acceptance, acceptance)]}


def evaluate_batch(train_batch: int) -> int:
    """Rows an evaluation batch takes when training takes `train_batch`: twice as many, at most
    EVAL_BATCH (32 at the default 16), since with no backward a row holds 70% of what it does in
    a training step (training_bytes)."""
    return min(EVAL_BATCH, 2 * train_batch)


# ------------------------------------------------------------------------------ training
def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def train_heads(heads: MedusaHeads, model, data: Encoded, sampler: RowSampler, cfg: TrainConfig,
                state_dir: str | Path | None = None, on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
    """Train `heads` in place for cfg.steps (resuming from state_dir when it holds a saved state);
    returns the per-step log rows ({step, loss, loss_k, top1_k, top5_k})."""
    model.requires_grad_(False)
    heads.train()
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    weights = torch.tensor([cfg.decay ** (k + 1) for k in range(heads.config.num_heads)])
    start, history = 0, []
    if state_dir is not None and (Path(state_dir) / "train_state.json").exists():
        start, history = load_train_state(Path(state_dir), heads, opt, sampler)
    for step in range(start, cfg.steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg)
        rows = torch.tensor(sampler.next())
        ids, mask, hidden = data.ids[rows], data.mask[rows], data.hidden[rows]
        losses, top1, top5 = head_losses(heads, model, hidden, ids, mask)
        loss = (losses * weights).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        row = {"step": step + 1, "loss": loss.item(), **{f"loss_{k}": v for k, v in enumerate(losses.tolist())},
               **{f"top1_{k}": v for k, v in enumerate(top1.tolist())}, **{f"top5_{k}": v for k, v in enumerate(top5.tolist())}}
        history.append(row)
        if state_dir is not None and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps):
            save_train_state(Path(state_dir), heads, opt, sampler, step + 1, history, cfg)
        if on_step is not None:
            on_step(step + 1, row)
    heads.eval()
    return history


def save_train_state(directory: Path, heads: MedusaHeads, opt, sampler: RowSampler, step: int, history: list[dict],
                     cfg: TrainConfig) -> None:
    """Heads and AdamW moments as safetensors, the rest as JSON; each file replaced atomically
    (written under a temporary name, then renamed), the JSON last, so a crash leaves the previous state."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {f"heads.{k}": v.detach().cpu().contiguous() for k, v in heads.state_dict().items()}
    names = dict(heads.named_parameters())
    index = {id(p): n for n, p in names.items()}
    for p, state in opt.state.items():
        for key, v in state.items():
            if isinstance(v, torch.Tensor):
                tensors[f"opt.{index[id(p)]}.{key}"] = v.detach().cpu().contiguous()
    tmp = directory / "train_state.safetensors.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(directory / "train_state.safetensors")
    meta = {"step": step, "sampler_drawn": sampler.drawn, "history": history, "config": asdict(cfg)}
    tmp = directory / "train_state.json.tmp"
    tmp.write_text(json.dumps(meta))
    tmp.replace(directory / "train_state.json")


def load_train_state(directory: Path, heads: MedusaHeads, opt, sampler: RowSampler) -> tuple[int, list[dict]]:
    meta = json.loads((directory / "train_state.json").read_text())
    tensors = load_file(str(directory / "train_state.safetensors"))
    heads.load_state_dict({k.removeprefix("heads."): v for k, v in tensors.items() if k.startswith("heads.")})
    for name, p in heads.named_parameters():
        state = {key.rsplit(".", 1)[1]: v for key, v in tensors.items() if key.startswith(f"opt.{name}.")
                 and key.count(".") == name.count(".") + 2}
        if state:
            opt.state[p] = state
    sampler.drawn = meta["sampler_drawn"]
    return meta["step"], meta["history"]


# ------------------------------------------------------------------------------ memory
def training_bytes(config: MedusaConfig, windows: int, seq_len: int, batch: int, dtype: torch.dtype) -> dict[str, int]:
    """What training heads of `config` on `windows` windows of `seq_len` tokens in batches of
    `batch` holds besides the backbone, by part (the backbone's hidden in `dtype`):

    - heads: their fp32 parameters and gradients; optimizer: AdamW's two moments;
    - encoded windows: ids (int64), mask and hidden;
    - the larger of a training step and an evaluation batch (evaluate_batch rows), over their
      rows' positions. A training step: the K heads' fp32 logits [K, B, S, V], each head's
      log-softmax kept for backward and the gradients backward sums, 10 bytes an entry as
      measured at the 9B's width (K = 4), and one more gradient of the heads while it is added
      to theirs (AdamW's step, after the logits are gone, holds as much). An evaluation batch:
      the logits in the projection's dtype and in fp32 at once (a shared lm_head projects in the
      backbone's), or the fp32 ones and one head's scratch copies (its valid rows, their
      log-softmax, the top-k input). Either also holds each block's fp32 activations, four of
      [K, B, S, d] a layer."""
    k, d, v = config.num_heads, config.hidden_size, config.vocab_size
    params = 4 * (k * config.num_layers * (d * d + d) + (0 if config.shared_lm_head else k * v * d))
    projected = dtype.itemsize if config.shared_lm_head else 0
    blocks = 4 * k * config.num_layers * d * 4
    step = batch * seq_len * (v * 10 * k + blocks) + params
    evaluation = evaluate_batch(batch) * seq_len * (v * max((4 + projected) * k, 4 * k + 12) + blocks)
    return {"heads": 2 * params, "optimizer": 2 * params, "encoded windows": windows * seq_len * (9 + d * dtype.itemsize),
            "training step or evaluation": max(step, evaluation)}


# ------------------------------------------------------------------------------ accept length
def accept_length(engine, prompts: list[list[int]], max_tokens: int) -> float:
    """Mean tokens per verify step (bonus included) of a Medusa engine decoding `prompts` greedily."""
    before = engine.stats().speculation
    engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    after = engine.stats().speculation
    return medusa_accept_length(after.verify_steps - before.verify_steps, after.accepted_tokens - before.accepted_tokens)


# ------------------------------------------------------------------------------ one call
@dataclass
class DataConfig:
    prompt_len: int = 32
    seq_len: int = 128
    windows_per_row: int = 8
    self_distill: bool = True  # False: train on the given text
    temperature: float = 0.0  # of the self-distilled continuations (0: greedy)
    weighting: str = "matched"  # or "uniform"


def distill(engine, seqs: list[Sequence], prompts: list[list[int]], data: DataConfig) -> list[Sequence]:
    """The model's own continuations of each window's prompt, through the serving engine."""
    params = SamplingParams(max_tokens=data.seq_len - data.prompt_len, temperature=data.temperature, ignore_eos=True,
                            seed=0 if data.temperature else None)
    outs = engine.generate(prompts, params)
    return self_distilled(seqs, [o.token_ids for o in outs], data.prompt_len)


def prepare(engine, rows: list[Row], data: DataConfig, per_row: int | None = None) -> list[Sequence]:
    seqs, prompts = windows(rows, engine.tokenizer, data.prompt_len, data.seq_len, per_row or data.windows_per_row)
    if not seqs:
        raise ValueError(f"no row has the {data.prompt_len} tokens a window's prompt needs")
    return distill(engine, seqs, prompts, data) if data.self_distill else seqs


def row_weights(seqs: list[Sequence], val: list[Sequence], weighting: str) -> list[float] | None:
    if weighting == "uniform":
        return None
    if weighting == "matched":
        return matched_weights(seqs, val)
    raise ValueError(f"weighting must be 'matched' or 'uniform', got {weighting!r}")


def write_medusa_checkpoint(model_dir: str | Path, heads: MedusaHeads, output: str | Path, overwrite: bool = False,
                            producer: dict | None = None, metrics: dict | None = None) -> Path:
    """`output` = the model checkpoint at `model_dir` (its files copied) plus `medusa/`, written
    atomically with a fresh manifest over both."""
    import shutil

    from sala.checkpoint import MANIFEST, atomic_directory, verify_manifest, write_manifest
    from sala.medusa.heads import MEDUSA_DIR

    model_dir = Path(model_dir)
    verify_manifest(model_dir)
    with atomic_directory(output, overwrite=overwrite) as tmp:
        for f in model_dir.iterdir():
            if f.name in (MANIFEST, MEDUSA_DIR) or f.name.startswith("."):
                continue
            (shutil.copytree if f.is_dir() else shutil.copy2)(f, tmp / f.name)
        heads.save(tmp)
        (tmp / MEDUSA_DIR / MANIFEST).unlink()  # the checkpoint's own manifest covers medusa/ (nested ones are refused)
        write_manifest(tmp, producer, metrics)
    return Path(output).absolute()
