"""Faults on a Ray cluster of three nodes simulated on this machine (`ray.cluster_utils.Cluster`:
a head and two workers, each its own raylet and object store, one CPU each), with the project's
real command lines pointed at it through RAY_ADDRESS. Each fault is checked against the same run
without it: a lost node or a killed process may cost time, never a byte, a row or a request."""
import contextlib
import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, SMALL, free_port

pytestmark = pytest.mark.slow
QUANTIZE = [*SMALL, "--gate-prompts", "8", "--no-register"]


@pytest.fixture(scope="module")
def cluster():
    """Head and two worker nodes on this machine, one CPU each; stopped here, by its own handles."""
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "object_store_memory": 150 << 20}
    c = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    for _ in range(2):
        c.add_node(**node)
    c.wait_for_nodes()
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def cluster_env(pipeline_env, cluster):
    return {**pipeline_env, "RAY_ADDRESS": cluster.address, "OMP_NUM_THREADS": "1"}


def start(env, script: str, *args):
    """A pipeline's real command line in the background; its stdout and stderr lines collect in
    the returned lists as they come."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "pipelines" / script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    out, err = [], []
    for stream, sink in ((proc.stdout, out), (proc.stderr, err)):
        threading.Thread(target=lambda s=stream, k=sink: k.extend(iter(s.readline, "")), daemon=True).start()
    return proc, out, err


def finish(proc, out, err, timeout=600) -> str:
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(0.2)  # the reader threads take the last lines
    assert code == 0, "".join(out)[-2000:] + "".join(err)[-4000:]
    return "".join(out)


def wait_until(condition, proc, err, timeout=300):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, "ended early:\n" + "".join(err)[-3000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def actors_started_on(node, cls: str) -> list:
    """Processes of `node` running an actor of class `cls` past its constructor (Ray titles a
    worker process `ray::Class`, or `ray::Class.method()` while it runs one)."""
    import psutil

    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    titles = []
    for p in raylet.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            titles.append(" ".join(p.cmdline()))
    return [t for t in titles if t.startswith(f"ray::{cls}") and "__init__" not in t]


def weights_sha(ckpt: Path) -> str:
    return hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()


# ------------------------------------------------------------------------------- quantization
@pytest.fixture(scope="module")
def undisturbed_checkpoint(cluster_env, tiny_sala_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("quantize") / "undisturbed"
    log = finish(*start(cluster_env, "quantize.py", "--model", str(tiny_sala_dir), "--output", str(out), *QUANTIZE))
    assert "workers    3 Ray actors on 3 node(s)" in log, log
    return out


def test_quantization_survives_a_lost_node_and_uses_an_added_one(cluster, cluster_env, tiny_sala_dir, tmp_path,
                                                                  undisturbed_checkpoint):
    """A worker node removed once layer 1 is saved, and another added: the job finishes with the
    same bytes as the undisturbed run, and the lost worker's replacement starts on the new node
    and takes work."""
    out = tmp_path / "lost-node"
    layers = out.with_name(f".{out.name}.layers")
    proc, lines, err = start(cluster_env, "quantize.py", "--model", str(tiny_sala_dir), "--output", str(out), *QUANTIZE)
    wait_until(lambda: (layers / "layer_001.json").exists(), proc, err)
    assert not (layers / "layer_007.json").exists()
    victim = cluster.list_all_nodes()[-1]
    cluster.remove_node(victim)
    wait_until(lambda: "lost" in "".join(err), proc, err, timeout=120)
    # The driver paused while the new node comes up, so that the replacement's start cannot lose
    # the race with the end of a 10-second job: it joins, and then must be given work.
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        added = cluster.add_node(num_cpus=1, object_store_memory=150 << 20)
        deadline = time.monotonic() + 120
        while not actors_started_on(added, "LayerWorker"):
            assert time.monotonic() < deadline, "no replacement worker started on the added node"
            time.sleep(0.1)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    log = finish(proc, lines, err)
    errors = "".join(err)
    assert re.search(r"worker pid \d+ lost", errors) and "a replacement worker" in errors, errors[-3000:]
    by_node = dict(re.findall(r"node (\w+): (\d+) calls", log))
    assert int(by_node.get(added.node_id, 0)) > 0, (added.node_id, by_node)
    assert weights_sha(out) == weights_sha(undisturbed_checkpoint)


# --------------------------------------------------------------------------- batch generation
GENERATE_ROWS = 160


@pytest.fixture(scope="module")
def prompts_file(tiny_sala_dir, tmp_path_factory):
    """Prompts with an id each, one of them a line that is not JSON (an error row in every run)."""
    import json

    from sala.tiny import heldout_texts

    texts = [t for t in heldout_texts(tiny_sala_dir) if len(t) > 80]
    lines = [json.dumps({"id": i, "prompt": texts[i % len(texts)][: 20 + (i * 7) % 60]}) for i in range(GENERATE_ROWS)]
    lines[101] = '{"id": 101, "prompt": "unterminated'
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def generate_args(prompts_file, out: Path) -> list[str]:
    return ["--dataset", str(prompts_file), "--output", str(out), "--replicas", "2", "--num-cpus", "1",
            "--batch-size", "16", "--max-tokens", "8"]


def read_rows(out: Path):
    import pandas as pd

    df = pd.read_parquet(out)
    return df.drop(columns=["time_taken_llm"])


@pytest.fixture(scope="module")
def undisturbed_rows(cluster_env, prompts_file, tiny_sala_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("generate") / "undisturbed"
    finish(*start(cluster_env, "generate.py", *generate_args(prompts_file, out), "--model", str(tiny_sala_dir)))
    rows = read_rows(out)
    assert len(rows) == GENERATE_ROWS and rows["generated_text"].notna().sum() == GENERATE_ROWS - 1
    return rows


def engine_actors(cluster) -> dict:
    """Engine actor processes by the node they run on: {node: [pid, ...]}."""
    import psutil

    found = {}
    for node in cluster.list_all_nodes():
        raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
        for p in raylet.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "GenerateStage" in " ".join(p.cmdline()):
                    found.setdefault(node, []).append(p.pid)
    return found


def parts_written(out: Path) -> int:
    return len(list(out.with_name(f".{out.name}.partial").glob("part-*.parquet")))


def assert_same_rows(out: Path, expected):
    """Every input row once, none added, each as the undisturbed run wrote it (errors included)."""
    import pandas as pd

    rows = read_rows(out)
    assert sorted(rows["id"].dropna().astype(int)) == sorted(set(range(GENERATE_ROWS)) - {101})
    assert len(rows) == GENERATE_ROWS
    pd.testing.assert_frame_equal(rows.reset_index(drop=True), expected.reset_index(drop=True))


@pytest.mark.parametrize("fault", ["actor killed", "node removed"])
def test_generation_writes_every_row_once_through_a_fault(cluster, cluster_env, prompts_file, tiny_sala_dir, tmp_path,
                                                          undisturbed_rows, fault):
    """One engine actor's process SIGKILLed, or the node under it removed, once rows are being
    written: the job ends well and its output equals the undisturbed run's, row for row."""
    out = tmp_path / "out"
    proc, lines, err = start(cluster_env, "generate.py", *generate_args(prompts_file, out), "--model", str(tiny_sala_dir))
    wait_until(lambda: parts_written(out) >= 2 and len(engine_actors(cluster)) == 2, proc, err)
    # One CPU a node: the two actors are on two nodes, at most one of them the head, which stays.
    node, pids = next((n, p) for n, p in engine_actors(cluster).items() if n is not cluster.head_node)
    if fault == "actor killed":
        os.kill(pids[0], signal.SIGKILL)
    else:
        cluster.remove_node(node)
    assert parts_written(out) < GENERATE_ROWS // 16
    finish(proc, lines, err)
    if fault == "node removed":
        cluster.add_node(num_cpus=1, object_store_memory=150 << 20)
    assert_same_rows(out, undisturbed_rows)


