"""The quantize job on a Ray cluster of three nodes simulated on this machine (tests/cluster/faults.py),
a worker node removed mid-run and another added: the checkpoint is byte for byte the undisturbed
run's. That run is the session's (tests/conftest.py quantize_run: the same command on local Ray with
two workers; the Hessians are summed per calibration shard in shard order, so neither the worker
count nor the nodes change a byte), which is why this file runs beside the others that share it."""
import os
import re
import signal
import time

import pytest

from tests.cluster.faults import Job, add_node, processes
from tests.conftest import FEW_GATE_PROMPTS, weights_sha

pytestmark = pytest.mark.slow


def test_quantization_survives_a_lost_node_and_uses_an_added_one(quantize_run, plan_file, cluster, cluster_env,
                                                                  tiny_sala_dir, tmp_path):
    """A worker node removed once layer 1 is saved, and another added: the job finishes with the
    same bytes as the undisturbed run, and the lost worker's replacement starts on the new node
    and takes work."""
    out = tmp_path / "lost-node"
    layers = out.with_name(f".{out.name}.layers")
    job = Job.pipeline(cluster_env, "quantize.py", "--model", str(tiny_sala_dir), "--output", str(out), "--no-register",
                       "--kv-plan", str(plan_file), *FEW_GATE_PROMPTS)
    job.wait_until(lambda: (layers / "layer_001.json").exists())
    assert not (layers / "layer_007.json").exists()
    victim = cluster.list_all_nodes()[-1]
    cluster.remove_node(victim)
    # The driver paused, once it has asked for the replacement (the cluster holds it, waiting for
    # a CPU), while the new node comes up: the replacement's start cannot lose the race with the
    # end of a 10-second job; it joins, and then must be given work.
    job.wait_until(lambda: any(a["ActorClassName"] == "LayerWorker" and a["State"] == "PENDING_CREATION"
                               for a in cluster.global_state.actor_table(None).values()), timeout=120)
    os.kill(job.proc.pid, signal.SIGSTOP)
    try:
        added = add_node(cluster)
        deadline = time.monotonic() + 120
        while not processes(cluster, "ray::LayerWorker", constructed=True).get(added):
            assert time.monotonic() < deadline, "no replacement worker started on the added node"
            time.sleep(0.1)
    finally:
        os.kill(job.proc.pid, signal.SIGCONT)
    log = job.finish()
    assert "workers    3 Ray actors on 3 node(s)" in log, log
    errors = "".join(job.err)
    assert re.search(r"worker pid \d+ lost", errors) and "a replacement worker" in errors, errors[-3000:]
    by_node = dict(re.findall(r"node (\w+): (\d+) calls", log))
    assert int(by_node.get(added.node_id, 0)) > 0, (added.node_id, by_node)
    assert "workers    2 Ray actors on 1 node(s)" in quantize_run[1].stdout
    assert weights_sha(out) == weights_sha(quantize_run[0])
