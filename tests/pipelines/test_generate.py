"""pipelines/generate.py on a real local Ray and a temporary MLflow sqlite store.

Expected texts come from the engine run in this process on the same weights.
"""
import contextlib
import io
import json
import logging
import re
import warnings

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ray.util.annotations import RayDeprecationWarning

from pipelines import generate
from sala.engine import SamplingParams
from sala.tiny import heldout_texts
from tests.conftest import cache_hf_dataset, write_untrained_medusa


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("SALA_HOME", str(tmp_path / "home"))
    return uri


class RecordedLogs(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def prompts(tiny_sala_dir, n):
    texts = [t for t in heldout_texts(tiny_sala_dir) if len(t) > 80]
    return [texts[i % len(texts)][: 30 + (i * 7) % 90] for i in range(n)]


def test_jsonl_with_malformed_rows(tiny_sala_dir, tmp_path, local_ray, mlflow_store, local_engine):
    rows = prompts(tiny_sala_dir, 200)
    lines = [json.dumps({"id": i, "prompt": p}) for i, p in enumerate(rows)]
    lines[57] = '{"id": 57, "prompt": "unterminated'
    lines[120] = json.dumps({"id": "one hundred twenty", "prompt": rows[120]})  # an id of another type
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    ray_data_log = RecordedLogs()
    logging.getLogger("ray.data").addHandler(ray_data_log)
    try:
        # The engine actor holds both CPUs.
        with contextlib.redirect_stdout(io.StringIO()) as stdout, warnings.catch_warnings():  # not capsys: Ray's
            warnings.simplefilter("error", RayDeprecationWarning)  # loggers would keep its stream
            code = generate.main(["--dataset", str(data), "--output", str(out), "--model", str(tiny_sala_dir),
                                  "--max-tokens", "4", "--batch-size", "50", "--logprobs", "2", "--batch-invariant",
                                  "--num-cpus", "2"])
    finally:
        logging.getLogger("ray.data").removeHandler(ray_data_log)
    assert code == 0
    # Reading, parsing and writing take no CPU from the engine actors: nothing waits for one, nor
    # does Ray Data see none free as the job ends ("The Dataset job will hang").
    assert not [m for m in ray_data_log.messages if "available CPUs" in m]
    printed = stdout.getvalue()
    print(printed)
    # The error row's token counts are null, and the columns stay integers: in the Parquet schema,
    # and in pandas (nullable Int64), so sums are integers.
    for f in sorted(out.glob("*.parquet")):
        schema = pq.read_schema(f)
        assert schema.field("num_input_tokens").type == pa.int64() and schema.field("num_generated_tokens").type == pa.int64()
    df = pd.read_parquet(out)
    print(df.dtypes[list(generate.TOKEN_COUNTS)].to_dict(), df[list(generate.TOKEN_COUNTS)].sum().to_dict())
    assert all(str(df[c].dtype) == "Int64" for c in generate.TOKEN_COUNTS)
    assert df["num_generated_tokens"].isna().sum() == 2 and isinstance(df["num_generated_tokens"].sum().item(), int)
    table = pq.read_table(str(out))
    # The lines' fields are columns, typed as the file's lines have them, beside the generated ones.
    assert table.schema.names[:2] == ["id", "prompt"] and table.schema.field("id").type == pa.int64()
    table = table.to_pandas()
    assert len(table) == 200
    bad = table[table[generate.ERROR].notna()]
    assert list(bad.index) == [57, 120] and "not valid JSON" in bad[generate.ERROR][57]
    assert "another type" in bad[generate.ERROR][120] and "'one hundred twenty'" in bad[generate.ERROR][120]
    assert bad["generated_text"].isna().all()
    good = table[table[generate.ERROR].isna()]
    assert len(good) == 198 and (good["num_generated_tokens"] <= 4).all()
    assert list(good["id"]) == [i for i in range(200) if i not in (57, 120)] and list(good["prompt"]) == list(good.index.map(rows.__getitem__))
    expected = local_engine.generate([rows[i] for i in (0, 1, 199)], SamplingParams(max_tokens=4, temperature=0, logprobs=2))
    for i, c in zip((0, 1, 199), expected):
        assert table["generated_text"][i] == c.text
        assert list(table["logprobs"][i]) == pytest.approx([e.logprob for e in c.logprobs], abs=1e-4)
        assert len(table["top_logprobs"][i][0]) == 2

    import mlflow

    mlflow.set_tracking_uri(mlflow_store)
    (run,) = mlflow.search_runs(experiment_names=["generate"], output_format="list")
    assert run.data.metrics["rows"] == 200 and run.data.metrics["errors"] == 2
    assert run.data.metrics["generated_tokens_per_s"] > 0
    assert f"mlflow run {run.info.run_id}" in printed


def test_parquet_messages_column(tiny_sala_dir, tmp_path, local_ray, mlflow_store, local_engine):
    import pyarrow as pa

    chats = [[{"role": "user", "content": q}] for q in ("What is a list?", "Explain json.", "Name a module.")]
    data = tmp_path / "chats.parquet"
    pq.write_table(pa.table({"conversation": chats, "tag": ["a", "b", "c"]}), str(data))
    out = tmp_path / "out"
    assert generate.main(["--dataset", str(data), "--output", str(out), "--model", str(tiny_sala_dir),
                          "--messages-column", "conversation", "--max-tokens", "5", "--num-cpus", "0.5", "--batch-invariant",
                          "--repetition-penalty", "1.3", "--min-tokens", "3", "--logit-bias", "17=2.5"]) == 0
    table = pq.read_table(str(out)).to_pandas()
    assert list(table["tag"]) == ["a", "b", "c"] and table[generate.ERROR].isna().all()
    templated = [local_engine.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    expected = local_engine.generate(templated, SamplingParams(max_tokens=5, temperature=0, repetition_penalty=1.3,
                                                               min_tokens=3, logit_bias={17: 2.5}))
    assert list(table["generated_text"]) == [c.text for c in expected]


def test_dataset_dict_feeds_calibration_and_batch_generation(tiny_sala_dir, tmp_path, local_ray, mlflow_store,
                                                            local_engine, monkeypatch):
    """One DatasetDict saved with `datasets` (several shards, a chat column, a label column):
    its train split calibrates, and batch generation reads the split asked for, keeping the
    columns; a dataset in the local datasets cache is taken by name."""
    import datasets

    from sala.eval.calibration import calibration_source

    chats = [[{"role": "user", "content": q}] for q in ("What is a list?", "Explain json.", "Name a module.", "What is a set?")]
    features = datasets.Features({"messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
                                  "tag": datasets.ClassLabel(names=["a", "b"])})
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"messages": chats, "tag": [0, 1, 0, 1]}, features=features),
        "test": datasets.Dataset.from_dict({"messages": chats[:2], "tag": [1, 1]}, features=features)})
    dd.save_to_disk(str(tmp_path / "dd"), num_shards={"train": 2, "test": 1})

    rows, report = calibration_source(local_engine.tokenizer, str(tmp_path / "dd"), split="train")
    assert report.rows == 4 and rows[0].text.startswith("<|im_start|>user\nWhat is a list?")

    out = tmp_path / "out"
    assert generate.main(["--dataset", str(tmp_path / "dd"), "--split", "train", "--output", str(out),
                          "--model", str(tiny_sala_dir), "--messages-column", "messages", "--max-tokens", "5",
                          "--num-cpus", "0.5", "--batch-invariant"]) == 0
    table = pq.read_table(str(out)).to_pandas()
    templated = [local_engine.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    expected = local_engine.generate(templated, SamplingParams(max_tokens=5, temperature=0, repetition_penalty=1.3,
                                                               min_tokens=3, logit_bias={17: 2.5}))
    assert list(table["generated_text"]) == [c.text for c in expected] and list(table["tag"]) == [0, 1, 0, 1]

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    cache_hf_dataset(tmp_path / "hf-cache", "sala_prompts", {"train": [{"prompt": "The for statement"}] * 3,
                                                              "test": [{"prompt": "The json module"}]})
    out = tmp_path / "out-cached"
    assert generate.main(["--dataset", "sala_prompts", "--split", "test", "--output", str(out), "--model", str(tiny_sala_dir),
                          "--max-tokens", "3", "--num-cpus", "0.5", "--batch-invariant"]) == 0
    (row,) = pq.read_table(str(out)).to_pylist()
    assert row["prompt"] == "The json module"
    assert row["generated_text"] == local_engine.generate(["The json module"], SamplingParams(max_tokens=3, temperature=0))[0].text


# Fields a tiny-sala output fills within 48 tokens, at temperature 1.0 too: short strings, bounded numbers.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}, "tag": {"enum": ["a", "b"]}},
          "required": ["name", "n", "ok"], "additionalProperties": False}


