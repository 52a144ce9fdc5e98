"""Calibration data: read a dataset, analyse its mix, build a calibration set that matches a
target mix of task types, and pack it into token sequences.

GPTQ's Hessians are only as representative as the text behind them: a calibration set that is
all prose under-weights the activations code or lists produce, and rows of UUIDs or random words
add outliers no real prompt has. So rows get a task type (a column if the dataset has one,
otherwise a heuristic), low-semantic rows are detected and down-weighted, and sampling follows
the evaluation set's proportions. Plain Python and torch; Ray Data shards the result in
pipelines/.
"""
from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

TEXT_COLUMNS = ("text", "prompt", "messages", "content")
TASK_COLUMNS = ("task", "task_type", "category")
_UUID = re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")
_HEX = re.compile(r"\b(?:0x)?[0-9a-fA-F]{16,}\b")
_STOPWORDS = frozenset("the a an of to in is are and or for on with that this it as be by from at was not".split())


class DatasetError(ValueError):
    """A dataset that cannot be used for calibration; the message names the file and the problem."""


@dataclass
class Row:
    text: str
    task: str
    low_semantic: str | None = None  # the reason, e.g. "uuid", or None for ordinary text


# ----------------------------------------------------------------------------------- reading
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
_HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")


def dataset_kind(spec: str | Path) -> str:
    """How to read a dataset: 'jsonl' or 'parquet' (a file, or a directory of parquet files), or
    'datasets' (a `datasets.save_to_disk` directory, or the name of a dataset in the local
    `datasets` cache)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            return "datasets"
        if any(path.rglob("*.parquet")):
            return "parquet"
        raise DatasetError(f"{path}: directory holds neither a datasets.save_to_disk dataset nor .parquet files")
    if path.exists():
        if path.suffix in (".jsonl", ".json"):
            return "jsonl"
        if path.suffix == ".parquet":
            return "parquet"
        raise DatasetError(f"{path}: unsupported format (use .jsonl, .parquet, a datasets directory or a cached dataset name)")
    if path.suffix in FILE_SUFFIXES or not _HUB_NAME.fullmatch(str(spec)):
        raise DatasetError(f"{spec}: no such dataset")
    return "datasets"


def load_hf_dataset(spec: str | Path, split: str | None = None):
    """A `datasets.Dataset` from a save_to_disk directory (a Dataset or a DatasetDict, any number of
    shards) or from a dataset name in the local `datasets` cache, read offline. A DatasetDict
    needs `split` unless it holds a single split."""
    import datasets
    from datasets.packaged_modules.cache.cache import Cache

    path = Path(spec).expanduser()
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
    else:
        # The cache's own builder, as load_dataset falls back to when the Hub is unreachable;
        # used directly, so that nothing is looked up on the Hub first.
        name = str(spec)
        try:
            ds = Cache(repo_id=name, dataset_name=name.split("/")[-1], version="auto", hash="auto").as_dataset()
        except (ValueError, FileNotFoundError) as e:
            raise DatasetError(f"{spec}: no such file or directory, nor a dataset in the local datasets cache "
                               f"{datasets.config.HF_DATASETS_CACHE} ({str(e).splitlines()[0]})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split is None and len(ds) == 1:
            split = next(iter(ds))
        if split not in ds:
            given = f"has no split {split!r}" if split is not None else "holds several splits"
            hint = f" or the split's directory {path / next(iter(ds))}" if path.is_dir() else ""
            raise DatasetError(f"{spec} {given} (splits: {', '.join(ds)}); choose one with --split{hint}")
        return ds[split]
    if split is not None and split != str(ds.split):
        raise DatasetError(f"{spec} is a single dataset (split {ds.split}), not a DatasetDict with a split {split!r}")
    return ds


def read_records(path: str | Path, split: str | None = None) -> tuple[list[dict], int]:
    """Records of a .jsonl/.json file, parquet, or a `datasets` dataset (see dataset_kind), plus the
    number of malformed lines skipped (jsonl only). Nothing is fetched from a hub."""
    import pyarrow.parquet as pq

    kind = dataset_kind(path)
    path = Path(path).expanduser()
    if kind == "datasets":
        import datasets

        ds = load_hf_dataset(path if path.exists() else str(path), split)
        # Class labels are stored as integers; records carry their names (a task column's values, say).
        labels = {k: f for k, f in ds.features.items() if isinstance(f, datasets.ClassLabel)}
        records = ds.to_list()
        for rec in records:
            for k, f in labels.items():
                rec[k] = f.int2str(rec[k]) if rec[k] is not None else None
        return records, 0
    if kind == "parquet":
        return pq.read_table(path).to_pylist(), 0
    records, bad = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            bad += 1
    return records, bad


def text_column(records: list[dict], source: str, column: str | None = None) -> str:
    if not records:
        raise DatasetError(f"{source}: dataset is empty")
    if column:
        if column not in records[0]:
            raise DatasetError(f"{source}: no column {column!r} (columns: {sorted(records[0])})")
        return column
    for c in TEXT_COLUMNS:
        if c in records[0]:
            return c
    raise DatasetError(f"{source}: no text column; expected one of {list(TEXT_COLUMNS)} (columns: {sorted(records[0])})")


def record_text(rec: dict, column: str, chat_template=None) -> str:
    value = rec.get(column)
    if column == "messages" and isinstance(value, list):
        if chat_template is not None:
            return chat_template(value)
        return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in value)
    text = "" if value is None else str(value)
    for extra in ("completion", "response", "answer"):
        if column == "prompt" and rec.get(extra):
            text += "\n" + str(rec[extra])
    return text


# ------------------------------------------------------------------------- classification
def guess_task(text: str) -> str:
    """Heuristic task type for rows without a task column: code, qa, list or prose."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    code_marks = sum(bool(re.match(r"\s*(def |class |import |from \S+ import|return |for .+:|if .+:|#)", ln)) for ln in lines)
    if lines and code_marks / len(lines) > 0.25:
        return "code"
    list_marks = sum(bool(re.match(r"\s*([-*•]|\d+[.)])\s", ln)) for ln in lines)
    if len(lines) >= 3 and list_marks / len(lines) > 0.5:
        return "list"
    if re.match(r"\s*(Q:|Question:|what|how|why|who|when|where|which)\b", text, re.I) or "?" in text[:200]:
        return "qa"
    return "prose"


def char_entropy(text: str) -> float:
    counts = Counter(text)
    n = len(text)
    return -sum(c / n * math.log2(c / n) for c in counts.values()) if n else 0.0


def low_semantic_reason(text: str) -> str | None:
    """Why a row carries little meaning (uuid, hex, random-chars, word-list), or None."""
    tokens = text.split()
    if not tokens:
        return "empty"
    if len(_UUID.findall(text)) / len(tokens) > 0.3:
        return "uuid"
    if sum(len(m) for m in _HEX.findall(text)) / max(len(text.replace(" ", "")), 1) > 0.5:
        return "hex"
    letters = [c for c in text.lower() if c.isalpha()]
    vowels = sum(c in "aeiou" for c in letters) / max(len(letters), 1)
    if char_entropy(text.replace(" ", "")) > 4.8 and vowels < 0.25:
        return "random-chars"
    words = [w.strip(".,;:!?\"'()").lower() for w in tokens]
    if len(words) >= 8:
        stop = sum(w in _STOPWORDS for w in words) / len(words)
        sentence_marks = sum(text.count(c) for c in ".!?:;")
        if stop < 0.04 and sentence_marks <= len(words) / 40 and all(w.isalpha() for w in words if w):
            return "word-list"
    return None


def to_rows(records: list[dict], column: str, chat_template=None) -> list[Row]:
    task_col = next((c for c in TASK_COLUMNS if c in records[0]), None) if records else None
    rows = []
    for rec in records:
        text = record_text(rec, column, chat_template)
        task = str(rec[task_col]) if task_col and rec.get(task_col) else guess_task(text)
        rows.append(Row(text, task, low_semantic_reason(text)))
    return rows


# ---------------------------------------------------------------------------------- analysis
@dataclass
class MixReport:
    rows: int
    by_task: dict[str, int]
    length_chars: dict[str, float]
    low_semantic: dict[str, int]
    malformed: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def proportions(self) -> dict[str, float]:
        return {k: v / self.rows for k, v in self.by_task.items()} if self.rows else {}

    def table(self) -> str:
        lines = [f"{'task':<14}{'rows':>8}{'share':>9}"]
        for task, n in sorted(self.by_task.items(), key=lambda kv: -kv[1]):
            lines.append(f"{task:<14}{n:>8}{n / self.rows:>9.1%}")
        lines.append(f"{'total':<14}{self.rows:>8}")
        lc = self.length_chars
        lines.append(f"length (chars): p10 {lc['p10']:.0f}  p50 {lc['p50']:.0f}  p90 {lc['p90']:.0f}  max {lc['max']:.0f}")
        low = sum(self.low_semantic.values())
        detail = ", ".join(f"{k} {v}" for k, v in sorted(self.low_semantic.items())) or "none"
        lines.append(f"low-semantic rows: {low} ({low / max(self.rows, 1):.1%}: {detail})")
        if self.malformed:
            lines.append(f"malformed rows skipped: {self.malformed}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"rows": self.rows, "by_task": self.by_task, "proportions": self.proportions,
                "length_chars": self.length_chars, "low_semantic": self.low_semantic, "malformed": self.malformed}


def analyse(rows: list[Row], malformed: int = 0) -> MixReport:
    lengths = sorted(len(r.text) for r in rows) or [0]

    def pct(p):
        return float(lengths[min(len(lengths) - 1, int(p * len(lengths)))])

    return MixReport(
        rows=len(rows),
        by_task=dict(Counter(r.task for r in rows)),
        length_chars={"p10": pct(0.1), "p50": pct(0.5), "p90": pct(0.9), "max": float(lengths[-1])},
        low_semantic=dict(Counter(r.low_semantic for r in rows if r.low_semantic)),
        malformed=malformed,
    )


# ---------------------------------------------------------------------------------- sampling
def quota(target: dict[str, float], n: int) -> dict[str, int]:
    """Rows per task summing to n, each within one row of n * share (largest remainder)."""
    total = sum(target.values())
    exact = {k: n * v / total for k, v in target.items()}
    out = {k: int(math.floor(x)) for k, x in exact.items()}
    for k in sorted(exact, key=lambda k: exact[k] - out[k], reverse=True)[: n - sum(out.values())]:
        out[k] += 1
    return out


def build_calibration(rows: list[Row], n: int, target_mix: dict[str, float] | None = None,
                      low_semantic_weight: float = 0.05, seed: int = 0) -> list[Row]:
    """Sample n rows matching target_mix (default: the rows' own mix). Low-semantic rows are
    drawn with weight `low_semantic_weight` relative to ordinary rows, without replacement."""
    if not rows:
        raise DatasetError("calibration source is empty")
    by_task: dict[str, list[Row]] = {}
    for r in rows:
        by_task.setdefault(r.task, []).append(r)
    target = target_mix or {k: len(v) for k, v in by_task.items()}
    missing = [k for k, v in target.items() if v > 0 and k not in by_task]
    if missing:
        raise DatasetError(f"target mix asks for task types absent from the calibration source: {missing}")
    rng = random.Random(seed)
    picked: list[Row] = []
    for task, k in quota(target, min(n, len(rows))).items():
        pool = by_task.get(task, [])
        if k > len(pool):
            raise DatasetError(f"target mix needs {k} '{task}' rows, the source has {len(pool)}")
        # Efraimidis-Spirakis weighted sampling without replacement: key = u^(1/w), keep the top k.
        keyed = sorted(pool, key=lambda r: rng.random() ** (1.0 / (low_semantic_weight if r.low_semantic else 1.0)), reverse=True)
        picked += keyed[:k]
    rng.shuffle(picked)
    return picked


def pack_sequences(token_lists: list[list[int]], seq_len: int, eos_id: int) -> torch.Tensor:
    """Concatenate tokenized rows (each ending in eos) and cut into [N, seq_len] sequences."""
    flat = [t for ids in token_lists for t in (*ids, eos_id)]
    n = len(flat) // seq_len
    if n == 0:
        raise DatasetError(f"calibration text has {len(flat)} tokens, fewer than one sequence of {seq_len}")
    return torch.tensor(flat[: n * seq_len], dtype=torch.long).view(n, seq_len)


def calibration_source(tokenizer, path: str | None = None, column: str | None = None,
                       split: str | None = None) -> tuple[list[Row], MixReport]:
    """Rows of the dataset at `path` (default: the built-in set) and the analysis of their mix."""
    if not path:
        rows = default_source_rows()
        return rows, analyse(rows)
    records, malformed = read_records(path, split)
    column = text_column(records, path, column)
    rows = to_rows(records, column, lambda messages: tokenizer.apply_chat_template(messages, tokenize=False))
    return rows, analyse(rows, malformed)


def calibration_sequences(tokenizer, num_samples: int, seq_len: int, path: str | None = None,
                          column: str | None = None, target_mix: dict[str, float] | None = None,
                          split: str | None = None) -> torch.Tensor:
    """[N, seq_len] token ids: `num_samples` rows of the dataset at `path` (default: the
    built-in set; `split` of a DatasetDict) sampled to `target_mix` (default: the source's own
    mix), low-semantic rows down-weighted, tokenized and packed."""
    rows, _ = calibration_source(tokenizer, path, column, split)
    return sample_and_pack(rows, tokenizer, num_samples, seq_len, target_mix)


def sample_and_pack(rows: list[Row], tokenizer, num_samples: int, seq_len: int,
                    target_mix: dict[str, float] | None = None) -> torch.Tensor:
    picked = build_calibration(rows, num_samples, target_mix, seed=0)
    ids = [tokenizer(r.text, add_special_tokens=True, verbose=False)["input_ids"] for r in picked]
    return pack_sequences(ids, seq_len, tokenizer.eos_token_id)


# ----------------------------------------------------------------- default source (no download)
def default_source_rows() -> list[Row]:
    """tiny-sala's training corpus plus generated code, Q&A and list rows, all from the stdlib."""
    from sala.tiny import DOC_MODULES, RECIPE, split_corpus, stdlib_definitions

    train, _ = split_corpus(RECIPE["heldout_every"])
    rows = [Row(t, "prose") for t in train if not t.startswith("<|im_start|>")]
    rows += [Row(t.replace("<|im_start|>user\n", "Q: ").replace("<|im_end|>\n<|im_start|>assistant\n", "\nA: ").replace("<|im_end|>\n", ""), "qa")
             for t in train if t.startswith("<|im_start|>")]
    for name in DOC_MODULES:
        _, defs = stdlib_definitions(name)
        rows += [Row(source, "code") for attr, _, source in defs if source.lstrip().startswith("def ")][:6]
        items = [f"- {attr}: {doc.splitlines()[0][:80]}" for attr, doc, _ in defs[:12] if doc]
        if len(items) >= 3:
            rows.append(Row(f"Public names of {name}:\n" + "\n".join(items), "list"))
    for r in rows:
        r.low_semantic = low_semantic_reason(r.text)
    return rows
