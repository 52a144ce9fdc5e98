"""pipelines/kv_sensitivity.py on tiny-sala with local Ray and MLflow on a temp sqlite; what its
processes say they need in memory, against a smaller host and against what its stages hold on the
real-width model."""
import json
import os
from pathlib import Path

import pytest

from sala.checkpoint_files import verify_manifest
from sala.kv.search import units


def crashing(marker: Path):
    """measure_task, except that the first task measuring the first sparse layer in NVFP4 kills
    its worker process (as a lost node would); the marker file says it happened."""
    def crashing_measure_task(model_path, plan_json, windows, reference, num_threads=1):
        from pipelines.kv_sensitivity import measure_task  # the worker imports the unpatched module

        first_sparse = next(e for e in plan_json["layers"] if e["kind"] == "sparse")
        if first_sparse["kv"] == "nvfp4" and not marker.exists():
            marker.write_text("crashed")
            os._exit(1)
        return measure_task(model_path, plan_json, windows, reference, num_threads)
    return crashing_measure_task


def test_ablation_one_result_per_unit_budget_met_artifacts_logged(tiny_sala_dir, tmp_path, monkeypatch, local_ray, capsys):
    """With the worker measuring the first sparse layer's unit killed once: retried, same numbers."""
    import mlflow
    from mlflow import MlflowClient

    import pipelines.kv_sensitivity as ks
    from pipelines.kv_sensitivity import main
    from sala.checkpoint import read_config
    from sala.engine import Engine

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("SALA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    marker = tmp_path / "crashed"
    real_measure_task = ks.measure_task
    monkeypatch.setattr(ks, "measure_task", crashing(marker))
    out = tmp_path / "tiny-kv"
    rc = main(["--model", str(tiny_sala_dir), "--windows", "2", "--calib-windows", "2", "--output", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert f"plan written to {out / 'kv_plan.json'}" in printed
    config = read_config(tiny_sala_dir)
    plan = json.loads((out / "kv_plan.json").read_text())
    assert sorted((r["kind"], r["layer"]) for r in plan["table"]) == sorted(units(config))  # one result per unit
    assert all({"kl_mean", "top1_agreement", "ppl"} <= set(r) for r in plan["table"])
    assert marker.exists()  # the crash happened, and the retry measured what an undisturbed run does:
    # the unit's numbers equal the same measurement made here, in-process.
    from transformers import AutoTokenizer

    from sala.checkpoint import load_model
    from sala.eval.compare import window_sequences
    from sala.kv import KVPlan
    from sala.kv.measure import reference_baseline
    from sala.tiny import heldout_texts, token_stream

    model = load_model(tiny_sala_dir)
    windows = window_sequences(token_stream(AutoTokenizer.from_pretrained(tiny_sala_dir), heldout_texts(tiny_sala_dir)),
                               ks.SEQ, 4)
    ref = reference_baseline(model, windows[2:], ks.PREFIX)
    base = KVPlan.uniform(config, "fp8", "fp32", {e["layer"]: {"k": e["k_amax"], "v": e["v_amax"]}
                                                  for e in plan["layers"] if e["kind"] == "sparse"})
    first = config.sparse_layers[0]
    want = real_measure_task(str(tiny_sala_dir), base.with_units(kv={first: "nvfp4"}).to_json(), windows[2:], ref)
    (row,) = [r for r in plan["table"] if (r["kind"], r["layer"]) == ("kv", first)]
    assert row["kl_mean"] == pytest.approx(want["kl_mean"], rel=1e-6) and row["top1_agreement"] == want["top1_agreement"]
    # The default budget: 1.2x the all-FP8 baseline's KL, met by the combined plan as re-measured.
    assert plan["budget"]["max_kl"] == pytest.approx(1.2 * plan["metrics"]["baseline_kl_mean"])
    assert plan["metrics"]["kl_mean"] <= plan["budget"]["max_kl"]
    assert verify_manifest(out)  # the copy is a checkpoint main accepts, plan included
    engine = Engine.from_pretrained(out, compile=False)
    assert {e["layer"]: e.get("kv", e.get("state")) for e in plan["layers"]} == engine.config.kv_plan.kv | engine.config.kv_plan.state
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("kv_sensitivity").experiment_id])
    assert {"sensitivity.json", "sensitivity.png", "kv_plan.json"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    assert run.data.metrics["plan_kl_mean"] == plan["metrics"]["kl_mean"]
    # The checkpoint with its plan is a registered version, its tags saying the plan and its cost.
    from registry.models import resolve_model_path

    (version,) = client.search_model_versions("name='tiny-sala-kv'")
    assert version.run_id == run.info.run_id and f"registered models:/tiny-sala-kv/{version.version}" in printed
    assert version.tags["kv_plan"] == engine.config.kv_plan.describe()
    assert int(version.tags["kv_bytes_per_token"]) == sum(engine.config.kv_plan.kv_bytes_per_token(config).values())
    assert int(version.tags["state_bytes_per_seq"]) == sum(engine.config.kv_plan.state_bytes_per_seq(config).values())
    assert float(version.tags["kl_mean"]) == pytest.approx(plan["metrics"]["kl_mean"], rel=1e-5)
    registered = resolve_model_path(f"models:/tiny-sala-kv/{version.version}")
    assert json.loads((registered / "kv_plan.json").read_text()) == plan and verify_manifest(registered)
    # An existing output is not replaced without --overwrite.
    assert main(["--model", str(tiny_sala_dir), "--output", str(out)]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err


def test_refusals_name_a_setting_that_fits(tiny_sala_dir, tmp_path, monkeypatch, local_ray, capsys):
    """Before anything loads, the driver and each task say what they need. Tasks at once that a
    host cannot hold are refused with the --max-concurrent that fits; a driver it cannot hold,
    through the command line, with a one-line error and exit 2. SALA_HOST_MEMORY_GIB stands for a
    smaller host: the local Ray has 2 CPUs, so 2 tasks at once."""
    import pipelines.kv_sensitivity as ks
    from sala.footprint import GIB, CheckpointFootprint, MemoryShortfall

    driver, task = ks.needs(CheckpointFootprint(tiny_sala_dir), 2, 2)
    room = max(driver.total, task.host_bytes(1)) + task.own_bytes // 2  # the driver or one task, not two tasks
    monkeypatch.setenv("SALA_HOST_MEMORY_GIB", str(room / GIB))
    args = ["--windows", "2", "--calib-windows", "2"]
    with pytest.raises(MemoryShortfall, match=r"^2 measurement tasks at once need .*; --max-concurrent 1 would fit$"):
        ks.plan_memory(ks.parse_args(args), tiny_sala_dir, 5)
    assert ks.plan_memory(ks.parse_args(args + ["--max-concurrent", "1"]), tiny_sala_dir, 5) == task
    printed = capsys.readouterr().out
    assert "memory: each measurement task" in printed and "measurement tasks, 1 at once on" in printed
    monkeypatch.setenv("SALA_HOST_MEMORY_GIB", str(driver.total / 2 / GIB))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("SALA_HOME", str(tmp_path / "home"))
    assert ks.main(["--model", str(tiny_sala_dir), "--output", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert "memory: the driver" in captured.out
    (error,) = [line for line in captured.err.splitlines() if line.startswith("error:")]  # MLflow logs around it
    assert error.startswith("error: the driver (calibration, then the reference) needs ") and "run on a host" in error
    assert not (tmp_path / "out").exists()


# The driver's part, then a measurement task's, in one process, as a local run does them in turn.
STAGES = """
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from pipelines.kv_sensitivity import SEQ, measure_task, reference_inputs
from sala.checkpoint import read_config
from sala.eval.compare import window_sequences
from sala.kv import KVPlan
from sala.tiny import token_stream

torch.set_num_threads(1)
path, texts = Path(sys.argv[1]), Path(sys.argv[2]).read_text().split("\\n\\n")
windows = window_sequences(token_stream(AutoTokenizer.from_pretrained(path), texts), SEQ, 2)
amax, reference = reference_inputs(path, windows, 1, "unquantized cache")
measure_task(str(path), KVPlan.uniform(read_config(path), "fp8", "fp32", amax).to_json(), windows[1:], reference)
"""


def test_the_driver_and_a_task_hold_what_they_say(tiny_sala_dir):
    """On the real-width model (1 layer, BF16, 1.6 GiB), the driver's calibration and reference
    on one window each, then a task's measurement, in one process. memwatch counts a process's
    own (anonymous) memory, not the checkpoint's pages that loading maps: the peak stays within
    the larger of the two stated own needs plus 30% of the model (a model held in fp32, or
    copied, goes past it) and is not far below it (a need overstated would refuse runs that fit)."""
    import sys

    from bench.memwatch import run_measured
    from pipelines.kv_sensitivity import needs
    from sala.footprint import CheckpointFootprint
    from sala.realwidth import ensure_realwidth
    from tests.conftest import ROOT

    path = ensure_realwidth(1)
    model = CheckpointFootprint(path)
    own = max(need.own_bytes for need in needs(model, 1, 1))
    result, peak = run_measured([sys.executable, "-c", STAGES, str(path), str(tiny_sala_dir / "heldout.txt")], cwd=ROOT,
                                timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    print(f"peak {peak.peak_tree_bytes / 2**30:.2f} GiB own, stated {own / 2**30:.2f} GiB + the model's "
          f"{model.mapped / 2**30:.2f} GiB mapped")
    assert 0.5 * own < peak.peak_tree_bytes <= own + 0.3 * model.mapped
