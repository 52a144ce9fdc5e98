"""Faults on a Ray cluster of several nodes simulated on this machine, shared by the fault tests
(tests/cluster/test_node_faults.py, test_lost_node_quantize.py) and the chaos benchmark
(bench/chaos.py): the cluster (`ray.cluster_utils.Cluster`, Ray's own way of testing several nodes
on one machine: a head and workers, each its own raylet and object store), the project's command
lines run against it through RAY_ADDRESS, the processes of each node, and a mixed HTTP load with
its verdicts."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NODE = {"num_cpus": 1, "object_store_memory": 150 << 20}  # each node: one CPU, its own object store


@contextlib.contextmanager
def three_nodes():
    """A head and two worker nodes, one CPU each; stopped by its own handles (never `ray stop`)."""
    from ray.cluster_utils import Cluster

    from serve.app import local_ray_env

    local_ray_env()  # its nodes inherit this environment: the served app's proxies start on a loaded machine
    c = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    try:
        for _ in range(2):
            c.add_node(**NODE)
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_node(cluster):
    return cluster.add_node(**NODE)


def processes(cluster, marker: str, constructed: bool = False) -> dict:
    """Processes of each node whose command line (a Ray worker's is its title: `ray::Class`,
    `ray::Class.method()` while it runs one) holds `marker`: {node: [pid, ...]}. constructed:
    only those past their actor's constructor."""
    import psutil

    found = {}
    for node in cluster.list_all_nodes():
        raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
        for p in raylet.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                title = " ".join(p.cmdline())
                if marker in title and not (constructed and "__init__" in title):
                    found.setdefault(node, []).append(p.pid)
    return found


