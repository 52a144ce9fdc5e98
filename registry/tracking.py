"""MLflow setup shared by the pipelines and the server: one tracking URI, checked before any expensive work.

Unset MLFLOW_TRACKING_URI means the embedded default, a sqlite file under $SALA_HOME with
artifacts beside it (absolute paths: `ray job submit` runs the driver in a throwaway directory).
A cluster sets MLFLOW_TRACKING_URI to its `mlflow server`; nothing in code changes.
"""
from __future__ import annotations

import os
import signal
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from sala.home import sala_home


class TrackingError(RuntimeError):
    """The MLflow tracking server cannot be used; the message says which URI and why."""


@contextmanager
def interrupt_deferred():
    """Hold Ctrl-C until the MLflow write inside is done, then deliver it.

    A KeyboardInterrupt raised in the middle of an sqlite commit leaves that connection's write
    transaction open, and the run's own end_run (which marks the run KILLED) then waits on it and
    fails with "database is locked": the interrupt would exit 1 with a traceback, not 130.
    """
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)  # now handled by whatever handler was there before


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{sala_home() / 'mlflow.db'}"


def artifact_root() -> str:
    return (sala_home() / "mlartifacts").as_uri()


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    if uri.startswith(("http://", "https://")):
        try:
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout).read()
        except (urllib.error.URLError, OSError) as e:
            raise TrackingError(f"MLflow tracking server {uri} is unreachable ({e})") from e
    elif uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)


def setup_mlflow(experiment: str) -> str:
    """Point mlflow at the configured store, create the experiment if needed; returns its id."""
    import mlflow

    uri = tracking_uri()
    check_reachable(uri)
    mlflow.set_tracking_uri(uri)
    exp = mlflow.get_experiment_by_name(experiment)
    if exp is None:
        location = None if uri.startswith(("http://", "https://")) else artifact_root()
        exp_id = mlflow.create_experiment(experiment, artifact_location=location)
    else:
        exp_id = exp.experiment_id
    mlflow.set_experiment(experiment_id=exp_id)
    return exp_id
