"""Batch generation over a dataset: prompts in, a parquet dataset of completions out.

    python pipelines/generate.py --dataset prompts.jsonl --output /abs/out      # tiny-sala, greedy
    python pipelines/generate.py --dataset chats.parquet --messages-column messages \\
        --model models:/sala@champion --replicas 4 --num-gpus 1 --max-tokens 256 --output /abs/out

Ray Data reads the dataset (a .jsonl file, a .parquet file or directory, a directory saved by
`datasets.save_to_disk` (`--split` picks a DatasetDict's split) or the name of a dataset in the
local `datasets` cache, read offline), then `map_batches` sends batches to a pool of actors that
each hold one engine (`--replicas`, with `--num-gpus` per replica on GPU nodes, where the engine
runs on CUDA). Output columns follow
Ray Data LLM's schema: generated_text, num_input_tokens, num_generated_tokens, finish_reason,
time_taken_llm, optional logprobs / top_logprobs, and __inference_error__, which is set (and
the rest left empty) for a row that cannot be generated: a line that is not JSON (or holds a
value of another type than the file's other lines), a missing or empty prompt, a prompt longer
than the context, an invalid structured-output constraint. Such a row never fails the job; its token
counts are null, and stay integers (pandas reads them as nullable Int64). Every input keeps its
columns beside the generated ones: a jsonl file's fields are columns, typed from all its lines.

Structured outputs: `--json-schema FILE`, `--regex` or `--choice` constrain every row's output;
a row's `guided_decoding` column (Ray Data LLM's dict: one of json, json_object, regex, choice,
grammar, structural_tag) replaces that for the row.

Tool calls: with `--tool-call-parser NAME` and `--messages-column`, a row's `tools` column (OpenAI's
function tools) goes to the chat template, and the row's output is held to the format's calls
as tool_choice "auto" holds a served request's (sala/tools): generated_text is then the text
outside the calls, and `tool_calls` the calls (name, arguments as JSON text), each valid for its
tool's schema. The messages may hold earlier calls (an assistant's tool_calls) and their results
(`tool` messages), so a dataset of agent turns runs offline.

The driver reads the dataset in chunks of `--batch-size` rows, each row tagged with its position,
and writes each chunk's results as one part file once all its rows are back, beside the final
path (renamed into place when every part is written). A lost engine actor or node costs time,
not rows: Ray Data restarts the actor and retries its batch. A step that raises is retried a
row at a time, and a row that fails alone becomes an `__inference_error__` row. Rows are written
once each, whatever was retried. A driver killed mid-run (or a job
stopped) keeps the parts already written: the same command resumes, skipping those rows.

One MLflow run per invocation records the parameters and throughput.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python pipelines/generate.py` from a checkout or a Ray working_dir
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from pipelines.cli import HelpFormatter  # noqa: E402
from sala.process_exit import exit_now  # noqa: E402

ERROR = "__inference_error__"
ROW = "__row__"  # a row's position in the dataset, carried through the engine stage, never written
LEDGER = "_ledger.json"  # in the partial output: what the parts are of (readers skip files named _*)
PROMPT_COLUMN = "prompt"  # the default --prompt-column, which the quantize job's next steps name too
TOKEN_COUNTS = ("num_input_tokens", "num_generated_tokens")
# A row's own structured-output constraint: Ray Data LLM's name for it (in a row's sampling_params
# there; a column of its own here, since no other sampling parameter is read per row).
GUIDED_DECODING = "guided_decoding"
TOOLS = "tools"  # a row's function tools, OpenAI's


# ----------------------------------------------------------------------------- reading
def input_schema(spec: str, kind: str, split: str | None):
    """The dataset's Arrow schema and row count, read before starting Ray."""
    if kind == "jsonl":
        return jsonl_schema(spec)
    if kind == "datasets":
        from sala.eval.calibration import load_hf_dataset

        ds = load_hf_dataset(spec, split)
        return ds.features.arrow_schema, ds.num_rows
    import pyarrow.parquet as pq

    ds = pq.ParquetDataset(spec)
    return ds.schema, sum(f.metadata.num_rows for f in ds.fragments)


