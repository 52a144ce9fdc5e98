"""Resolving --model values (registry.models) without MLflow: directories, and the default
model, which resolution finds but never builds (a Serve replica must not train tiny-sala)."""
import pytest

from registry.models import ModelSpecError, default_model, resolve_model_path


def test_default_model_is_found_never_built(tmp_path, monkeypatch, tiny_sala_dir):
    assert resolve_model_path(None) == tiny_sala_dir
    monkeypatch.setenv("SALA_HOME", str(tmp_path))
    with pytest.raises(ModelSpecError) as e:
        default_model()
    assert str(e.value).startswith("no model given and tiny-sala is not built at ")
    assert "python -m sala.tiny" in str(e.value)
    assert list(tmp_path.iterdir()) == []  # nothing was built or created


def test_directories_resolve_to_themselves(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    assert resolve_model_path("ckpt") == tmp_path / "ckpt"
    with pytest.raises(ModelSpecError, match=r"^nope: no such model directory \(nor a models:/ registry URI\)$"):
        resolve_model_path("nope")


def test_ctrl_c_during_an_mlflow_write_waits_for_the_write(tmp_path, monkeypatch):
    """SIGINT landing inside an sqlite INSERT (as it did when the quantize pipeline was stopped just
    as a layer was logged) is held until the write commits, then raised: the metric is stored and
    the run still ends as KILLED, instead of failing on "database is locked"."""
    import os
    import signal

    import mlflow
    from sqlalchemy import event

    from registry.tracking import interrupt_deferred, setup_mlflow

    monkeypatch.setenv("SALA_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    setup_mlflow("interrupt")
    run = mlflow.start_run()
    engine = mlflow.tracking._get_store().engine
    sent = []

    def interrupt(conn, cursor, statement, *args):
        if not sent and statement.lstrip().upper().startswith("INSERT INTO METRICS"):
            sent.append(statement)
            os.kill(os.getpid(), signal.SIGINT)

    event.listen(engine, "before_cursor_execute", interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupt_deferred():
                mlflow.log_metric("layers_done", 3)
    finally:
        event.remove(engine, "before_cursor_execute", interrupt)
    assert sent, "the test never interrupted a write"
    mlflow.end_run("KILLED")
    stored = mlflow.MlflowClient().get_run(run.info.run_id)
    assert stored.info.status == "KILLED"
    assert stored.data.metrics["layers_done"] == 3
