"""The three-node cluster of a fault test module (tests/cluster/faults.py), and the environment
that points the project's command lines at it."""
import pytest

from tests.cluster.faults import three_nodes


@pytest.fixture(scope="module")
def cluster():
    with three_nodes() as c:
        yield c


@pytest.fixture(scope="module")
def cluster_env(pipeline_env, cluster):
    return {**pipeline_env, "RAY_ADDRESS": cluster.address, "OMP_NUM_THREADS": "1"}