def jsonl_schema(path: str, chunk_lines: int = 4096):
    """The columns of a jsonl file: the fields of its JSON-object lines in order of appearance,
    each typed by all its values (ints and floats make floats, nulls take the other type; a field
    whose values have no common type keeps its first, and lines of the other become error rows),
    and its row count. Read whole, here: Ray Data's blocks must all agree on one schema."""
    import pyarrow as pa

    types: dict = {}

    def absorb(records: list[dict]) -> None:
        for name in dict.fromkeys(k for r in records for k in r):
            values = [r.get(name) for r in records]
            try:
                seen = [pa.array(values).type]
            except (pa.ArrowInvalid, pa.ArrowTypeError):  # values of several types in this chunk
                seen = [pa.array([v]).type for v in values]
            for t in seen:
                if name not in types:
                    types[name] = t
                    continue
                try:
                    types[name] = pa.unify_schemas([pa.schema([(name, types[name])]), pa.schema([(name, t)])],
                                                   promote_options="permissive").field(name).type
                except (pa.ArrowInvalid, pa.ArrowTypeError):
                    pass

    rows, chunk = 0, []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rows += 1
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # an error row (parse_jsonl)
            if isinstance(rec, dict):
                chunk.append(objects_as_text(rec))
            if len(chunk) == chunk_lines:
                absorb(chunk)
                chunk = []
    absorb(chunk)
    return pa.schema(list(types.items())), rows


def input_chunks(spec: str, kind: str, column: str, split: str | None, schema, size: int, skip=frozenset()
                 ) -> Iterator[tuple[int, object]]:
    """The dataset in chunks of `size` rows, in order: (first row's position, Arrow table with
    each row's position in ROW), chunks starting at a position in `skip` left unparsed. Read here,
    in the driver, so that a path on its machine works on any cluster and positions are exact."""
    import pyarrow as pa

    def tagged(start: int, table):
        return start, table.append_column(ROW, pa.array(range(start, start + table.num_rows), pa.int64()))

    if kind == "jsonl":
        lines, start = [], 0
        with open(spec) as f:
            for line in f:
                if not line.strip():
                    continue
                lines.append(line)
                if len(lines) == size:
                    if start not in skip:
                        yield tagged(start, parse_jsonl(pa.table({"text": lines}), column, schema))
                    lines, start = [], start + size
        if lines and start not in skip:
            yield tagged(start, parse_jsonl(pa.table({"text": lines}), column, schema))
        return
    if kind == "datasets":
        from sala.eval.calibration import load_hf_dataset

        # Its Arrow table, not from_huggingface: that asks the Hub for a Parquet export of any
        # dataset that carries a Hub name, and the datasets read here are local, offline.
        batches = load_hf_dataset(spec, split).with_format("arrow")[:].to_batches(max_chunksize=size)
    else:
        import pyarrow.dataset as pads

        batches = pads.dataset(spec, format="parquet").to_batches(batch_size=size)
    pending, start = [], 0
    for batch in batches:  # record batches end at file boundaries: regrouped into chunks of `size`
        pending.append(batch)
        while sum(b.num_rows for b in pending) >= size:
            table = pa.Table.from_batches(pending).combine_chunks()
            if start not in skip:
                yield tagged(start, table.slice(0, size))
            pending, start = table.slice(size).to_batches(), start + size
    if pending and (table := pa.Table.from_batches(pending)).num_rows and start not in skip:
        yield tagged(start, table)


def objects_as_text(rec: dict) -> dict:
    """A jsonl line's guided_decoding object and tools list as their JSON text: rows constrain
    their outputs to different schemas, which Arrow would merge into one struct of every row's
    keys, filling each row's missing ones with nulls (the stage reads the text back: row_constraint,
    row_functions)."""
    return rec | {k: json.dumps(rec[k]) for k, kind in ((GUIDED_DECODING, dict), (TOOLS, list)) if isinstance(rec.get(k), kind)}


