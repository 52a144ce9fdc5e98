"""The MLflow model registry as a source of checkpoints: register a directory, resolve a URI.

A checkpoint is logged as an MLflow pyfunc model whose artifact is the checkpoint directory
itself, so `models:/name@alias` both loads in MLflow (pyfunc predict generates text) and
resolves here to a plain directory the engine and the pipelines read. Beside it goes this
project's wheel (registry/wheel.py), which the model's requirements name: the environment MLflow
builds for it (`mlflow models serve` without `--env-manager local`) is this code at this version
with its real dependencies, whatever a package index holds under our names.
"""
from __future__ import annotations

import re
import tempfile
import warnings
from pathlib import Path

import yaml

from sala.tiny import sala_home, tiny_sala_path

PYFUNC_CODE = Path(__file__).with_name("sala_pyfunc.py")


class ModelSpecError(ValueError):
    """A --model value that is neither a checkpoint directory nor a registry URI that exists."""


def default_model() -> str:
    """tiny-sala's directory if it is built; resolution never trains it (a server replica must not
    spend minutes building a model in its constructor): commands that may build it call
    sala.tiny.ensure_tiny_sala() themselves, before resolving."""
    path = tiny_sala_path()
    if not (path / "manifest.json").exists():
        raise ModelSpecError(f"no model given and tiny-sala is not built at {path}: "
                             "run `python -m sala.tiny` once, or name a checkpoint")
    return str(path)


def register_checkpoint(checkpoint: Path, name: str, tags: dict | None = None, description: str | None = None) -> str:
    """Log `checkpoint` as a model (inside the active run, if any) and register a new version of `name`."""
    import mlflow
    from mlflow import MlflowClient

    from registry.wheel import project_wheel

    wheel = project_wheel()
    with warnings.catch_warnings():
        # No input example: MLflow would validate one by loading the model and generating with it
        # at log time (a 9B checkpoint, on a driver that may have no GPU); the signature says it all.
        warnings.filterwarnings("ignore", message=".*An input example was not provided")  # after its colour code
        info = mlflow.pyfunc.log_model(
            name="checkpoint",
            python_model=str(PYFUNC_CODE),
            artifacts={"checkpoint": str(checkpoint), "wheel": str(wheel)},
            registered_model_name=name,
            signature=pyfunc_signature(),
            # Where MLflow puts the wheel in the model directory, the one it installs the
            # requirements from; pip reads the name and version from the file name.
            pip_requirements=[f"artifacts/{wheel.name}"],
        )
    version = str(info.registered_model_version)
    client = MlflowClient()
    for k, v in (plan_tags(checkpoint) | (tags or {})).items():
        client.set_model_version_tag(name, version, k, str(v))
    if description:
        client.update_model_version(name, version, description=description)
    return version


def pyfunc_signature():
    """What registry/sala_pyfunc.py takes: a column of prompt strings, and the sampling params it
    honours with their defaults (MLflow fills in those a request leaves out, and drops with a
    warning any param a model's signature does not list). The structured-output constraint is
    one of the last five; a schema goes as JSON text, as no param type holds any JSON object."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(inputs=Schema([ColSpec("string")]), outputs=Schema([ColSpec("string")]),
                          params=ParamSchema([ParamSpec("max_new_tokens", "long", 32),
                                              ParamSpec("temperature", "double", 0.0),
                                              ParamSpec("top_p", "double", 1.0),
                                              ParamSpec("top_k", "long", 0),
                                              ParamSpec("seed", "long", None),
                                              ParamSpec("json_schema", "string", None),
                                              ParamSpec("json_object", "boolean", False),
                                              ParamSpec("regex", "string", None),
                                              # A list param's default is a list: the empty one is no choice.
                                              ParamSpec("choice", "string", [], shape=(-1,)),
                                              ParamSpec("grammar", "string", None)]))


def plan_tags(checkpoint: Path) -> dict[str, str]:
    """What a version's tags say of the cache plan its checkpoint carries (kv_plan.json, which
    the engine serves it with): the formats and the bytes a token and a sequence. The plan
    itself is in the version's artifact, the checkpoint directory."""
    from sala.checkpoint import read_config
    from sala.kv import PLAN_FILE, load_plan

    if not (Path(checkpoint) / PLAN_FILE).is_file():
        return {}
    config = read_config(Path(checkpoint))
    plan = load_plan(Path(checkpoint) / PLAN_FILE, config)
    return {"kv_plan": plan.describe(), "kv_bytes_per_token": str(sum(plan.kv_bytes_per_token(config).values())),
            "state_bytes_per_seq": str(sum(plan.state_bytes_per_seq(config).values()))}


def set_alias(name: str, alias: str, version: str) -> None:
    from mlflow import MlflowClient

    MlflowClient().set_registered_model_alias(name, alias, version)


def _registry_version(uri: str) -> tuple[str, str]:
    """models:/name@alias or models:/name/version -> (name, version), or ModelSpecError."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    body = uri.removeprefix("models:/")
    client = MlflowClient()
    try:
        if "@" in body:
            name, alias = body.split("@", 1)
            return name, str(client.get_model_version_by_alias(name, alias).version)
        name, _, version = body.partition("/")
        if not version:
            raise ModelSpecError(f"{uri}: give a version or an alias (models:/name/3 or models:/name@champion)")
        return name, str(client.get_model_version(name, version).version)
    except MlflowException as e:
        raise ModelSpecError(f"{uri}: not in the model registry ({e.message})") from e


def model_name(spec: str | None, model_dir: Path) -> str:
    """A checkpoint's own name: the registered model's, or the directory's without tiny-sala's recipe hash."""
    if spec and spec.startswith("models:/"):
        return spec.removeprefix("models:/").split("@")[0].split("/")[0]
    return re.sub(r"-[0-9a-f]{12}$", "", Path(model_dir).name)


def resolve_model_path(spec: str | None) -> Path:
    """A directory -> itself; a registry URI -> its checkpoint, downloaded once; None -> the
    tiny-sala already built (see default_model)."""
    if spec is None:
        spec = default_model()
    if spec.startswith("models:/"):
        import mlflow

        from registry.tracking import check_reachable, tracking_uri

        check_reachable(tracking_uri())
        mlflow.set_tracking_uri(tracking_uri())
        name, version = _registry_version(spec)
        target = sala_home() / "registry" / name / version
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                local = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}", dst_path=tmp))
                mlmodel = yaml.safe_load((local / "MLmodel").read_text())
                checkpoint = local / mlmodel["flavors"]["python_function"]["artifacts"]["checkpoint"]["path"]
                try:
                    checkpoint.rename(target)
                except OSError:
                    if not target.exists():  # not a concurrent download that finished first
                        raise
        return target
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ModelSpecError(f"{spec}: no such model directory (nor a models:/ registry URI)")
    return path.absolute()
