"""The three-node cluster of a fault test module (tests/cluster/faults.py), and the environment
that points the project's command lines at it."""
import pytest

from tests.cluster.faults import three_nodes
from tests.conftest import home_env


@pytest.fixture(scope="module")
def cluster():
    with three_nodes() as c:
        yield c


@pytest.fixture(scope="module")
def cluster_env(pipeline_env, cluster, tmp_path_factory):
    """The command lines' environment on the cluster, with a SALA_HOME and MLflow store of the
    module's own: its runs are never among those another module counts in the session's store."""
    return {**pipeline_env, **home_env(tmp_path_factory.mktemp("cluster_home")), "RAY_ADDRESS": cluster.address,
            "OMP_NUM_THREADS": "1"}