def test_structured_outputs_from_flags_and_rows(tiny_sala_dir, tmp_path, local_ray, mlflow_store):
    """--json-schema constrains every row, sampled at temperature 1.0: each output that did not
    run out of tokens is JSON valid against the schema (and most did not); a row's
    guided_decoding replaces the flag's constraint for that row; a row whose constraint is bad is
    an error row and the others complete. The constraint's kind is in the MLflow run."""
    import jsonschema

    rows = [{"prompt": p} for p in prompts(tiny_sala_dir, 12)]
    regex = r"[a-z]{2,6}-[0-9]{1,3}"
    rows[3]["guided_decoding"] = {"regex": regex}
    rows[5]["guided_decoding"] = {"regex": "[a-z"}  # does not compile
    rows[8]["guided_decoding"] = {"choice": ["yes", "no"], "backend": "xgrammar"}  # a key we would not honour
    # An enum of mixed types: no Arrow type holds it beside the other rows' dicts (the line is read as JSON text).
    own = {"type": "object", "properties": {"v": {"enum": [1, "x"]}}, "required": ["v"], "additionalProperties": False}
    rows[10]["guided_decoding"] = {"json": own}
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    out = tmp_path / "out"
    with contextlib.redirect_stdout(io.StringIO()):
        assert generate.main(["--dataset", str(data), "--output", str(out), "--model", str(tiny_sala_dir),
                              "--json-schema", str(schema), "--max-tokens", "48", "--temperature", "1.0", "--seed", "0",
                              "--no-compile", "--num-cpus", "1"]) == 0
    table = pq.read_table(str(out)).to_pandas()
    errors = table[generate.ERROR]
    assert list(errors[errors.notna()].index) == [5, 8], errors.to_dict()
    assert "invalid regex constraint" in errors[5]
    assert "unknown key(s) 'backend'" in errors[8]
    assert re.fullmatch(regex, table["generated_text"][3]) and table["finish_reason"][3] == "stop"
    assert table["finish_reason"][10] == "stop"
    jsonschema.validate(json.loads(table["generated_text"][10]), own)
    json_rows = table.drop(index=[3, 5, 8, 10])
    finished = json_rows[json_rows["finish_reason"] != "length"]
    assert len(finished) >= len(json_rows) // 2, json_rows[["generated_text", "finish_reason"]]
    for text in finished["generated_text"]:
        jsonschema.validate(json.loads(text), SCHEMA)

    import mlflow

    mlflow.set_tracking_uri(mlflow_store)
    (run,) = mlflow.search_runs(experiment_names=["generate"], output_format="list")
    assert run.data.params["structured_outputs"] == "json" and run.data.params["guided_decoding_column"] == "True"
    assert mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/structured_outputs.json") == {"json": SCHEMA}


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 6}, "utc": {"type": "boolean"}},
         "required": ["tz"], "additionalProperties": False}


