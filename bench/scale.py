"""Every stage at the real model's width: peak memory (every process of the stage together) and
wall time, on random-weight MiniCPM-SALA checkpoints of 2, 4, 8 and 32 layers (sala/realwidth.py:
the 9B's widths and layer pattern; 32 layers is the whole 9B, 19 GB in BF16).

    python bench/scale.py [--layers 2 4 8 32] [--gptq-layers 2 4] [--stages quantize engine serve kv] [--eager] [--fresh]

Stages, each in a process (tree) of its own, measured by bench/memwatch.py:
- quantize: `python pipelines/quantize.py --method rtn` with its gate (export and logprob gate
  included), and at --gptq-layers GPTQ + FourOverSix on one worker; --num-samples 8 --seq-len 128,
  8 gate prompts, 2 held-out windows; beside its peak, the memory line it printed before loading;
- engine: Engine.from_pretrained on the RTN checkpoint, then 32 greedy tokens at batch 1
  (compiled decode, the default), its peak growth over the process after imports, against the
  bound 1.25 x the checkpoint's bytes + the engine's cache budget;
- serve: `python -m serve.app` on the RTN checkpoint, from its start to the answer of its first
  completion;
  --eager runs both without compiling the decode step (rows "engine eager", "serve eager").
- kv: one KV-sensitivity ablation (sala/kv/measure.py: the reference cache's logprobs and one
  plan measured, 2 windows of 128 tokens) on the BF16 checkpoint, in its dtype.

The ratios: a stage's peak at 4 layers over its peak at 2 (flat in depth: 1.0), GPTQ's seconds a
layer at 4 over 2, and the engine's peak growth over its bound. Results are kept in
$SALA_HOME/bench-scale.json, so a run resumes where it stopped (--fresh measures everything again).
Peaks are growth over the stage's start: the system measure is the machine's, so nothing else
should run meanwhile. The engine and serve stages run torch on one thread (OMP_NUM_THREADS=1):
their times are a decode's on one core, which other work on the machine does not stall (with
two threads, each of the CPU W4A16 path's parallel regions waits for a core the other work holds).
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.memwatch import GIB, PeakMemory, run_measured  # noqa: E402
from sala.home import sala_home  # noqa: E402

INTERVAL = 0.5  # seconds between memory samples: a tensor that lives shorter than this does not grow a stage's peak here
QUANTIZE = ["--num-samples", "8", "--seq-len", "128", "--gate-prompts", "8", "--eval-sequences", "2", "--no-register",
            "--overwrite"]

ONE_THREAD = {"OMP_NUM_THREADS": "1"}
ENGINE = """
import json, sys, time
from bench.memwatch import PeakMemory
from sala.engine import Engine, SamplingParams
with PeakMemory(interval=0.5) as peak:
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(sys.argv[1], compile=sys.argv[2] == "compiled")
    t1 = time.perf_counter()
    (out,) = engine.generate([[1, 1100, 1200, 1300, 1400, 1500, 1600, 1700]],
                             SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    t2 = time.perf_counter()
print(json.dumps({"load_seconds": t1 - t0, "decode_seconds": t2 - t1, "tokens": len(out.token_ids),
                  "compile_seconds": engine.compile_seconds, "budget_bytes": engine.config.memory.budget_bytes,
                  "growth_bytes": peak.peak_tree_bytes}))
"""

KV = """
import json, sys, time
import torch
from bench.memwatch import PeakMemory
from sala.checkpoint import load_model
from sala.kv import KVPlan
from sala.kv.measure import calibrate_amax, measure_plan, reference_baseline
windows = torch.randint(3, 259, (3, 129), generator=torch.Generator().manual_seed(0))
with PeakMemory(interval=0.5) as peak:
    t0 = time.perf_counter()
    model = load_model(sys.argv[1])
    config = model.config
    amax = calibrate_amax(model, windows[:1])
    reference = reference_baseline(model, windows[1:], 64)
    plan = KVPlan.uniform(config, "fp8", "fp32", amax).with_units({config.sparse_layers[0]: "nvfp4"})
    metrics = measure_plan(model, windows[1:], plan, reference, 64)
    t1 = time.perf_counter()
print(json.dumps({"seconds": t1 - t0, "kl_mean": metrics["kl_mean"], "dtype": str(next(model.parameters()).dtype),
                  "growth_bytes": peak.peak_tree_bytes}))
"""


def env_for(home: Path) -> dict:
    env = {**os.environ, "SALA_HOME": str(home), "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
           "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    return env


def last_json(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def quantize(model: Path, out: Path, method: str, env: dict) -> dict:
    workers = ["--workers", "1"] if method == "gptq" else []
    cmd = [sys.executable, str(ROOT / "pipelines" / "quantize.py"), "--model", str(model), "--output", str(out),
           "--method", method, *QUANTIZE, *workers]
    result, peak = run_measured(cmd, env=env, cwd=ROOT, interval=INTERVAL)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    summary = last_json(result.stdout)
    said = next(line for line in result.stdout.splitlines() if line.startswith("memory "))
    return {"said": " ".join(said.split()[1:]), "peak_system_gib": peak.gib(peak.peak_system_bytes), "peak_tree_gib": peak.gib(peak.peak_tree_bytes),
            "seconds": peak.seconds, "quantize_seconds": summary["quantize_seconds"], "gate_passed": summary["gate_passed"],
            "kl_mean": summary["kl_mean"]}


def child(code: str, arg: Path, env: dict, *more: str) -> dict:
    result, peak = run_measured([sys.executable, "-c", code, str(arg), *more], env=env, cwd=ROOT, interval=INTERVAL)
    if result.returncode != 0:
        raise RuntimeError(f"stage failed:\n{result.stderr[-3000:]}")
    return last_json(result.stdout) | {"peak_system_gib": peak.gib(peak.peak_system_bytes),
                                       "peak_tree_gib": peak.gib(peak.peak_tree_bytes), "seconds": peak.seconds}


def engine(ckpt: Path, env: dict, compiled: bool) -> dict:
    row = child(ENGINE, ckpt, env | ONE_THREAD, "compiled" if compiled else "eager")
    ckpt_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    bound = 1.25 * ckpt_bytes + row["budget_bytes"]
    return row | {"checkpoint_gib": ckpt_bytes / GIB, "budget_gib": row["budget_bytes"] / GIB,
                  "growth_gib": row["growth_bytes"] / GIB, "growth_over_bound": row["growth_bytes"] / bound}


def serve(ckpt: Path, env: dict, compiled: bool) -> dict:
    """python -m serve.app from its start to its first completion's answer."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "serve.app", "--model", str(ckpt), "--port", str(port),
                             *([] if compiled else ["--no-compile"])], env=env | ONE_THREAD, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, process_group=0)
    try:
        with PeakMemory(root=proc.pid, interval=INTERVAL) as peak:
            for line in proc.stdout:
                if line.startswith("serving on "):
                    break
            else:
                raise RuntimeError(f"serve.app exited ({proc.wait()})")
            body = json.dumps({"prompt": "The for statement", "max_tokens": 4, "temperature": 0}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=3600) as r:
                answer = json.loads(r.read())
            first = time.perf_counter() - t0
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return {"first_answer_seconds": first, "tokens": answer["usage"]["completion_tokens"],
            "peak_system_gib": peak.gib(peak.peak_system_bytes), "peak_tree_gib": peak.gib(peak.peak_tree_bytes)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 32])
    ap.add_argument("--gptq-layers", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--stages", nargs="+", default=["quantize", "engine", "serve", "kv"],
                    choices=["quantize", "engine", "serve", "kv"])
    ap.add_argument("--fresh", action="store_true", help="measure every row again")
    ap.add_argument("--eager", action="store_true", help="the engine and the server without compiling the decode step")
    args = ap.parse_args()
    from sala.realwidth import ensure_realwidth

    home = sala_home()
    results_path = home / "bench-scale.json"
    results = {} if args.fresh or not results_path.exists() else json.loads(results_path.read_text())
    env = env_for(home)

    def measure(key: str, fn):
        if key not in results:
            print(f"measuring {key} ...", flush=True)
            results[key] = fn()
            results_path.write_text(json.dumps(results, indent=1))
        print(f"  {key}: {json.dumps(results[key])}", flush=True)
        return results[key]

    mode = " eager" if args.eager else ""
    for n in args.layers:
        model = ensure_realwidth(n)
        rtn = home / "bench-scale" / f"rtn-{n}L"
        if "quantize" in args.stages:
            measure(f"quantize rtn {n}L", lambda: quantize(model, rtn, "rtn", env))
            if n in args.gptq_layers:
                measure(f"quantize gptq {n}L", lambda: quantize(model, home / "bench-scale" / f"gptq-{n}L", "gptq", env))
        if "engine" in args.stages and rtn.exists():
            measure(f"engine{mode} {n}L", lambda: engine(rtn, env, not args.eager))
        if "serve" in args.stages and rtn.exists():
            measure(f"serve{mode} {n}L", lambda: serve(rtn, env, not args.eager))
        if "kv" in args.stages:
            measure(f"kv {n}L", lambda: child(KV, model, env))

    print(f"\n{'layers':>6} {'stage':<15} {'peak GiB (system / tree)':>26} {'seconds':>9}  notes")
    for key, r in results.items():
        stage, n = key.rsplit(" ", 1)
        seconds = r.get("first_answer_seconds", r.get("seconds", 0))
        notes = ""
        if stage.startswith("quantize"):
            notes = f"quantize {r['quantize_seconds']:.0f} s, gate {'passed' if r['gate_passed'] else 'failed'}"
            notes += f"; said before loading: {r['said']}" if "said" in r else ""
        elif stage.startswith("engine"):
            notes = (f"load {r['load_seconds']:.1f} s, 32 tokens {r['decode_seconds']:.1f} s; growth {r['growth_gib']:.2f} GiB = "
                     f"{r['growth_over_bound']:.2f} x (1.25 x {r['checkpoint_gib']:.2f} + {r['budget_gib']:.2f})")
        elif stage == "kv":
            notes = f"{r['dtype']}, growth {r['growth_bytes'] / GIB:.2f} GiB"
        print(f"{n:>6} {stage:<15} {r['peak_system_gib']:>12.2f} / {r['peak_tree_gib']:<11.2f} {seconds:>9.1f}  {notes}")
    ratios = {}
    for stage in ("quantize rtn", "quantize gptq", "engine", "serve", "kv"):
        a, b = results.get(f"{stage} 2L"), results.get(f"{stage} 4L")
        if a and b:
            ratios[f"{stage} peak 4L/2L"] = round(b["peak_tree_gib"] / a["peak_tree_gib"], 3)
    a, b = results.get("quantize gptq 2L"), results.get("quantize gptq 4L")
    if a and b:
        ratios["gptq seconds a layer 4L/2L"] = round((b["quantize_seconds"] / 4) / (a["quantize_seconds"] / 2), 3)
    for key, r in results.items():
        if key.startswith("engine"):
            ratios[f"{key} growth/bound"] = round(r["growth_over_bound"], 3)
    print("\n" + "  ".join(f"{k}: {v}x" for k, v in ratios.items()))
    print(json.dumps({"bench": "scale", "ratios": ratios, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