def test_a_killed_driver_resumes_where_it_stopped(cluster_env, prompts_file, tiny_sala_dir, tmp_path, undisturbed_rows):
    """The driver SIGKILLed with part of the output written; the same command again skips those
    rows (and says so), generates the rest, and the output equals the undisturbed run's."""
    out = tmp_path / "out"
    args = [*generate_args(prompts_file, out), "--model", str(tiny_sala_dir)]
    proc, lines, err = start(cluster_env, "generate.py", *args)
    wait_until(lambda: parts_written(out) >= 3, proc, err)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    kept = parts_written(out)
    assert 3 <= kept < GENERATE_ROWS // 16 and not out.exists()
    log = finish(*start(cluster_env, "generate.py", *args))
    assert f"resuming: {kept * 16} rows already written ({kept} parts) are skipped" in log, log
    assert_same_rows(out, undisturbed_rows)


# ------------------------------------------------------------------------------------ serving
@pytest.fixture(scope="module")
def server(cluster_env, tiny_sala_dir):
    """`python -m serve.app` with two replicas on the cluster (prefix routing on, as by default),
    its HTTP proxy on the head (the nodes share this machine's ports); stopped by SIGTERM, which
    deletes the app."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "serve.app", "--model", str(tiny_sala_dir), "--num-replicas", "2",
                             "--num-cpus", "1", "--num-threads", "1", "--port", str(port), "--proxy-location", "HeadOnly"],
                            cwd=ROOT, env=cluster_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log = []
    try:
        for line in proc.stdout:
            log.append(line)
            if line.startswith("serving on "):
                break
        assert proc.poll() is None, "".join(log[-40:])
        threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def replicas(cluster) -> dict:
    """SalaServer replica processes by node: {node: [pid, ...]}."""
    import psutil

    found = {}
    for node in cluster.list_all_nodes():
        raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
        for p in raylet.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "ServeReplica:sala:SalaServer" in " ".join(p.cmdline()):
                    found.setdefault(node, []).append(p.pid)
    return found


async def one_request(client, url: str, i: int, timeout: float) -> dict:
    """Request i of a mixed load: chat or completions, streamed or not; what the client saw."""
    import json

    stream, chat = i % 2 == 0, i % 3 == 0
    prompt = f"{'The for statement' if i % 4 else 'The with statement'} number {i % 7}"
    body = {"model": "tiny-sala", "max_tokens": 24, "temperature": 0, "stream": stream}
    body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    seen = {"i": i, "stream": stream, "status": None, "events": [], "error": None, "replica": None}
    try:
        async with client.stream("POST", url + path, json=body, timeout=timeout) as r:
            seen["status"], seen["replica"] = r.status_code, r.headers.get("x-sala-replica")
            if not stream:
                seen["body"] = json.loads(await r.aread())
                return seen
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen["events"].append(line[6:])
    except Exception as e:  # a cut stream, a timeout: what the test must never see
        seen["error"] = repr(e)
    return seen


def verdict(seen: dict) -> str:
    """ok | error-event (a stream ended by an in-band error, then [DONE]) | failed | cut."""
    import json

    if seen["error"]:
        return "cut" if seen["stream"] else "failed"
    if seen["status"] != 200:
        return "failed"
    if not seen["stream"]:
        return "ok"
    events = seen["events"]
    if not events or events[-1] != "[DONE]":
        return "cut"
    return "error-event" if any("error" in json.loads(e) for e in events[:-1]) else "ok"


def load_through(url: str, fault, recovered, seconds_after: float = 5.0, workers: int = 6, timeout: float = 60.0):
    """Requests from `workers` clients, one at a time each (in a thread of their own), while
    `fault()` runs here once after the first answers and `recovered()` is polled; `seconds_after`
    more once it is true. Returns each request's record (`sent`: time.monotonic), and when the
    fault and the recovery were."""
    import asyncio

    import httpx

    state = {"fault_at": None, "recovered_at": None}
    stop = threading.Event()
    out = []

    async def client_loop(w: int):
        async with httpx.AsyncClient() as client:
            i = w
            while not stop.is_set():
                t = time.monotonic()
                seen = await one_request(client, url, i, timeout)
                seen["sent"], seen["took"] = t, time.monotonic() - t
                out.append(seen)
                i += workers

    async def clients():
        await asyncio.gather(*(client_loop(w) for w in range(workers)))

    load = threading.Thread(target=asyncio.run, args=(clients(),), daemon=True)
    load.start()
    try:
        while len(out) < 2 * workers:
            assert load.is_alive()
            time.sleep(0.05)
        state["fault_at"] = time.monotonic()
        fault()  # here: starting and stopping nodes installs signal handlers, which only the main thread may
        deadline = time.monotonic() + 240
        while not recovered():
            assert time.monotonic() < deadline, "no recovery in 240 s"
            time.sleep(0.5)
        state["recovered_at"] = time.monotonic()
        time.sleep(seconds_after)
    finally:
        stop.set()
        load.join(timeout + 10)
    return out, state


def serving_replicas(url: str) -> set[str]:
    """The replicas whose series the app's /metrics holds: those that answered it."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.labels["replica"] for f in text_string_to_metric_families(text) for s in f.samples
            if "replica" in s.labels and not s.name.startswith("sala_router")}


