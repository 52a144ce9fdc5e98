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


def test_readers_jsonl_parquet_and_datasets_dir(tmp_path):
    recs = [{"text": f"row {i}", "task": "qa" if i % 2 else "code"} for i in range(6)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n{not json\n")
    got, bad = read_records(tmp_path / "d.jsonl")
    assert got == recs and bad == 1
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "d.parquet")
    assert read_records(tmp_path / "d.parquet") == (recs, 0)
    ds = tmp_path / "ds" / "train"
    ds.mkdir(parents=True)
    table = pa.Table.from_pylist(recs)
    with pa.OSFile(str(ds / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    assert read_records(tmp_path / "ds")[0] == recs
    rows = to_rows(got, text_column(got, "d.jsonl"))
    assert analyse(rows).by_task == {"code": 3, "qa": 3}


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
