"""Chaos: the three jobs on a local three-node Ray cluster (`ray.cluster_utils.Cluster`, one CPU
a node), each run undisturbed and then through faults, the faulty runs compared with the
undisturbed ones measured in the same run.

- quantization: a worker node removed once layer 1 is saved, a node added: same checkpoint bytes?
- batch generation (--rows prompts, two engine replicas): an engine actor SIGKILLed; a worker node
  removed; the driver SIGKILLed and the same command run again. Rows lost, duplicated, differing
  from the undisturbed run (text, finish reason, token counts, error), and rows skipped on resume.
- serving (two replicas, prefix routing, a mixed streaming and non-streaming load from six
  clients): a replica's process SIGKILLed; its node removed. Requests failed, streams cut,
  ended by an error event or malformed (an event that is not JSON), hung (past the clients' 60 s
  timeout), errors after recovery, and seconds from the fault until two replicas serve again.

Prints a table per scenario and one JSON line.

    python bench/chaos.py [--rows 600] [--only quantize,generate,serve]
"""
import argparse
import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sala.tiny import ensure_tiny_sala, heldout_texts  # noqa: E402
from tests.cluster.faults import Job, add_node, parts_written, processes, replica_dies, three_nodes, two_replicas  # noqa: E402

QUANTIZE = ["--num-samples", "24", "--seq-len", "128", "--shards", "4", "--eval-sequences", "6", "--gate-prompts", "8",
            "--no-register"]
BATCH = 16


def sha(ckpt: Path) -> str:
    return hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()


def quantize(cluster, env, model, tmp: Path) -> list[dict]:
    t = time.monotonic()
    Job.pipeline(env, "quantize.py", "--model", str(model), "--output", str(tmp / "q0"), *QUANTIZE).finish()
    base_s = time.monotonic() - t
    out = tmp / "q1"
    t = time.monotonic()
    job = Job.pipeline(env, "quantize.py", "--model", str(model), "--output", str(out), *QUANTIZE)
    job.wait_until(lambda: (out.with_name(f".{out.name}.layers") / "layer_001.json").exists())
    cluster.remove_node(cluster.list_all_nodes()[-1])
    add_node(cluster)
    job.finish()
    return [{"scenario": "quantize: undisturbed", "seconds": round(base_s, 1)},
            {"scenario": "quantize: node removed, node added", "seconds": round(time.monotonic() - t, 1),
             "identical_checkpoint": sha(out) == sha(tmp / "q0"),
             "workers_lost": "".join(job.err).count(" lost (")}]


def generate(cluster, env, model, tmp: Path, rows: int) -> list[dict]:
    import pandas as pd

    texts = [t for t in heldout_texts(model) if len(t) > 80]
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": i, "prompt": texts[i % len(texts)][: 20 + (i * 7) % 60]}) + "\n"
                            for i in range(rows)))

    def job(out: Path) -> Job:
        return Job.pipeline(env, "generate.py", "--dataset", str(data), "--output", str(out), "--model", str(model),
                            "--replicas", "2", "--num-cpus", "1", "--batch-size", str(BATCH), "--max-tokens", "16")

    def read(out: Path):
        return pd.read_parquet(out).drop(columns=["time_taken_llm"]).set_index("id", drop=False)

    t = time.monotonic()
    job(tmp / "g0").finish()
    base = read(tmp / "g0")
    results = [{"scenario": "generate: undisturbed", "rows": rows, "seconds": round(time.monotonic() - t, 1)}]

    def compare(name: str, out: Path, seconds: float, **extra) -> dict:
        got = read(out)
        ids = got["id"].tolist()
        once = got[~got.index.duplicated()]
        differing = sum(not once.loc[i].equals(base.loc[i]) for i in base.index if i in once.index)
        return {"scenario": name, "rows": rows, "lost": len(set(range(rows)) - set(ids)),
                "duplicated": len(ids) - len(set(ids)), "mismatched": differing,
                "new_errors": int(got["__inference_error__"].notna().sum() - base["__inference_error__"].notna().sum()),
                "seconds": round(seconds, 1), **extra}

    for fault in ("engine actor killed", "node removed"):
        out = tmp / fault.replace(" ", "-")
        t = time.monotonic()
        j = job(out)
        j.wait_until(lambda: parts_written(out) >= 3 and len(processes(cluster, "GenerateStage")) == 2)
        node, pids = next((n, p) for n, p in processes(cluster, "GenerateStage").items() if n is not cluster.head_node)
        if fault == "node removed":
            cluster.remove_node(node)
        else:
            os.kill(pids[0], signal.SIGKILL)
        j.finish()
        if fault == "node removed":
            add_node(cluster)
        results.append(compare(f"generate: {fault}", out, time.monotonic() - t))
    out = tmp / "driver-killed"
    t = time.monotonic()
    j = job(out)
    j.wait_until(lambda: parts_written(out) >= rows // BATCH // 3)
    j.kill()
    log = job(out).finish()
    skipped = int(log.split("resuming: ", 1)[1].split(" ", 1)[0]) if "resuming: " in log else 0
    results.append(compare("generate: driver killed, run again", out, time.monotonic() - t, rows_skipped=skipped))
    return results


def serve_faults(cluster, env, model) -> list[dict]:
    results = []
    with two_replicas(env, model) as url:
        for fault in ("replica killed", "node removed"):
            run = replica_dies(cluster, url, fault)
            seen = run["seen"]
            count = {v: sum(s["verdict"] == v for s in seen) for v in ("ok", "error-event", "malformed", "failed", "cut", "hung")}
            after = [s for s in seen if s["sent"] > run["recovered_at"]]
            results.append({"scenario": f"serve: {fault}", "requests": len(seen), "streams": sum(s["stream"] for s in seen),
                            **count, "errors_after_recovery": sum(s["verdict"] != "ok" for s in after),
                            "health_while_down": run["down"]["health"],
                            "recover_s": round(run["recovered_at"] - run["fault_at"], 1)})
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=600, help="prompts in the batch generation scenarios")
    ap.add_argument("--only", default="quantize,generate,serve", help="scenarios to run, comma-separated")
    args = ap.parse_args()
    model = ensure_tiny_sala()
    results = []
    with tempfile.TemporaryDirectory() as tmp, three_nodes() as cluster:
        tmp = Path(tmp)
        env = {**os.environ, "RAY_ADDRESS": cluster.address, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}", "RAY_USAGE_STATS_ENABLED": "0"}
        only = args.only.split(",")
        if "quantize" in only:
            results += quantize(cluster, env, model, tmp)
        if "generate" in only:
            results += generate(cluster, env, model, tmp, args.rows)
        if "serve" in only:
            results += serve_faults(cluster, env, model)
    for r in results:
        print(f"{r['scenario']:<38} " + "  ".join(f"{k} {v}" for k, v in r.items() if k != "scenario"))
    print(json.dumps({"bench": "chaos", "scenarios": results}))


if __name__ == "__main__":
    main()
