"""The registry (registry/): resolving --model values (directories, and the default model, which
resolution finds but never builds: a Serve replica must not train tiny-sala), Ctrl-C during an
MLflow write, and a registered version as MLflow serves it: its requirements resolve, offline, to
this project's wheel, and its pyfunc generates what the model's own greedy forward does."""
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import pytest
import torch
from packaging.requirements import Requirement
from setuptools.config.pyprojecttoml import read_configuration

from registry.models import ModelSpecError, default_model, resolve_model_path
from tests.conftest import ROOT


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
    # Python's own Ctrl-C handler, as an interactive run has it: a suite started in the background
    # (nohup, `cmd &` in a script) inherits SIGINT ignored, and then nothing would be raised.
    default = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupt_deferred():
                mlflow.log_metric("layers_done", 3)
    finally:
        event.remove(engine, "before_cursor_execute", interrupt)
        signal.signal(signal.SIGINT, default)
    assert sent, "the test never interrupted a write"
    mlflow.end_run("KILLED")
    stored = mlflow.MlflowClient().get_run(run.info.run_id)
    assert stored.info.status == "KILLED"
    assert stored.data.metrics["layers_done"] == 3


@torch.no_grad()
def greedy_text(model, tokenizer, prompt: str, n: int) -> str:
    """The model's full forward, argmax n times, as text: what a greedy pyfunc must return."""
    ids = tokenizer(prompt)["input_ids"]
    out = []
    for _ in range(n):
        out.append(int(model(torch.tensor([ids + out]), use_cache=False).logits[0, -1].argmax()))
    assert not set(out) & set(tokenizer.all_special_ids), "pick prompts the model does not end within n tokens"
    return tokenizer.decode(out)


def test_registered_model_installs_this_project_and_generates_through_the_engine(tiny_sala_dir, tmp_path, monkeypatch,
                                                                               one_torch_thread):
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.pyfunc.scoring_server import invocations

    from registry.models import register_checkpoint, set_alias
    from registry.tracking import setup_mlflow
    from sala.checkpoint import load_model

    monkeypatch.setenv("SALA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    setup_mlflow("registry-test")
    set_alias("tiny-sala-nvfp4", "champion", register_checkpoint(tiny_sala_dir, "tiny-sala-nvfp4"))
    uri = "models:/tiny-sala-nvfp4@champion"

    # The model's requirements, as MLflow installs them (in the model's directory), resolve with no
    # index at all: the one thing to install is this project's wheel, whose dependencies are
    # pyproject's and are already here; every module of this checkout is in it, byte for byte.
    local = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path / "model")))
    print((local / "requirements.txt").read_text())
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--quiet", "--report",
                        str(tmp_path / "report.json"), "-r", "requirements.txt"], cwd=local, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    installs = json.loads((tmp_path / "report.json").read_text())["install"]
    project = read_configuration(ROOT / "pyproject.toml")["project"]
    assert [i["metadata"]["name"] for i in installs] == [project["name"]] == ["minicpm-sala-engine"], \
        [(i["metadata"]["name"], i["metadata"]["version"]) for i in installs]
    (ours,) = installs
    assert re.fullmatch(re.escape(project["version"]) + r"\+src\.[0-9a-f]{12}", ours["metadata"]["version"])
    wanted = {Requirement(d).name for d in project["dependencies"]}
    assert {Requirement(d).name for d in ours["metadata"]["requires_dist"] if "extra ==" not in d} == wanted
    wheel = Path(url2pathname(urlparse(ours["download_info"]["url"]).path))
    assert wheel.parent == local / "artifacts"
    with zipfile.ZipFile(wheel) as z:
        modules = [n for n in z.namelist() if n.endswith(".py")]
        assert "registry/sala_pyfunc.py" in modules and "sala/engine/engine.py" in modules
        assert all(z.read(n) == (ROOT / n).read_bytes() for n in modules)

    # Loaded from the registry, the pyfunc generates with the engine what the model's own greedy
    # forward does, honouring max_new_tokens; so does a request as `mlflow models serve` gets it:
    # the documented ones, parsed by MLflow's scoring server, with its params kept (the signature lists them).
    model = mlflow.pyfunc.load_model(uri)
    base = load_model(tiny_sala_dir)
    tokenizer = model.unwrap_python_model().engine.tokenizer
    prompts = ["The for statement", "def fib(n):", "A list is"]
    assert model.predict(prompts, params={"max_new_tokens": 5}) == [greedy_text(base, tokenizer, p, 5) for p in prompts]
    # One in the README (the main job's next steps), one in docs/registry.md (serving a registered version).
    found = {doc: re.findall(r"curl -s 127.0.0.1:5001/invocations .* -d '(.*)'", (ROOT / doc).read_text())
             for doc in ("README.md", "docs/registry.md")}
    assert [len(b) for b in found.values()] == [1, 1], found
    bodies = [body for doc_bodies in found.values() for body in doc_bodies]
    for body in bodies:
        request = json.loads(body)
        answer = invocations(body, "application/json", model, model.metadata.get_input_schema())
        assert answer.status == 200, answer.response
        n = request["params"]["max_new_tokens"]
        assert json.loads(answer.response)["predictions"] == [greedy_text(base, tokenizer, p, n) for p in request["inputs"]]
    # A bad param is the caller's error, answered 400 with one line (not "an unexpected error" and a traceback).
    with pytest.raises(MlflowException, match=r"temperature must be finite and >= 0, got -1.0$") as e:
        invocations(json.dumps({"inputs": ["x"], "params": {"temperature": -1.0}}), "application/json", model,
                    model.metadata.get_input_schema())
    assert e.value.get_http_status_code() == 400

    # A structured-output constraint in params holds every prompt's output to it: sent as MLflow's
    # scoring server parses it (a choice is a list param, a schema JSON text), and from Python.
    import jsonschema

    def predict(params: dict) -> list[str]:
        answer = invocations(json.dumps({"inputs": prompts, "params": params}), "application/json", model,
                             model.metadata.get_input_schema())
        assert answer.status == 200, answer.response
        return json.loads(answer.response)["predictions"]

    assert set(predict({"choice": ["red", "green", "blue"], "max_new_tokens": 8})) <= {"red", "green", "blue"}
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    for text in predict({"json_schema": json.dumps(schema), "max_new_tokens": 32}):
        jsonschema.validate(json.loads(text), schema)
    for text in model.predict(prompts, params={"regex": r"[a-z]{2,6}-[0-9]{1,3}", "max_new_tokens": 16}):
        assert re.fullmatch(r"[a-z]{2,6}-[0-9]{1,3}", text), text
    # A bad one is a 400 naming the param, before any prompt is queued.
    for params, reason in (({"regex": "[a-z"}, r"^regex: invalid regex constraint: Regex parsing error"),
                           ({"json_schema": '{"type": "object", "not": {}}'}, r"^json_schema: JSON-schema keyword 'not'"),
                           ({"regex": "a", "choice": ["b"]}, r"^give at most one of json_schema, json_object, regex, "
                                                             r"choice, grammar; got regex, choice$")):
        with pytest.raises(MlflowException, match=reason) as e:
            model.predict(prompts, params=params)
        assert e.value.get_http_status_code() == 400
    assert not model.unwrap_python_model().engine.has_work()