def parse_jsonl(batch, column: str, schema):
    """One text line per row -> the line's fields as the columns of `schema` (jsonl_schema's), with
    an error, and null fields, unless it is a JSON object holding `column` with values of those types."""
    import pyarrow as pa

    records, errors = [], []
    for line in batch.column("text").to_pylist():
        try:
            rec = json.loads(line)
        except ValueError as e:
            rec, error = {}, f"line is not valid JSON: {e}"
        else:
            if isinstance(rec, dict):
                error = None if column in rec else f"no '{column}' field"
                rec = objects_as_text(rec)
            else:
                rec, error = {}, "line is not a JSON object"
        records.append(rec)
        errors.append(error)
    try:
        table = pa.Table.from_pylist(records, schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # some line has a value of another type than the file's
        rows = []
        for i, rec in enumerate(records):
            try:
                rows.append(pa.Table.from_pylist([rec], schema=schema))
            except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
                rows.append(pa.Table.from_pylist([{}], schema=schema))
                errors[i] = f"a value of another type than the file's other lines: {e}"
        table = pa.concat_tables(rows)
    return table.append_column(ERROR, pa.array(errors, pa.string()))


# ----------------------------------------------------------------------------- the engine stage
def output_types():
    import pyarrow as pa

    top = pa.struct([("token_id", pa.int64()), ("logprob", pa.float64())])
    return {"generated_text": pa.string(), "num_input_tokens": pa.int64(), "num_generated_tokens": pa.int64(),
            "finish_reason": pa.string(), "time_taken_llm": pa.float64(), "logprobs": pa.list_(pa.float64()),
            "top_logprobs": pa.list_(pa.list_(top)), ERROR: pa.string(),
            "tool_calls": pa.list_(pa.struct([("name", pa.string()), ("arguments", pa.string())]))}


def with_nullable_int_metadata(table, names: tuple[str, ...]):
    """Parquet keeps an int64 column with nulls (an error row's token counts) as int64, but pandas
    reads it as float64 unless the file's pandas metadata names the nullable Int64 dtype: add
    that, beside whatever pandas metadata the input columns brought, so `df.sum()` stays integer."""
    import pandas as pd
    import pyarrow as pa

    ours = json.loads(pa.Schema.from_pandas(pd.DataFrame({n: pd.array([], "Int64") for n in names}),
                                            preserve_index=False).metadata[b"pandas"])
    meta = dict(table.schema.metadata or {})
    base = json.loads(meta[b"pandas"]) if b"pandas" in meta else ours
    base["columns"] = [c for c in base["columns"] if c["name"] not in names] + ours["columns"]
    meta[b"pandas"] = json.dumps(base).encode()
    return table.replace_schema_metadata(meta)


def without_nulls(value):
    """value with every null-valued key of its objects dropped, at any depth."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def row_constraint(value):
    """A row's guided_decoding value (a dict, or its JSON text) -> its StructuredOutputs; None
    where the row has none. A key whose value is null is one the row did not give: a Parquet
    struct column has every row's keys, nulls where a row has none (inside a `json` schema too, so
    a schema that needs a null value goes as JSON text). InvalidParam for anything else."""
    from sala.engine import InvalidParam, StructuredOutputs
    from sala.sampling.params import CONSTRAINT_KINDS

    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidParam(GUIDED_DECODING, f"{GUIDED_DECODING} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidParam(GUIDED_DECODING, f"{GUIDED_DECODING} must be an object, got {type(value).__name__}")
    given = without_nulls(value)
    if unknown := [k for k in given if k not in CONSTRAINT_KINDS]:
        raise InvalidParam(GUIDED_DECODING, f"{GUIDED_DECODING} has unknown key(s) {', '.join(map(repr, unknown))}; "
                                            f"it takes one of {', '.join(CONSTRAINT_KINDS)}")
    if not isinstance(given.get("json_object", False), bool):
        raise InvalidParam(GUIDED_DECODING, "json_object must be true or false")
    return StructuredOutputs(**given).validate()


def row_functions(value) -> list:
    """A row's tools value (OpenAI's function tools, a list or its JSON text) as the functions
    the model may call; InvalidParam for anything else."""
    from sala.engine import InvalidParam
    from sala.tools import Function

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidParam(TOOLS, f"{TOOLS} is not valid JSON: {e}") from None
    try:
        functions = [without_nulls(t)["function"] for t in value]
        return [Function(f["name"], f.get("parameters") or {"type": "object", "properties": {}}) for f in functions]
    except (KeyError, TypeError):
        raise InvalidParam(TOOLS, f'{TOOLS} must be a list of {{"type": "function", "function": {{"name", "parameters"}}}}'
                                  ) from None


class GenerateStage:
    """One engine per actor (the model loads once); each call generates one batch of rows.
    Output columns have fixed Arrow types, so batches that are all errors still share a schema."""

    def __init__(self, model_path: str, column: str, chat: bool, sampling: dict, top_logprobs: int | None,
                 num_threads: int, num_gpus: float, batch_invariant: bool, engine_kwargs: dict,
                 structured_outputs=None, tool_call_parser: str | None = None, mlflow_run: tuple[str, str] | None = None):
        import torch

        from sala.checkpoint import gpu_device
        from sala.engine import Engine, SamplingParams
        from sala.tools import FORMATS, special_texts

        torch.set_num_threads(num_threads)
        self.engine = Engine.from_pretrained(model_path, device=gpu_device(num_gpus), batch_invariant=batch_invariant,
                                             **engine_kwargs)
        self.engine.warmup()
        if mlflow_run and (spec := self.engine.stats().speculation) and spec.trees:
            log_tree_choice(self.engine, *mlflow_run)
        # structured_outputs: the flags' constraint (a StructuredOutputs), every row's unless its own replaces it.
        self.params = SamplingParams(**sampling, logprobs=top_logprobs, structured_outputs=structured_outputs)
        self.column, self.chat, self.top_logprobs = column, chat, top_logprobs
        # The tool-call format of rows with tools; the special tokens their free text never holds.
        self.format = None if tool_call_parser is None else FORMATS[tool_call_parser]
        self.excludes = special_texts(self.engine.tokenizer, self.engine.eos_ids)

    def prompt(self, value, functions: list) -> str:
        from sala.tools.messages import template_message

        if self.chat:
            messages = [template_message(without_nulls(m), i) for i, m in enumerate(value)]
            tools = [{"type": "function", "function": {"name": f.name, "parameters": f.parameters}} for f in functions]
            return self.engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                             tools=tools or None)
        if not isinstance(value, str) or not value:
            raise ValueError(f"'{self.column}' must be a non-empty string")
        return value

    def row_params(self, guided_decoding, functions: list):
        """The sampling parameters of a row whose guided_decoding column holds `guided_decoding`,
        and that may call `functions` (as tool_choice "auto"; the trigger token kept in its text)."""
        from sala.engine import InvalidParam, StructuredOutputs
        from sala.structured import structural_tag

        constraint = row_constraint(guided_decoding)
        if functions:
            if constraint is not None:
                raise InvalidParam(GUIDED_DECODING, f"a row with {TOOLS} holds its output to their calls: it takes no "
                                                    f"{GUIDED_DECODING}")
            tag = structural_tag(self.format.tool_format(functions, "auto", True, self.excludes))
            return dataclasses.replace(self.params, structured_outputs=StructuredOutputs(structural_tag=tag),
                                       skip_special_tokens=False)
        return self.params if constraint is None else dataclasses.replace(self.params, structured_outputs=constraint)

    def __call__(self, batch):
        n = batch.num_rows
        errors = batch.column(ERROR).to_pylist() if ERROR in batch.column_names else [None] * n
        values = batch.column(self.column).to_pylist()
        guided = batch.column(GUIDED_DECODING).to_pylist() if GUIDED_DECODING in batch.column_names else [None] * n
        tools = batch.column(TOOLS).to_pylist() if self.format is not None and TOOLS in batch.column_names else [None] * n
        requests, functions = {}, [[] for _ in range(n)]
        for i, value in enumerate(values):
            if errors[i] is None:
                try:
                    functions[i] = [] if tools[i] is None else row_functions(tools[i])
                    requests[i] = self.prompt(value, functions[i]), self.row_params(guided[i], functions[i])
                except (ValueError, TypeError, KeyError, RecursionError) as e:  # InvalidParam is a ValueError
                    errors[i] = f"{type(e).__name__}: {e}"
        done = {}
        for rows in self._generate(requests, errors):
            done |= rows
        calls = None if self.format is None else {i: self.format.parse(c.text, functions[i], True) for i, c in done.items()}
        return outputs(batch, done, errors, self.top_logprobs, calls)

    def _generate(self, prompts: dict, errors: list) -> Iterator[dict]:
        """Completions of `prompts` (row -> (prompt, its sampling parameters)) in one engine
        batch, rows refused set in `errors` (a constraint that does not compile among them). A
        step that raises fails the batch's cache, not its rows: each is tried again alone, and
        one that fails alone gets the error."""
        from sala.engine import InvalidParam

        requests = {}
        for i, (prompt, params) in prompts.items():
            try:
                requests[i] = self.engine.add_request(prompt, params)
            except (InvalidParam, ValueError, TypeError, KeyError) as e:
                errors[i] = f"{type(e).__name__}: {e}"
        try:
            while self.engine.has_work():
                self.engine.step()
        except Exception as e:
            self.engine.fail_all()
            if len(requests) == 1:
                errors[next(iter(requests))] = f"generation failed: {type(e).__name__}: {e}"
                return
            for i in requests:
                yield from self._generate({i: prompts[i]}, errors)
            return
        yield {i: r.completion() for i, r in requests.items()}


def log_tree_choice(engine, tracking_uri: str, run_id: str) -> None:
    """This actor's Medusa choice (tree per batch size class, its expected accept length and speedup,
    the step times it is made by: [kind, batch size class, nodes, ms]) into the job's MLflow run, one JSON per actor. A failure to
    report is a warning in the actor's log, not a failed job."""
    import os
    import socket

    from mlflow import MlflowClient

    medusa = engine.decoding
    choice = {"describe": medusa.describe(), "trees": [dataclasses.asdict(t) for t in engine.stats().speculation.trees],
              "step_ms": medusa.choice.step_ms()}
    try:
        MlflowClient(tracking_uri).log_dict(run_id, choice, f"medusa_trees/{socket.gethostname()}-{os.getpid()}.json")
    except Exception as e:  # noqa: BLE001 - whatever the tracking store raises
        print(f"warning: could not log the Medusa tree choice to MLflow run {run_id}: {e}", file=sys.stderr)


