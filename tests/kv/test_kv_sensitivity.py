"""pipelines/kv_sensitivity.py on tiny-sala with local Ray and MLflow on a temp sqlite."""
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
