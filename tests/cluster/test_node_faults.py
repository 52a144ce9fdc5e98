"""Faults on a Ray cluster of three nodes simulated on this machine (tests/cluster/faults.py: a
head and two workers, each its own raylet and object store, one CPU each), with the project's
real command lines pointed at it through RAY_ADDRESS. Each fault is checked against the same run
without it: a lost node or a killed process may cost time, never a row or a request. (The quantize
job's lost node is tests/cluster/test_lost_node_quantize.py's.)"""
import json
import os
import signal
from pathlib import Path

import pytest

from tests.cluster.faults import (
    Job,
    add_node,
    parts_written,
    processes,
    replica_dies,
    serve_logs_on_failure,
    serving_replicas,
    two_replicas,
)

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- batch generation
ROWS, BATCH, TOKENS = 160, 16, 8
BAD_ROW = 101  # a line that is not JSON: an error row in every run


@pytest.fixture(scope="module")
def prompts(tiny_sala_dir):
    from sala.tiny import heldout_texts

    texts = [t for t in heldout_texts(tiny_sala_dir) if len(t) > 80]
    return [texts[i % len(texts)][: 20 + (i * 7) % 60] for i in range(ROWS)]


@pytest.fixture(scope="module")
def prompts_file(prompts, tmp_path_factory):
    lines = [json.dumps({"id": i, "prompt": p}) for i, p in enumerate(prompts)]
    lines[BAD_ROW] = '{"id": 101, "prompt": "unterminated'
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def expected_rows(tiny_sala_dir, prompts):
    """The undisturbed generation: every good row through an engine in this process, in the
    evaluation mode (a row's tokens do not depend on what else is in its batch), as the jobs run."""
    import torch

    from sala.engine import Engine, SamplingParams

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine.from_pretrained(tiny_sala_dir, batch_invariant=True)
    done = engine.generate([p for i, p in enumerate(prompts) if i != BAD_ROW], SamplingParams(max_tokens=TOKENS, temperature=0))
    torch.set_num_threads(n)
    return {i: c for i, c in zip([i for i in range(ROWS) if i != BAD_ROW], done)}


def generate(env, prompts_file, tiny_sala_dir, out: Path) -> Job:
    return Job.pipeline(env, "generate.py", "--dataset", str(prompts_file), "--output", str(out), "--model",
                        str(tiny_sala_dir), "--replicas", "2", "--num-cpus", "1", "--batch-size", str(BATCH),
                        "--max-tokens", str(TOKENS), "--batch-invariant")


def assert_every_row_once(out: Path, expected: dict):
    """Every input row once, none added, each as the undisturbed generation has it; the bad line
    an error row, and no other."""
    import pandas as pd

    rows = pd.read_parquet(out)
    assert len(rows) == ROWS
    good = rows[rows["__inference_error__"].isna()]
    assert sorted(good["id"].astype(int)) == sorted(expected) and rows["__inference_error__"].notna().sum() == 1
    for _, r in good.iterrows():
        c = expected[int(r["id"])]
        assert (r["generated_text"], r["finish_reason"], r["num_generated_tokens"]) == \
            (c.text, c.finish_reason, len(c.token_ids)), int(r["id"])


@pytest.mark.parametrize("fault", ["actor killed", "node removed"])
def test_generation_writes_every_row_once_through_a_fault(cluster, cluster_env, prompts_file, tiny_sala_dir, tmp_path,
                                                          expected_rows, fault):
    """One engine actor's process SIGKILLed, or the node under it removed, once rows are being
    written: the job ends well and its output holds every row once, as the undisturbed
    generation has it."""
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
    assert_every_row_once(out, expected_rows)


def test_a_killed_driver_resumes_where_it_stopped(cluster_env, prompts_file, tiny_sala_dir, tmp_path, expected_rows):
    """The driver SIGKILLed with part of the output written; the same command again skips those
    rows (and says so), generates the rest, and the output holds every row once."""
    out = tmp_path / "out"
    job = generate(cluster_env, prompts_file, tiny_sala_dir, out)
    job.wait_until(lambda: parts_written(out) >= 3)
    job.kill()
    kept = parts_written(out)
    assert 3 <= kept < ROWS // BATCH and not out.exists()
    log = generate(cluster_env, prompts_file, tiny_sala_dir, out).finish()
    assert f"resuming: {kept * BATCH} rows already written ({kept} parts) are skipped" in log, log
    assert_every_row_once(out, expected_rows)


# ------------------------------------------------------------------------------------ serving
@pytest.fixture(scope="module")
def server(cluster_env, tiny_sala_dir):
    with two_replicas(cluster_env, tiny_sala_dir, "--no-compile") as url:  # eager: a replica starts sooner
        yield url


@pytest.mark.parametrize("fault", ["replica killed", "node removed"])
def test_serving_loses_no_request_when_a_replica_dies(cluster, server, fault):
    """Two replicas on two nodes under a mixed load; one replica's process SIGKILLed, or its node
    removed (a node added back). No non-streaming request fails; no stream is cut (one that had
    sent tokens ends with an error event, then [DONE]); none hangs; /health and /metrics answer
    while the replica is down; the new replica takes requests; after recovery, no error at all."""
    import httpx

    with serve_logs_on_failure(cluster):
        assert len(serving_replicas(server)) == 2 and len(processes(cluster, "ServeReplica:sala:SalaServer")) == 2
        run = replica_dies(cluster, server, fault)
        seen, first = run["seen"], run["first"]
        verdicts = [s["verdict"] for s in seen]
        print({v: verdicts.count(v) for v in set(verdicts)}, f"recovered in {run['recovered_at'] - run['fault_at']:.1f} s")
        bad = [(s["i"], s["verdict"], s["replica"], s["status"], s["error"], s["events"][-2:]) for s in seen
               if s["verdict"] not in ("ok", "error-event")]
        assert not bad, bad
        after = [s for s in seen if s["sent"] > run["recovered_at"]]
        assert after and all(s["verdict"] == "ok" for s in after), [(s["i"], s["verdict"], s["replica"]) for s in after]
        # While it is down, the app says it can serve, and its metrics are the live replica's alone.
        down = run["down"]
        assert down["health"] == 200 and len(down["replicas"]) == 1 and down["replicas"] < first
        # The router takes the new replica back: prompts it has seen nowhere go to the replica holding least.
        # (Longer than a routing block, each its own: the load's prompts are shorter, so both replicas
        # hold no block, and a tie goes to the replica beside the ingress.)
        fresh = [httpx.post(server + "/v1/completions", json={"model": "tiny-sala", "prompt": f"{i} " + "the class " * 40,
                                                              "max_tokens": 4}, timeout=60) for i in range(4)]
        assert all(r.status_code == 200 for r in fresh)
        assert {r.headers["x-sala-replica"] for r in fresh} - first, "the restarted replica took no request after recovery"