def outputs(batch, done: dict, errors: list, top_logprobs: int | None, calls: dict | None = None):
    """`batch` with the generated columns: row i's from completion done[i], else null with errors[i];
    with `calls` (row -> its output read by the tool-call format), the text outside the calls as
    generated_text, and the calls that ended as tool_calls."""
    import pyarrow as pa

    n = batch.num_rows

    def column(fn):
        return [fn(done[i]) if i in done else None for i in range(n)]

    values = {
        "generated_text": column(lambda c: c.text) if calls is None else [calls[i].content if i in done else None
                                                                            for i in range(n)],
        "num_input_tokens": column(lambda c: len(c.prompt_ids)),
        "num_generated_tokens": column(lambda c: len(c.token_ids)),
        "finish_reason": column(lambda c: c.finish_reason),
        "time_taken_llm": column(lambda c: c.latency_s),
    }
    if top_logprobs is not None:
        values["logprobs"] = column(lambda c: [e.logprob for e in c.logprobs])
        if top_logprobs:
            values["top_logprobs"] = column(lambda c: [[{"token_id": t, "logprob": lp} for t, lp in e.top]
                                                       for e in c.logprobs])
    if calls is not None:
        values["tool_calls"] = [[{"name": c.name, "arguments": c.arguments} for c in calls[i].calls if c.ended]
                                if i in done else None for i in range(n)]
    values[ERROR] = errors
    table = batch.drop_columns([ERROR]) if ERROR in batch.column_names else batch
    types = output_types()
    for name, vals in values.items():
        table = table.append_column(name, pa.array(vals, types[name]))
    return with_nullable_int_metadata(table, TOKEN_COUNTS)


