"""cluster.yaml passes Ray's own launcher validation, and the validation is strict enough to fail."""
import copy
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER = yaml.safe_load((Path(__file__).parents[1] / "cluster.yaml").read_text())


def test_cluster_yaml_is_valid_for_ray():
    config = prepare_config(copy.deepcopy(CLUSTER))
    validate_config(config)
    workers = config["available_node_types"]["gpu_worker"]
    assert workers["resources"]["GPU"] >= 1
    assert config["available_node_types"]["head"]["resources"]["CPU"] == 0
    assert any("pip install" in c and "sala" in c for c in config["setup_commands"])
    assert any("mlflow server" in c for c in config["head_start_ray_commands"])


@pytest.mark.parametrize("breakage", ["no_provider", "bad_head_type"])
def test_validation_rejects_broken_configs(breakage):
    broken = copy.deepcopy(CLUSTER)
    if breakage == "no_provider":
        del broken["provider"]
    else:
        broken["head_node_type"] = "nonexistent"
    with pytest.raises(Exception):
        validate_config(prepare_config(broken))
