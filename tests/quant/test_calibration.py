"""Calibration data: readers, low-semantic detection, mix matching, packing."""
import json
import random
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sala.eval.calibration import (
    DatasetError,
    Row,
    analyse,
    build_calibration,
    default_source_rows,
    low_semantic_reason,
    pack_sequences,
    quota,
    read_records,
    text_column,
    to_rows,
)
from tests.conftest import cache_hf_dataset

WORDS = "apple river keyboard mountain silent orange bottle window candle forest tiger pencil cloud".split()


def uuid_row(rng):
    return " ".join(str(uuid.UUID(int=rng.getrandbits(128))) for _ in range(6))


def word_list_row(rng):
    return " ".join(rng.choice(WORDS) for _ in range(14))


def test_low_semantic_rows_detected_and_ordinary_text_kept():
    rng = random.Random(0)
    assert all(low_semantic_reason(uuid_row(rng)) == "uuid" for _ in range(20))
    assert all(low_semantic_reason(word_list_row(rng)) == "word-list" for _ in range(20))
    assert low_semantic_reason("deadbeef" * 8) == "hex"
    ordinary = [r.text for r in default_source_rows()]
    flagged = [t for t in ordinary if low_semantic_reason(t)]
    assert len(flagged) / len(ordinary) < 0.02, flagged[:3]


@pytest.mark.parametrize("n", [10, 37, 100])
def test_mix_within_one_row_of_target(n):
    rows = default_source_rows()
    target = {"code": 0.1, "qa": 0.5, "prose": 0.25, "list": 0.15}
    picked = build_calibration(rows, n, target, seed=1)
    counts = analyse(picked).by_task
    assert len(picked) == n
    for task, share in target.items():
        assert abs(counts.get(task, 0) - n * share) <= 1, (task, counts)


def test_quota_sums_exactly():
    q = quota({"a": 1, "b": 1, "c": 1}, 10)
    assert sum(q.values()) == 10 and sorted(q.values()) == [3, 3, 4]


def test_low_semantic_rows_are_down_weighted():
    rng = random.Random(2)
    rows = [Row(f"Ordinary sentence number {i} is about the list type.", "prose") for i in range(100)]
    rows += [Row(uuid_row(rng), "prose", "uuid") for _ in range(100)]
    picked = build_calibration(rows, 50, seed=3)
    share = sum(r.low_semantic is not None for r in picked) / 50
    assert share < 0.2  # uniform sampling would give about 0.5


def test_readers_jsonl_and_parquet(tmp_path):
    recs = [{"text": f"row {i}", "task": "qa" if i % 2 else "code"} for i in range(6)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n{not json\n")
    got, bad = read_records(tmp_path / "d.jsonl")
    assert got == recs and bad == 1
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "d.parquet")
    assert read_records(tmp_path / "d.parquet") == (recs, 0)
    rows = to_rows(got, text_column(got, "d.jsonl"))
    assert analyse(rows).by_task == {"code": 3, "qa": 3}


def test_datasets_library_splits_shards_features_and_cache(tmp_path, monkeypatch):
    """A DatasetDict written by `datasets` (several shards, a ClassLabel task column, a chat column)
    is read through `datasets`, one split at a time; so is a dataset in the local datasets cache."""
    import datasets

    features = datasets.Features({"messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
                                  "task": datasets.ClassLabel(names=["code", "qa"])})
    chat = [{"messages": [{"role": "user", "content": f"question {i}?"}], "task": i % 2} for i in range(7)]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(chat, features=features),
                               "test": datasets.Dataset.from_list(chat[:2], features=features)})
    dd.save_to_disk(str(tmp_path / "dd"), num_shards={"train": 3, "test": 1})
    assert len(list((tmp_path / "dd" / "train").glob("*.arrow"))) == 3
    got, bad = read_records(tmp_path / "dd", split="train")
    assert bad == 0 and got == [{**r, "task": ["code", "qa"][r["task"]]} for r in chat]
    assert read_records(tmp_path / "dd" / "test")[0] == got[:2]  # a split's own directory is a Dataset
    rows = to_rows(got, text_column(got, "dd"))
    assert analyse(rows).by_task == {"code": 4, "qa": 3} and rows[0].text == "user: question 0?"
    with pytest.raises(DatasetError, match="holds several splits.*choose one with --split"):
        read_records(tmp_path / "dd")
    with pytest.raises(DatasetError, match="has no split 'validation'"):
        read_records(tmp_path / "dd", split="validation")

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    cache_hf_dataset(tmp_path / "hf-cache", "sala_calib", {"train": [{"text": "cached row", "task": "qa"}]})
    assert read_records("sala_calib") == ([{"text": "cached row", "task": "qa"}], 0)
    with pytest.raises(DatasetError, match="nor a dataset in the local datasets cache"):
        read_records("no_such_cached_dataset")


def test_bad_datasets_name_the_problem(tmp_path):
    with pytest.raises(DatasetError, match="no such dataset"):
        read_records(tmp_path / "missing.jsonl")
    with pytest.raises(DatasetError, match="empty"):
        text_column([], "x.jsonl")
    with pytest.raises(DatasetError, match="no text column"):
        text_column([{"body": "x"}], "x.jsonl")
    with pytest.raises(DatasetError, match="no column 'prompt'"):
        text_column([{"text": "x"}], "x.jsonl", "prompt")


def test_pack_sequences():
    packed = pack_sequences([[1, 2, 3], [4, 5]], seq_len=3, eos_id=0)
    assert packed.tolist() == [[1, 2, 3], [0, 4, 5]]
    with pytest.raises(DatasetError, match="fewer than one sequence"):
        pack_sequences([[1]], seq_len=8, eos_id=0)