def tool(name: str, schema: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": schema}}


def test_tools_column_runs_through_the_tool_call_parser(tiny_sala_dir, tmp_path, local_ray, mlflow_store):
    """A dataset of agent turns, sampled at temperature 1.0 with tiny-sala's call token favoured:
    each row's tools (two sets of different schemas) go to the chat template, and every call a
    row makes is valid for its own tools' schemas (jsonschema); generated_text holds no call
    syntax; a row whose messages hold an earlier call and its result runs; a row without tools
    is text, with no calls."""
    import jsonschema

    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    earlier = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    sets = [[tool("get_weather", WEATHER)], [tool("get_time", CLOCK), tool("get_weather", WEATHER)]]
    rows = [{"messages": earlier if i == 3 else ask, "tools": sets[i % 2]} for i in range(10)] + [{"messages": ask}]
    data = tmp_path / "turns.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    with contextlib.redirect_stdout(io.StringIO()):
        assert generate.main(["--dataset", str(data), "--output", str(out), "--model", str(tiny_sala_dir),
                              "--messages-column", "messages", "--tool-call-parser", "minicpm", "--logit-bias", "543=8",
                              "--temperature", "1.0", "--seed", "0", "--max-tokens", "48", "--no-compile",
                              "--num-cpus", "1"]) == 0
    table = pq.read_table(str(out)).to_pylist()
    assert all(r[generate.ERROR] is None for r in table), [r[generate.ERROR] for r in table]
    calls = 0
    for row, given in zip(table, rows):
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in given.get("tools", [])}
        assert "<|tool_call|>" not in row["generated_text"]
        for call in row["tool_calls"]:
            jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
            calls += 1
    assert calls >= 5 and table[-1]["tool_calls"] == [], table