class Job:
    """A command line in its own process group, its stdout and stderr lines collected as they come."""

    def __init__(self, env: dict, *argv: str):
        self.proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, start_new_session=True)
        self.out, self.err = [], []
        self.readers = [threading.Thread(target=lambda s=s, k=k: k.extend(iter(s.readline, "")), daemon=True)
                        for s, k in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for r in self.readers:
            r.start()

    @classmethod
    def pipeline(cls, env: dict, script: str, *args: str) -> "Job":
        return cls(env, str(ROOT / "pipelines" / script), *args)

    def wait_until(self, condition, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                raise AssertionError("ended early:\n" + "".join(self.err)[-3000:])
            if time.monotonic() > deadline:
                raise AssertionError("timed out:\n" + "".join(self.err)[-3000:])
            time.sleep(0.05)

    def finish(self, timeout: float = 600) -> str:
        """Its stdout, once it has exited 0."""
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self.kill()
        for r in self.readers:
            r.join(5)
        if code != 0:
            raise AssertionError(f"exit {code}:\n" + "".join(self.out)[-2000:] + "".join(self.err)[-4000:])
        return "".join(self.out)

    def kill(self) -> None:
        """SIGKILL to its process group, as a lost machine stops it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def parts_written(out: Path) -> int:
    """Parts of a batch generation's output written so far (pipelines/generate.py)."""
    return len(list(out.with_name(f".{out.name}.partial").glob("part-*.parquet")))


# ---------------------------------------------------------------------------- serving under load
async def one_request(client, url: str, i: int, timeout: float) -> dict:
    """Request i of a mixed load: chat or completions, streamed or not; what the client saw. One
    not over in `timeout` seconds is cut there, as a hang (httpx's timeout bounds each read, so a
    stream whose events trickle would otherwise never end)."""
    stream, chat = i % 2 == 0, i % 3 == 0
    prompt = f"{'The for statement' if i % 4 else 'The with statement'} number {i % 7}"
    body = {"model": "tiny-sala", "max_tokens": 24, "temperature": 0, "stream": stream}
    body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    seen = {"i": i, "stream": stream, "status": None, "events": [], "error": None, "replica": None}

    async def exchange() -> None:
        async with client.stream("POST", url + path, json=body, timeout=timeout) as r:
            seen["status"], seen["replica"] = r.status_code, r.headers.get("x-sala-replica")
            if not stream:
                seen["body"] = json.loads(await r.aread())
                return
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen["events"].append(line[6:])

    try:
        await asyncio.wait_for(exchange(), timeout)
    except Exception as e:  # a cut stream, a refused connection, a timeout
        seen["error"] = repr(e)
    return seen


def verdict(seen: dict, timeout: float) -> str:
    """ok | error-event (a stream ended by an in-band error, then [DONE]) | malformed (a stream with
    an event that is not JSON: a second [DONE], a torn event) | failed | cut | hung."""
    if seen["took"] >= timeout:
        return "hung"
    if seen["error"]:
        return "cut" if seen["stream"] and seen["status"] == 200 else "failed"
    if seen["status"] != 200:
        return "failed"
    if not seen["stream"]:
        return "ok"
    events = seen["events"]
    if not events or events[-1] != "[DONE]":
        return "cut"
    try:
        payloads = [json.loads(e) for e in events[:-1]]
    except ValueError:
        return "malformed"
    return "error-event" if any("error" in p for p in payloads) else "ok"


def serving_replicas(url: str) -> set[str]:
    """The replicas whose series the app's /metrics holds: those that answered it."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.labels["replica"] for f in text_string_to_metric_families(text) for s in f.samples
            if "replica" in s.labels and not s.name.startswith("sala_router")}


def load_through(url: str, fault, recovered, workers: int = 6, timeout: float = 60.0):
    """Requests from `workers` clients, one at a time each (in a thread of their own), while
    `fault()` runs here once after the first answers and `recovered()` is polled; once it is true,
    until each client has had one more answer. Returns each request's record (`sent`:
    time.monotonic, `took`, `verdict`), and when the fault and the recovery were."""
    import httpx

    state = {"fault_at": None, "recovered_at": None}
    stop = threading.Event()
    out = []
    awaiting = {}  # client -> (its request in flight, when it was sent)
    ended = []  # what ended the clients' thread, if anything did

    async def client_loop(w: int):
        async with httpx.AsyncClient() as client:
            i = w
            while not stop.is_set():
                t = time.monotonic()
                awaiting[w] = (i, t)
                seen = await one_request(client, url, i, timeout)
                seen["sent"], seen["took"] = t, time.monotonic() - t
                seen["verdict"] = verdict(seen, timeout)
                out.append(seen)
                i += workers

    async def clients():
        await asyncio.gather(*(client_loop(w) for w in range(workers)))

    def run_clients():
        try:
            asyncio.run(clients())
        except BaseException as e:
            ended.append(repr(e))
            raise

    def check_load() -> None:
        if not load.is_alive():
            raise AssertionError(f"the load stopped: {ended}")

    load = threading.Thread(target=run_clients, daemon=True)
    load.start()
    try:
        while len(out) < 2 * workers:
            check_load()
            time.sleep(0.05)
        state["fault_at"] = time.monotonic()
        fault()  # here: starting and stopping nodes installs signal handlers, which only the main thread may
        deadline = time.monotonic() + 240
        while not recovered():
            if time.monotonic() > deadline:
                raise AssertionError("no recovery in 240 s")
            time.sleep(0.5)
        state["recovered_at"] = time.monotonic()
        # Each request ends within `timeout`: the one in flight at the recovery, then one sent after it.
        while len(answered := {s["i"] % workers for s in list(out) if s["sent"] > state["recovered_at"]}) < workers:
            check_load()
            if time.monotonic() > state["recovered_at"] + 2 * timeout + 10:
                now = time.monotonic()
                raise AssertionError("no answer after the recovery for clients (request, seconds in flight): "
                                     f"{ {w: (i, round(now - t, 1)) for w, (i, t) in awaiting.items() if w not in answered} }")
            time.sleep(0.1)
    finally:
        stop.set()
        load.join(timeout + 10)
    return out, state


@contextlib.contextmanager
def two_replicas(env: dict, model, *args: str) -> str:
    """`python -m serve.app` with two replicas (prefix routing on, as by default), its HTTP proxy on
    the head (the simulated nodes share this machine's ports), and `args`; yields its URL; stopped
    by SIGTERM, which deletes the app."""
    port = free_port()
    server = Job(env, "-m", "serve.app", "--model", str(model), "--num-replicas", "2", "--num-cpus", "1",
                 "--num-threads", "1", "--port", str(port), "--proxy-location", "HeadOnly", *args)
    try:
        server.wait_until(lambda: any(line.startswith("serving on ") for line in server.out), timeout=600)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.proc.send_signal(signal.SIGTERM)
        server.finish(timeout=60)


@contextlib.contextmanager
def serve_logs_on_failure(cluster, lines: int = 25):
    """An AssertionError raised inside says, after its own message, the last `lines` lines of each
    Serve log of the cluster's session (controller, proxy, ingress, replicas; the lines of requests
    answered well left out): the server's side of a failed serving test."""
    try:
        yield
    except AssertionError as e:
        answered = re.compile(r" -- (CALL \S+ OK|[A-Z]+ \S+ 2\d\d) ")
        tails = []
        for log in sorted((Path(cluster.head_node.get_logs_dir_path()) / "serve").glob("*.log")):
            kept = [line for line in log.read_text(errors="replace").splitlines() if not answered.search(line)]
            tails.append(f"--- {log.name}\n" + "\n".join(kept[-lines:]))
        raise AssertionError(f"{e}\n" + "\n".join(tails)) from e


def replica_dies(cluster, url: str, fault: str) -> dict:
    """Under load_through's mixed load, the replica off the head node dies: its process SIGKILLed
    ("replica killed") or its node removed and another added ("node removed"). Returns the load's
    records and times, the replicas serving before (`first`), and while it was down, what /health
    answered and which replicas /metrics held."""
    import httpx

    first = serving_replicas(url)
    node, pids = next((n, p) for n, p in processes(cluster, "ServeReplica:sala:SalaServer").items()
                      if n is not cluster.head_node)
    down = {}

    def inflict():
        if fault == "replica killed":
            os.kill(pids[0], signal.SIGKILL)
        else:
            cluster.remove_node(node)
            add_node(cluster)
        time.sleep(1)
        down["health"] = httpx.get(url + "/health", timeout=30).status_code
        down["replicas"] = serving_replicas(url)

    def recovered() -> bool:
        """Two replicas answer /metrics, one of them new."""
        answering = serving_replicas(url)
        return len(answering) == 2 and bool(answering - first)

    seen, state = load_through(url, inflict, recovered)
    return {"seen": seen, **state, "first": first, "down": down}