@pytest.mark.parametrize("fault", ["replica killed", "node removed"])
def test_serving_loses_no_request_when_a_replica_dies(cluster, server, fault):
    """Two replicas on two nodes under a mixed load; one replica's process SIGKILLed, or its node
    removed (a node added back). No non-streaming request fails; no stream is cut (one that had
    sent tokens ends with an error event, then [DONE]); none hangs; /health and /metrics answer
    while the replica is down; the new replica takes requests; after recovery, no error at all."""
    import httpx

    before = {n: p for n, p in replicas(cluster).items()}
    assert sum(len(p) for p in before.values()) == 2 and len(before) == 2, before
    node, pids = next((n, p) for n, p in before.items() if n is not cluster.head_node)
    first = serving_replicas(server)
    assert len(first) == 2, first
    down = {}

    def fault():
        if fault_kind == "replica killed":
            os.kill(pids[0], signal.SIGKILL)
        else:
            cluster.remove_node(node)
            cluster.add_node(num_cpus=1, object_store_memory=150 << 20)
        time.sleep(1)
        down["health"] = httpx.get(server + "/health", timeout=30).status_code
        down["replicas"] = serving_replicas(server)

    fault_kind = fault

    def recovered() -> bool:
        """Two replicas answer /metrics, one of them new."""
        answering = serving_replicas(server)
        return len(answering) == 2 and bool(answering - first)

    seen, state = load_through(server, fault, recovered)
    verdicts = [verdict(s) for s in seen]
    print({v: verdicts.count(v) for v in set(verdicts)}, f"recovered in {state['recovered_at'] - state['fault_at']:.1f} s")
    assert "failed" not in verdicts and "cut" not in verdicts, [(s["i"], s["status"], s["error"], s["events"][-2:]) for s, v in zip(seen, verdicts) if v in ("failed", "cut")]
    assert all(s["took"] < 60 for s in seen)
    after = [s for s in seen if s["sent"] > state["recovered_at"]]
    assert after and all(verdict(s) == "ok" for s in after)
    # While it is down, the app says it can serve, and its metrics are the live replica's alone.
    assert down["health"] == 200 and len(down["replicas"]) == 1 and down["replicas"] < first
    new = {s["replica"] for s in after} - {s["replica"] for s in seen if s["sent"] < state["fault_at"]}
    assert new, "the restarted replica took no request after recovery"