def test_guided_decoding_from_a_parquet_struct_column():
    """A Parquet column of guided_decoding dicts is one struct of every row's keys, each row's
    missing ones null (inside its schema too): a row's constraint is what the row gave."""
    from sala.engine import InvalidParam, StructuredOutputs

    given = [{"regex": "[0-9]+"}, {"choice": ["yes", "no"]}, None,
             {"json": {"type": "object", "properties": {"a": {"type": "string"}}}},
             {"json": {"type": "object", "properties": {"b": {"type": "integer", "minimum": 0}}}}]
    column = pa.array(given).to_pylist()
    assert column[0]["choice"] is None and column[3]["json"]["properties"]["b"] is None  # what Arrow made of them
    assert [generate.row_constraint(v) for v in column] == [None if g is None else StructuredOutputs(**g) for g in given]
    assert generate.row_constraint(json.dumps(given[0])) == StructuredOutputs(regex="[0-9]+")  # a jsonl line's, as text
    with pytest.raises(InvalidParam, match="give exactly one of json, json_object, regex, choice, grammar, structural_tag; "
                                           "got regex, choice"):
        generate.row_constraint({"regex": "a", "choice": ["b"]})
    with pytest.raises(InvalidParam, match="guided_decoding must be an object, got list"):
        generate.row_constraint(["a"])


def test_help_shows_real_defaults(capsys):
    with pytest.raises(SystemExit):
        generate.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "(default: tiny-sala)" in text
    assert "at most (default: 64)" in text  # --max-tokens


