"""pipelines/kv_sensitivity.py on tiny-sala with local Ray and MLflow on a temp sqlite."""
import json

import pytest

from sala.checkpoint_files import verify_manifest
from sala.kv.search import units


@pytest.fixture
def local_ray():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, object_store_memory=200 * 2**20, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def test_ablation_one_result_per_unit_budget_met_artifacts_logged(tiny_sala_dir, tmp_path, monkeypatch, local_ray, capsys):
    import mlflow
    from mlflow import MlflowClient

    from pipelines.kv_sensitivity import main
    from sala.checkpoint import read_config
    from sala.engine import Engine

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("SALA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    out = tmp_path / "tiny-kv"
    rc = main(["--model", str(tiny_sala_dir), "--windows", "2", "--calib-windows", "2", "--output", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert f"plan written to {out / 'kv_plan.json'}" in printed
    config = read_config(tiny_sala_dir)
    plan = json.loads((out / "kv_plan.json").read_text())
    assert sorted((r["kind"], r["layer"]) for r in plan["table"]) == sorted(units(config))  # one result per unit
    assert all({"kl_mean", "top1_agreement", "ppl"} <= set(r) for r in plan["table"])
    # The default budget: 1.2x the all-FP8 baseline's KL, met by the combined plan as re-measured.
    assert plan["budget"]["max_kl"] == pytest.approx(1.2 * plan["metrics"]["baseline_kl_mean"])
    assert plan["metrics"]["kl_mean"] <= plan["budget"]["max_kl"]
    assert verify_manifest(out)  # the copy is a checkpoint main accepts, plan included
    engine = Engine.from_pretrained(out, compile=False)
    assert {e["layer"]: e.get("kv", e.get("state")) for e in plan["layers"]} == engine.kv_plan.kv | engine.kv_plan.state
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("kv_sensitivity").experiment_id])
    assert {"sensitivity.json", "sensitivity.png", "kv_plan.json"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    assert run.data.metrics["plan_kl_mean"] == plan["metrics"]["kl_mean"]
    # An existing output is not replaced without --overwrite.
    assert main(["--model", str(tiny_sala_dir), "--output", str(out)]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