# ----------------------------------------------------------------------------- the output
class PartWriter:
    """The output as it is written: one parquet part per input chunk, written (to a temporary
    name, then renamed) once every row of the chunk is back, its rows in dataset order; a row
    seen twice is kept once. The ledger says what the parts are of, so a rerun with the same
    inputs and settings keeps them and skips their rows, and any other run starts afresh."""

    def __init__(self, directory: Path, fingerprint: str, chunks: int, size: int):
        self.dir, self.size = directory, size
        ledger = directory / LEDGER
        if not (ledger.is_file() and json.loads(ledger.read_text()).get("fingerprint") == fingerprint):
            shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)
        ledger.write_text(json.dumps({"fingerprint": fingerprint, "chunk_rows": size}))
        self.written = {int(f.stem.split("-")[1]) for f in directory.glob("part-*.parquet")}
        self.expected = {c * size for c in range(chunks)}
        self.arrived: dict[int, dict[int, object]] = {}  # chunk start -> row -> its one-row table
        self.duplicates = 0

    def part(self, start: int) -> Path:
        return self.dir / f"part-{start:012d}.parquet"

    def add(self, table, rows_in_chunk) -> list[int]:
        """Rows of the engine stage's output; returns the chunks this completed (and wrote)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        completed = []
        for i, row in enumerate(table.column(ROW).to_pylist()):
            start = row - row % self.size
            held = self.arrived.setdefault(start, {})
            if row in held or start in self.written:
                self.duplicates += 1
                continue
            held[row] = table.slice(i, 1)
            if len(held) == rows_in_chunk(start):
                part = pa.concat_tables([held[r] for r in sorted(held)]).drop_columns([ROW])
                tmp = self.part(start).with_suffix(".tmp")
                pq.write_table(part, tmp)
                tmp.rename(self.part(start))
                self.written.add(start)
                del self.arrived[start]
                completed.append(start)
        return completed

    def unwritten(self) -> dict[int, set[int]]:
        """The chunks not written yet: each one's start -> its rows already back."""
        return {start: set(self.arrived.get(start, {})) for start in sorted(self.expected - self.written)}


