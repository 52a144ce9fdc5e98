"""cluster.yaml passes Ray's own launcher validation (which is strict enough to fail), binds
nothing but SSH to a public address, keeps Ray token auth on, and runs MLflow behind its
basic-auth app, whose configuration (deploy/mlflow_auth.ini) refuses a stranger for real."""
import copy
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from tests.conftest import ROOT, free_port

CLUSTER = yaml.safe_load((ROOT / "cluster.yaml").read_text())
COMMANDS = [c for key in ("setup_commands", "head_setup_commands", "head_start_ray_commands", "worker_start_ray_commands")
            for c in CLUSTER[key]]


def test_cluster_yaml_is_valid_for_ray():
    config = prepare_config(copy.deepcopy(CLUSTER))
    validate_config(config)
    workers = config["available_node_types"]["gpu_worker"]
    assert workers["resources"]["GPU"] >= 1
    assert config["available_node_types"]["head"]["resources"]["CPU"] == 0
    assert any("pip install" in c and "sala" in c for c in config["setup_commands"])
    assert any("mlflow server" in c for c in config["head_start_ray_commands"])


def drop_provider(c):
    del c["provider"]


def bad_head_type(c):
    c["head_node_type"] = "nonexistent"


def negative_gpus(c):
    c["available_node_types"]["gpu_worker"]["resources"]["GPU"] = -1


@pytest.mark.parametrize("breakage,error,message", [
    # validate_config alone: prepare_config would fail first with a bare KeyError('provider').
    (drop_provider, jsonschema.ValidationError, "'provider' is a required property"),
    (bad_head_type, ValueError, "`head_node_type` must be one of `available_node_types`."),
    (negative_gpus, jsonschema.ValidationError, "-1 is less than the minimum of 0"),
])
def test_validation_rejects_broken_configs(breakage, error, message):
    broken = copy.deepcopy(CLUSTER)
    breakage(broken)
    with pytest.raises(error) as e:
        validate_config(broken if breakage is drop_provider else prepare_config(broken))
    assert (e.value.message if isinstance(e.value, jsonschema.ValidationError) else str(e.value)) == message


def test_nothing_listens_on_a_public_address():
    assert not [c for c in COMMANDS if "0.0.0.0" in c]
    ray_starts = [c for c in COMMANDS if "ray start" in c]
    assert len(ray_starts) == 2 and all("RAY_AUTH_MODE=token ray start" in c for c in ray_starts)
    head = next(c for c in ray_starts if "--head" in c)
    assert "--dashboard-host=127.0.0.1" in head  # dashboard + job API: through `ray dashboard`'s SSH tunnel
    assert CLUSTER["file_mounts"]["/home/ray/.ray/auth_token"] == "~/.ray/auth_token"  # one token on every node
    mlflow = next(c for c in COMMANDS if "mlflow server" in c)
    assert "--app-name basic-auth" in mlflow
    assert re.search(r'--host "\$\(hostname -I \| awk \'\{print \$1\}\'\)"', mlflow)  # the head's private address
    # The auth config is the repository's file, mounted with the checkout; the password is generated on the head.
    assert CLUSTER["file_mounts"]["/home/ray/sala"] == "."
    assert "MLFLOW_AUTH_CONFIG_PATH=/home/ray/sala/deploy/mlflow_auth.ini" in mlflow
    assert 'MLFLOW_AUTH_ADMIN_PASSWORD="$(cat /home/ray/mlflow/admin_password)"' in mlflow
    assert 'MLFLOW_FLASK_SERVER_SECRET_KEY="$(cat /home/ray/mlflow/secret_key)"' in mlflow
    secrets_made = [c for c in CLUSTER["head_setup_commands"] if "openssl rand" in c and "umask 077" in c]
    assert [re.search(r"> (\S+)\)$", c).group(1) for c in secrets_made] == ["/home/ray/mlflow/admin_password",
                                                                           "/home/ray/mlflow/secret_key"]


def test_mlflow_auth_config_refuses_a_stranger(tmp_path):
    """The cluster's MLflow auth config on a real server (127.0.0.1 here): without credentials or
    with wrong ones nothing is readable and @champion cannot move; the admin can move it."""
    import httpx

    ini = (ROOT / "deploy" / "mlflow_auth.ini").read_text()
    ini = ini.replace("sqlite:////home/ray/mlflow/basic_auth.db", f"sqlite:///{tmp_path / 'auth.db'}")
    assert f"sqlite:///{tmp_path / 'auth.db'}" in ini
    (tmp_path / "auth.ini").write_text(ini)
    password, port = secrets.token_hex(12), free_port()
    env = {**os.environ, "MLFLOW_AUTH_CONFIG_PATH": str(tmp_path / "auth.ini"), "MLFLOW_AUTH_ADMIN_PASSWORD": password,
           "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),
           # Without MLflow's job runner: a consumer process the server would start beside itself
           # (it imports MLflow: 14-21 s of CPU in the suite on 2 cores), which nothing here uses.
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    server = subprocess.Popen([str(Path(sys.executable).with_name("mlflow")), "server", "--app-name", "basic-auth",
                               "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--host", "127.0.0.1",
                               "--port", str(port), "--workers", "1"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None, server.stderr.read()[-2000:]
            time.sleep(0.5)
        admin = httpx.Client(base_url=f"{url}/api/2.0/mlflow", auth=("admin", password), timeout=30)
        assert admin.post("/registered-models/create", json={"name": "m"}).status_code == 200
        alias = {"name": "m", "alias": "champion", "version": "1"}
        for auth in (None, ("admin", "wrong"), ("intruder", password)):
            stranger = httpx.Client(base_url=f"{url}/api/2.0/mlflow", auth=auth, timeout=30)
            assert stranger.post("/registered-models/alias", json=alias).status_code == 401
            assert stranger.get("/registered-models/get", params={"name": "m"}).status_code == 401
        # The admin can; the version does not exist, so the registry (not the auth layer) answers.
        assert admin.post("/registered-models/alias", json=alias).status_code == 404
    finally:
        server.terminate()
        server.wait(timeout=30)
