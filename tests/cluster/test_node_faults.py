"""Faults on a Ray cluster of three nodes simulated on this machine (tests/cluster/faults.py: a
head and two workers, each its own raylet and object store, one CPU each), with the project's
real command lines pointed at it through RAY_ADDRESS. Each fault is checked against the same run
without it: a lost node or a killed process may cost time, never a byte, a row or a request."""
import hashlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.cluster.faults import Job, add_node, load_through, parts_written, processes, serving_replicas, three_nodes
from tests.conftest import SMALL, free_port

pytestmark = pytest.mark.slow
QUANTIZE = [*SMALL, "--gate-prompts", "8", "--no-register"]


@pytest.fixture(scope="module")
def cluster():
    with three_nodes() as c:
        yield c


@pytest.fixture(scope="module")
def cluster_env(pipeline_env, cluster):
    return {**pipeline_env, "RAY_ADDRESS": cluster.address, "OMP_NUM_THREADS": "1"}


def weights_sha(ckpt: Path) -> str:
    return hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()


# ------------------------------------------------------------------------------- quantization
@pytest.fixture(scope="module")
def undisturbed_checkpoint(cluster_env, tiny_sala_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("quantize") / "undisturbed"
    log = Job.pipeline(cluster_env, "quantize.py", "--model", str(tiny_sala_dir), "--output", str(out), *QUANTIZE).finish()
    assert "workers    3 Ray actors on 3 node(s)" in log, log
    return out


def test_quantization_survives_a_lost_node_and_uses_an_added_one(cluster, cluster_env, tiny_sala_dir, tmp_path,
                                                                  undisturbed_checkpoint):
    """A worker node removed once layer 1 is saved, and another added: the job finishes with the
    same bytes as the undisturbed run, and the lost worker's replacement starts on the new node
    and takes work."""
    out = tmp_path / "lost-node"
    layers = out.with_name(f".{out.name}.layers")
    job = Job.pipeline(cluster_env, "quantize.py", "--model", str(tiny_sala_dir), "--output", str(out), *QUANTIZE)
    job.wait_until(lambda: (layers / "layer_001.json").exists())
    assert not (layers / "layer_007.json").exists()
    victim = cluster.list_all_nodes()[-1]
    cluster.remove_node(victim)
    job.wait_until(lambda: "lost" in "".join(job.err), timeout=120)
    # The driver paused while the new node comes up, so that the replacement's start cannot lose
    # the race with the end of a 10-second job: it joins, and then must be given work.
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
    errors = "".join(job.err)
    assert re.search(r"worker pid \d+ lost", errors) and "a replacement worker" in errors, errors[-3000:]
    by_node = dict(re.findall(r"node (\w+): (\d+) calls", log))
    assert int(by_node.get(added.node_id, 0)) > 0, (added.node_id, by_node)
    assert weights_sha(out) == weights_sha(undisturbed_checkpoint)


# --------------------------------------------------------------------------- batch generation
ROWS, BATCH = 160, 16


@pytest.fixture(scope="module")
def prompts_file(tiny_sala_dir, tmp_path_factory):
    """Prompts with an id each, one of them a line that is not JSON (an error row in every run)."""
    from sala.tiny import heldout_texts

    texts = [t for t in heldout_texts(tiny_sala_dir) if len(t) > 80]
    lines = [json.dumps({"id": i, "prompt": texts[i % len(texts)][: 20 + (i * 7) % 60]}) for i in range(ROWS)]
    lines[101] = '{"id": 101, "prompt": "unterminated'
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def generate(env, prompts_file, tiny_sala_dir, out: Path) -> Job:
    return Job.pipeline(env, "generate.py", "--dataset", str(prompts_file), "--output", str(out), "--model",
                        str(tiny_sala_dir), "--replicas", "2", "--num-cpus", "1", "--batch-size", str(BATCH),
                        "--max-tokens", "8")


def read_rows(out: Path):
    import pandas as pd

    return pd.read_parquet(out).drop(columns=["time_taken_llm"])


@pytest.fixture(scope="module")
def undisturbed_rows(cluster_env, prompts_file, tiny_sala_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("generate") / "undisturbed"
    generate(cluster_env, prompts_file, tiny_sala_dir, out).finish()
    rows = read_rows(out)
    assert len(rows) == ROWS and rows["generated_text"].notna().sum() == ROWS - 1
    return rows


def assert_same_rows(out: Path, expected):
    """Every input row once, none added, each as the undisturbed run wrote it (errors included)."""
    import pandas as pd

    rows = read_rows(out)
    assert len(rows) == ROWS and sorted(rows["id"].dropna().astype(int)) == [i for i in range(ROWS) if i != 101]
    pd.testing.assert_frame_equal(rows.reset_index(drop=True), expected.reset_index(drop=True))


@pytest.mark.parametrize("fault", ["actor killed", "node removed"])
def test_generation_writes_every_row_once_through_a_fault(cluster, cluster_env, prompts_file, tiny_sala_dir, tmp_path,
                                                          undisturbed_rows, fault):
    """One engine actor's process SIGKILLed, or the node under it removed, once rows are being
    written: the job ends well and its output equals the undisturbed run's, row for row."""
    out = tmp_path / "out"
    job = generate(cluster_env, prompts_file, tiny_sala_dir, out)
    job.wait_until(lambda: parts_written(out) >= 2 and len(processes(cluster, "GenerateStage")) == 2)
    # One CPU a node: the two actors are on two nodes, at most one of them the head, which stays.
    node, pids = next((n, p) for n, p in processes(cluster, "GenerateStage").items() if n is not cluster.head_node)
    if fault == "actor killed":
        os.kill(pids[0], signal.SIGKILL)
    else:
        cluster.remove_node(node)
    assert parts_written(out) < ROWS // BATCH
    job.finish()
    if fault == "node removed":
        add_node(cluster)
    assert_same_rows(out, undisturbed_rows)


def test_a_killed_driver_resumes_where_it_stopped(cluster_env, prompts_file, tiny_sala_dir, tmp_path, undisturbed_rows):
    """The driver SIGKILLed with part of the output written; the same command again skips those
    rows (and says so), generates the rest, and the output equals the undisturbed run's."""
    out = tmp_path / "out"
    job = generate(cluster_env, prompts_file, tiny_sala_dir, out)
    job.wait_until(lambda: parts_written(out) >= 3)
    job.kill()
    kept = parts_written(out)
    assert 3 <= kept < ROWS // BATCH and not out.exists()
    log = generate(cluster_env, prompts_file, tiny_sala_dir, out).finish()
    assert f"resuming: {kept * BATCH} rows already written ({kept} parts) are skipped" in log, log
    assert_same_rows(out, undisturbed_rows)


# ------------------------------------------------------------------------------------ serving
@pytest.fixture(scope="module")
def server(cluster_env, tiny_sala_dir):
    """`python -m serve.app` with two replicas on the cluster (prefix routing on, as by default),
    its HTTP proxy on the head (the nodes share this machine's ports); stopped by SIGTERM, which
    deletes the app."""
    port = free_port()
    job = Job(cluster_env, "-m", "serve.app", "--model", str(tiny_sala_dir), "--num-replicas", "2", "--num-cpus", "1",
              "--num-threads", "1", "--port", str(port), "--proxy-location", "HeadOnly")
    try:
        job.wait_until(lambda: any(line.startswith("serving on ") for line in job.out), timeout=600)
        yield f"http://127.0.0.1:{port}"
    finally:
        job.proc.send_signal(signal.SIGTERM)
        job.finish(timeout=60)


@pytest.mark.parametrize("fault", ["replica killed", "node removed"])
def test_serving_loses_no_request_when_a_replica_dies(cluster, server, fault):
    """Two replicas on two nodes under a mixed load; one replica's process SIGKILLed, or its node
    removed (a node added back). No non-streaming request fails; no stream is cut (one that had
    sent tokens ends with an error event, then [DONE]); none hangs; /health and /metrics answer
    while the replica is down; the new replica takes requests; after recovery, no error at all."""
    import httpx

    first = serving_replicas(server)
    placed = processes(cluster, "ServeReplica:sala:SalaServer")
    assert len(first) == 2 and len(placed) == 2, (first, placed)
    node, pids = next((n, p) for n, p in placed.items() if n is not cluster.head_node)
    down = {}

    def inflict():
        if fault == "replica killed":
            os.kill(pids[0], signal.SIGKILL)
        else:
            cluster.remove_node(node)
            add_node(cluster)
        time.sleep(1)
        down["health"] = httpx.get(server + "/health", timeout=30).status_code
        down["replicas"] = serving_replicas(server)

    def recovered() -> bool:
        """Two replicas answer /metrics, one of them new."""
        answering = serving_replicas(server)
        return len(answering) == 2 and bool(answering - first)

    seen, state = load_through(server, inflict, recovered)
    verdicts = [s["verdict"] for s in seen]
    print({v: verdicts.count(v) for v in set(verdicts)}, f"recovered in {state['recovered_at'] - state['fault_at']:.1f} s")
    bad = [(s["i"], s["status"], s["error"], s["events"][-2:]) for s in seen if s["verdict"] not in ("ok", "error-event")]
    assert not bad, bad
    after = [s for s in seen if s["sent"] > state["recovered_at"]]
    assert after and all(s["verdict"] == "ok" for s in after)
    # While it is down, the app says it can serve, and its metrics are the live replica's alone.
    assert down["health"] == 200 and len(down["replicas"]) == 1 and down["replicas"] < first
    # The router takes the new replica back: prompts it has seen nowhere go to the replica holding least.
    fresh = [httpx.post(server + "/v1/completions", json={"model": "tiny-sala", "prompt": f"Fresh prompt {i}: the class",
                                                          "max_tokens": 4}, timeout=60) for i in range(4)]
    assert all(r.status_code == 200 for r in fresh)
    assert {r.headers["x-sala-replica"] for r in fresh} - first, "the restarted replica took no request after recovery"