# ----------------------------------------------------------------------------- main
def logit_bias_entry(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS, got {text!r}") from None


def parse_args(argv=None) -> argparse.Namespace:
    from sala.engine.config import add_medusa_arguments
    from sala.tools import FORMATS

    ap = argparse.ArgumentParser(prog="pipelines/generate.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--dataset", required=True, help=".jsonl, .parquet (file or directory), a datasets.save_to_disk "
                                                     "directory, or a dataset name in the local datasets cache")
    ap.add_argument("--split", help="split of a DatasetDict (default: its only split)")
    ap.add_argument("--output", required=True, help="parquet directory to write")
    ap.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    ap.add_argument("--model", help="checkpoint directory or models:/name@alias (default: tiny-sala)")
    ap.add_argument("--prompt-column", default=PROMPT_COLUMN, help="column (a jsonl file's field) of prompt strings")
    ap.add_argument("--messages-column", help="column of chat messages instead (rendered with the chat template)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per row, at most")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    ap.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens only (0 = off)")
    ap.add_argument("--seed", type=int, help="sampling seed (each row draws from its own seeded generator)")
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than this times the most likely")
    ap.add_argument("--min-tokens", type=int, default=0, help="generate at least this many tokens before eos or a stop")
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="> 1 discourages tokens of the prompt and the output so far (1 = off)")
    ap.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted from tokens already generated, [-2, 2]")
    ap.add_argument("--frequency-penalty", type=float, default=0.0, help="subtracted per occurrence in the output, [-2, 2]")
    ap.add_argument("--logit-bias", action="append", default=[], type=logit_bias_entry, metavar="TOKEN_ID=BIAS",
                    help="add BIAS in [-100, 100] to a token's logit (repeatable; -100 bans it)")
    ap.add_argument("--no-stop-trim", action="store_true", help="keep the matched stop string at the end of the text")
    ap.add_argument("--keep-special-tokens", action="store_true", help="leave special tokens in the generated text")
    ap.add_argument("--logprobs", type=int, help="store each token's logprob and this many alternatives (0-256)")
    constrain = ap.add_mutually_exclusive_group()
    constrain.add_argument("--json-schema", metavar="FILE",
                           help="every output is JSON valid against the JSON schema in FILE (a row's "
                                f"'{GUIDED_DECODING}' column replaces the constraint for the row)")
    constrain.add_argument("--regex", help="every output matches this regular expression, whole")
    constrain.add_argument("--choice", nargs="+", metavar="TEXT", help="every output is one of these strings")
    constrain.add_argument("--tool-call-parser", choices=sorted(FORMATS),
                           help=f"the model's tool-call format: a row's '{TOOLS}' column (OpenAI's function tools) goes "
                                "to the chat template, its output is held to calls of them in this format where it "
                                "makes one (as tool_choice \"auto\"), and read into a tool_calls column (needs "
                                "--messages-column)")
    ap.add_argument("--kv-plan", help="kv_plan.json for the cache (default: the checkpoint's own, if it has one)")
    ap.add_argument("--replicas", type=int, default=1, help="engine actors")
    ap.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per engine actor")
    ap.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per engine actor; > 0 runs the engine on CUDA")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="evaluation mode: a row's logprobs are bitwise identical whatever else is in its batch (slower)")
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="decode eagerly: no compiled (CPU) or CUDA-graph (GPU) decode step, so each engine actor "
                         "starts seconds sooner and decodes slower (for short jobs)")
    ap.add_argument("--batch-size", type=int, default=64, help="rows per map_batches call")
    ap.add_argument("--max-batch-tokens", type=int, default=512, help="engine token budget per step")
    add_medusa_arguments(ap)
    ap.add_argument("--experiment", default="generate", help="MLflow experiment")
    args = ap.parse_args(argv)
    for name in ("max_tokens", "replicas", "batch_size"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.num_gpus < 0:
        ap.error("--num-gpus must be >= 0")
    if args.tool_call_parser and not args.messages_column:
        ap.error("--tool-call-parser needs --messages-column: tools go to the chat template")
    return args


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


class ConstraintError(Exception):
    """A bad --json-schema, --regex or --choice: the message names the flag."""


def flag_constraint(args):
    """The StructuredOutputs of --json-schema, --regex or --choice (None without one), checked
    as far as it can be without the model; ConstraintError otherwise."""
    from sala.engine import InvalidParam, StructuredOutputs

    if args.json_schema is not None:
        flag = "--json-schema"
        try:
            c = StructuredOutputs(json=Path(args.json_schema).expanduser().read_text())
        except (OSError, UnicodeDecodeError) as e:
            raise ConstraintError(f"{flag}: cannot read {args.json_schema}: {e}") from None
    elif args.regex is not None:
        flag, c = "--regex", StructuredOutputs(regex=args.regex)
    elif args.choice is not None:
        flag, c = "--choice", StructuredOutputs(choice=args.choice)
    else:
        return None
    try:
        return c.validate()
    except InvalidParam as e:
        raise ConstraintError(f"{flag}: {e}") from None


def compile_check(model_path: Path, c) -> None:
    """Compile the flags' constraint for the model's vocabulary here, before Ray starts, so that a
    schema or regex xgrammar refuses (or an unsupported keyword) is a command-line error, not an
    error in every row; ConstraintError naming the flag."""
    from sala.checkpoint import load_tokenizer, read_config
    from sala.engine import InvalidParam
    from sala.structured import Grammars

    tokenizer = load_tokenizer(model_path)
    try:
        # The stop tokens decide where an output may end, not whether the constraint compiles.
        Grammars(tokenizer, read_config(model_path).vocab_size, {tokenizer.eos_token_id}).compiled(c)
    except InvalidParam as e:
        flag = {"json": "--json-schema", "regex": "--regex", "choice": "--choice"}[c.kind]
        raise ConstraintError(f"{flag}: {e}") from None


def main(argv=None) -> int:
    args = parse_args(argv)
    from pipelines.raycluster import RayUnavailable, init_ray
    from registry.models import ModelSpecError, resolve_model_path
    from registry.tracking import TrackingError, setup_mlflow
    from sala.checkpoint import DeviceUnavailable, gpu_device, read_config
    from sala.engine import InvalidParam, SamplingParams, SpeculationSettingError, parse_max_batch, parse_nodes
    from sala.eval.calibration import DatasetError, dataset_kind
    from sala.kv import KVPlanError, load_plan
    from sala.medusa.heads import has_medusa
    from sala.tiny import ensure_tiny_sala

    output = Path(args.output).expanduser().absolute()
    column = args.messages_column or args.prompt_column
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                    seed=args.seed, stop=args.stop, min_p=args.min_p, min_tokens=args.min_tokens,
                    repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                    frequency_penalty=args.frequency_penalty, logit_bias=dict(args.logit_bias),
                    no_stop_trim=args.no_stop_trim, skip_special_tokens=not args.keep_special_tokens)
    try:
        constraint = flag_constraint(args)
        # The vocabulary is the model's, known in the actors (which check logit_bias ids row by row).
        SamplingParams(**sampling, logprobs=args.logprobs, structured_outputs=constraint).validate(vocab_size=sys.maxsize)
        if not os.environ.get("RAY_ADDRESS"):  # a local Ray has this machine's GPUs or none; a cluster may add GPU nodes
            gpu_device(args.num_gpus)
        if output.exists() and not args.overwrite:
            raise DatasetError(f"{output} exists; pass --overwrite to replace it")
        kind = dataset_kind(args.dataset)
        # A path is made absolute (a Ray job runs elsewhere); a cached dataset's name stays a name.
        dataset = str(Path(args.dataset).expanduser().absolute()) if Path(args.dataset).expanduser().exists() else args.dataset
        if args.split is not None and kind != "datasets":
            raise DatasetError(f"--split: {dataset} is a {kind} dataset, which has no splits")
        schema, rows = input_schema(dataset, kind, args.split)
        if rows == 0:
            raise DatasetError(f"dataset {dataset} has no rows")
        if column not in schema.names:
            raise DatasetError(f"column '{column}' not found in {dataset} (columns: {', '.join(schema.names) or 'none'})")
        model_path = resolve_model_path(args.model or str(ensure_tiny_sala()))
        if constraint is not None:
            compile_check(model_path, constraint)
        # Checked before Ray starts; the actors get the plan itself (a path may not exist on their node).
        kv_plan = None if args.kv_plan is None else load_plan(args.kv_plan, read_config(model_path)).to_json()
        for flag, parse in (("medusa_nodes", parse_nodes), ("medusa_max_batch", parse_max_batch)):
            if getattr(args, flag) is not None:
                setattr(args, flag, parse(getattr(args, flag)))
                if args.medusa is False or args.batch_invariant or not has_medusa(model_path):
                    return fail(f"--{flag.replace('_', '-')}: {model_path} is decoded without Medusa (--no-medusa, "
                                "--batch-invariant, or no medusa/ heads)")
        setup_mlflow(args.experiment)
        init_ray()
    except InvalidParam as e:
        return fail(f"--{e.param.replace('_', '-')}: {e}")
    except ConstraintError as e:
        return fail(str(e))
    except DeviceUnavailable as e:
        return fail(f"--num-gpus: {e}")
    except KVPlanError as e:
        return fail(f"--kv-plan: {e}")
    except SpeculationSettingError as e:
        return fail(str(e))
    except (DatasetError, ModelSpecError, TrackingError, RayUnavailable) as e:
        return fail(str(e))
    return run(args, dataset, kind, column, schema, rows, model_path, output, sampling, kv_plan, constraint)