def test_cli_errors_are_one_line_and_nonzero(tiny_sala_dir, tmp_path, mlflow_store, capsys, monkeypatch):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "hi"}\n')
    not_json = tmp_path / "not.json"
    not_json.write_text('{"type": "object",')
    unsupported = tmp_path / "unsupported.json"
    unsupported.write_text('{"type": "object", "not": {"required": ["a"]}}')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    existing = tmp_path / "existing"
    existing.mkdir()
    cases = {
        "no such dataset": ["--dataset", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o1")],
        "nor a dataset in the local datasets cache": ["--dataset", "no_such_cached_dataset", "--output", str(tmp_path / "o5")],
        "has no splits": ["--dataset", str(good), "--output", str(tmp_path / "o6"), "--split", "train"],
        "column 'text' not found": ["--dataset", str(good), "--output", str(tmp_path / "o2"), "--prompt-column", "text"],
        "has no rows": ["--dataset", str(empty), "--output", str(tmp_path / "o3")],
        "pass --overwrite": ["--dataset", str(good), "--output", str(existing)],
        "temperature": ["--dataset", str(good), "--output", str(tmp_path / "o4"), "--temperature", "-1"],
        "--repetition-penalty: repetition_penalty must be > 0": ["--dataset", str(good), "--output", str(tmp_path / "o8"),
                                                                 "--repetition-penalty", "0"],
        "--logit-bias: logit_bias for token 5 must be in [-100, 100]": ["--dataset", str(good), "--output",
                                                                         str(tmp_path / "o9"), "--logit-bias", "5=300"],
        "--json-schema: cannot read": ["--dataset", str(good), "--output", str(tmp_path / "o10"),
                                       "--json-schema", str(tmp_path / "nope.json")],
        "--json-schema: json is not valid JSON": ["--dataset", str(good), "--output", str(tmp_path / "o11"),
                                                  "--json-schema", str(not_json)],
        "--json-schema: JSON-schema keyword 'not' at # is not supported": ["--dataset", str(good), "--output",
                                                                          str(tmp_path / "o12"), "--json-schema",
                                                                          str(unsupported)],
        "--regex: invalid regex constraint: Regex parsing error": ["--dataset", str(good), "--output",
                                                                   str(tmp_path / "o13"), "--regex", "[a-z"],
        "--min-tokens: min_tokens cannot be combined with structured outputs": ["--dataset", str(good), "--output",
                                                                                str(tmp_path / "o14"), "--choice", "a",
                                                                                "b", "--min-tokens", "2"],
    }
    import torch

    if not torch.cuda.is_available():
        cases["--num-gpus: 1 GPU(s) asked for, but torch"] = ["--dataset", str(good), "--output", str(tmp_path / "o7"),
                                                             "--num-gpus", "1"]
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for expected, argv in cases.items():
        assert generate.main(argv + ["--model", str(tiny_sala_dir)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and expected in err and "\n" not in err, err


@pytest.fixture(scope="module")
def heads_checkpoint(tiny_sala_dir, tmp_path_factory):
    """tiny-sala with untrained Medusa heads (their tree verifies, rarely accepts)."""
    return write_untrained_medusa(tiny_sala_dir, tmp_path_factory.mktemp("medusa") / "tiny-sala-medusa",
                                  tree=[[0], [1], [0, 0]])


def test_medusa_generation_is_lossless_and_logs_each_actors_tree_choice(tiny_sala_dir, heads_checkpoint, tmp_path,
                                                                        local_ray, mlflow_store, local_engine):
    """A checkpoint with Medusa heads generates with what its engine actor chose at start-up (the
    default, medusa_nodes='auto'; heads with no measured acceptance: their tree where it pays):
    greedy rows equal plain greedy decoding, and the actor's choice (per batch size class timed,
    the tree, its expected accept length and speedup; the step times) is in the job's MLflow run."""
    rows = prompts(tiny_sala_dir, 6)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    out = tmp_path / "out"
    with contextlib.redirect_stdout(io.StringIO()):
        assert generate.main(["--dataset", str(data), "--output", str(out), "--model", str(heads_checkpoint),
                              "--max-tokens", "12", "--no-compile", "--temperature", "0"]) == 0
    expected = local_engine.generate(rows, SamplingParams(max_tokens=12, temperature=0))
    assert list(pq.read_table(str(out)).to_pandas()["generated_text"]) == [c.text for c in expected]
    import mlflow

    mlflow.set_tracking_uri(mlflow_store)
    (run,) = mlflow.search_runs(experiment_names=["generate"], output_format="list")
    (artifact,) = mlflow.artifacts.list_artifacts(run_id=run.info.run_id, artifact_path="medusa_trees")
    choice = mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/{artifact.path}")
    assert choice["describe"].startswith("Medusa trees chosen from measured step costs")
    assert ["greedy", 1, 0] in [row[:3] for row in choice["step_ms"]]  # [kind, batch size class, nodes, ms]
    assert {(t["kind"], t["batch"]) for t in choice["trees"]} <= {(k, c) for k, c, _, _ in choice["step_ms"]}
    assert ("greedy", 1) in {(t["kind"], t["batch"]) for t in choice["trees"]}
    assert all(t["nodes"] == 0 or t["speedup"] >= 1 for t in choice["trees"])
    assert run.data.params["medusa_nodes"] == "None"