def run(args, dataset: str, kind: str, column: str, schema, rows: int, model_path: Path, output: Path, sampling: dict,
        kv_plan: dict | None = None, constraint=None) -> int:
    import mlflow
    import pyarrow.parquet as pq
    from tqdm import tqdm

    params = {"model": args.model or "tiny-sala", "model_path": str(model_path), "dataset": dataset, "split": args.split,
              "rows": rows, "column": column, "replicas": args.replicas, "num_gpus": args.num_gpus,
              "batch_invariant": args.batch_invariant, "medusa": args.medusa,
              "medusa_nodes": args.medusa_nodes, "medusa_max_batch": args.medusa_max_batch, "batch_size": args.batch_size,
              "output": str(output), "kv_plan": args.kv_plan, **sampling,
              # The constraint's kind; the constraint itself is the run's artifact structured_outputs.json.
              "structured_outputs": constraint.kind if constraint else None,
              "guided_decoding_column": GUIDED_DECODING in schema.names, "tool_call_parser": args.tool_call_parser}
    stage = dict(model_path=str(model_path), column=column, chat=bool(args.messages_column), sampling=sampling,
                 top_logprobs=args.logprobs, num_threads=max(1, int(args.num_cpus)), num_gpus=args.num_gpus,
                 batch_invariant=args.batch_invariant, structured_outputs=constraint, tool_call_parser=args.tool_call_parser,
                 engine_kwargs={"max_batch_tokens": args.max_batch_tokens, "max_waiting": max(256, args.batch_size),
                                "compile": args.compile,
                                "medusa": args.medusa, "medusa_nodes": args.medusa_nodes,
                                "medusa_max_batch": args.medusa_max_batch, "kv_plan": kv_plan})
    size = args.batch_size
    writer = PartWriter(output.with_name(f".{output.name}.partial"),
                        fingerprint({**params, **stage, "input": input_identity(dataset)}), -(-rows // size), size)

    def rows_in_chunk(start: int) -> int:
        return min(size, rows - start)

    skipped = sum(rows_in_chunk(s) for s in writer.written)
    if skipped:
        print(f"resuming: {skipped} rows already written ({len(writer.written)} parts) are skipped", flush=True)
    with mlflow.start_run(run_name=f"generate-{Path(dataset).stem}") as mlflow_run:
        mlflow.log_params(params)
        if constraint is not None:
            value = json.loads(constraint.json) if constraint.kind == "json" else getattr(constraint, constraint.kind)
            mlflow.log_dict({constraint.kind: value}, "structured_outputs.json")
        start = time.perf_counter()
        bar = tqdm(total=rows, initial=skipped, desc="rows written", unit="row", file=sys.stderr)
        chunks = input_chunks(dataset, kind, column, args.split, schema, size, skip=frozenset(writer.written))
        for block in engine_stage(chunks, stage | {"mlflow_run": (mlflow.get_tracking_uri(), mlflow_run.info.run_id)}, args):
            bar.update(sum(rows_in_chunk(s) for s in writer.add(block, rows_in_chunk)))
        bar.close()
        if writer.unwritten():  # every row is generated or an error row by now
            raise RuntimeError(f"chunks never written: {sorted(writer.unwritten())}")
        wall = time.perf_counter() - start
        (writer.dir / LEDGER).unlink()
        if output.exists():
            shutil.rmtree(output)
        writer.dir.rename(output)
        table = pq.read_table(str(output), columns=[*TOKEN_COUNTS, ERROR])
        errors = table.column(ERROR).drop_null()
        generated = int(np.nansum(table.column("num_generated_tokens").to_numpy(zero_copy_only=False)))
        prompt_tokens = int(np.nansum(table.column("num_input_tokens").to_numpy(zero_copy_only=False)))
        done = table.num_rows - skipped
        metrics = {"rows": table.num_rows, "rows_skipped": skipped, "errors": len(errors), "generated_tokens": generated,
                   "prompt_tokens": prompt_tokens, "wall_s": wall, "rows_per_s": done / wall,
                   "generated_tokens_per_s": generated / wall}
        mlflow.log_metrics(metrics)
    print(f"{table.num_rows} rows ({len(errors)} errors{f', {skipped} from an earlier run' if skipped else ''}) -> "
          f"{output} in {wall:.1f}s: {metrics['generated_tokens_per_s']:.0f} generated tokens/s", flush=True)
    if len(errors):
        print(f"first error: {errors[0].as_py()}", flush=True)
    print(f"mlflow run {mlflow_run.info.run_id} (experiment {args.experiment})", flush=True)
    print(json.dumps(metrics), flush=True)
    return 0


def engine_stage(chunks: Iterator[tuple[int, object]], stage: dict, args) -> Iterator:
    """Ray Data over the chunks: `--replicas` engine actors; Ray Data restarts an actor that dies
    (on another node if its own is gone) and retries its batches there."""
    import ray

    refs = [ray.put(table) for _, table in chunks]
    if not refs:
        return
    ds = ray.data.from_arrow_refs(refs).map_batches(
        GenerateStage, fn_constructor_kwargs=stage, batch_size=args.batch_size, batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=args.replicas), num_cpus=args.num_cpus, num_gpus=args.num_gpus,
        udf_modifying_row_count=False)
    yield from ds.iter_batches(batch_size=None, batch_format="pyarrow")


def input_identity(spec: str) -> list:
    """What tells one version of an input from another: each file's path, size and modification time."""
    path = Path(spec)
    if not path.exists():
        return [spec]  # a dataset in the local datasets cache, by name
    files = sorted(f for f in ([path] if path.is_file() else path.rglob("*")) if f.is_file())
    return [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def fingerprint(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


if __name__ == "__main__":
    exit_now(main())
