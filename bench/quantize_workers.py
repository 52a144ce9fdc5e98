"""Quantize pipeline on tiny-sala: wall time with 1 and 2 local Ray workers, and parallel vs
sequential mode (time and resulting KL), all measured in this run.

    python bench/quantize_workers.py [--num-samples 64]

Each configuration runs the real CLI (pipelines/quantize.py) in a subprocess with its own
local Ray and a throwaway MLflow store; "quantize s" is the Hessian + GPTQ stage alone, the
part that Ray parallelises, "total s" includes Ray start-up, loading and evaluation.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(mode: str, workers: int, args, home: Path) -> dict:
    env = {**os.environ, "SALA_HOME": str(home), "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    out = home / f"out-{mode}-{workers}"
    cmd = [sys.executable, str(ROOT / "pipelines" / "quantize.py"), "--model", args.model, "--output", str(out),
           "--mode", mode, "--workers", str(workers), "--num-samples", str(args.num_samples),
           "--seq-len", str(args.seq_len), "--shards", "4", "--no-register", "--act-order"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"{mode}/{workers} failed:\n{r.stderr[-2000:]}")
    return json.loads(next(line for line in reversed(r.stdout.splitlines()) if line.startswith("{")))  # the summary's JSON line


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint dir (default: tiny-sala)")
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--modes", nargs="+", choices=["sequential", "parallel"], default=["sequential", "parallel"])
    args = ap.parse_args()
    if args.model is None:
        sys.path.insert(0, str(ROOT))
        from sala.tiny import ensure_tiny_sala

        args.model = str(ensure_tiny_sala())
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            for workers in (1, 2):
                rows[(mode, workers)] = run(mode, workers, args, Path(tmp))
    print(f"quantize pipeline on tiny-sala, GPTQ + FourOverSix + act-order, {args.num_samples} calibration rows")
    print(f"{'mode':<12}{'workers':>8}{'quantize s':>12}{'total s':>10}{'speed-up':>10}{'KL':>10}{'ppl':>9}")
    for (mode, w), r in rows.items():
        speed = rows[(mode, 1)]["quantize_seconds"] / r["quantize_seconds"]
        print(f"{mode:<12}{w:>8}{r['quantize_seconds']:>12.1f}{r['total_seconds']:>10.1f}{speed:>10.2f}"
              f"{r['kl_mean']:>10.5f}{r['ppl_nvfp4']:>9.3f}")
    if len(args.modes) == 2:
        seq, par = rows[("sequential", 2)], rows[("parallel", 2)]
        print(f"parallel vs sequential (2 workers): {seq['quantize_seconds'] / par['quantize_seconds']:.2f}x faster, "
              f"KL {par['kl_mean']:.5f} vs {seq['kl_mean']:.5f}")
    print(json.dumps({"bench": "quantize_workers",
                      "speedup_2_workers": {m: round(rows[(m, 1)]["quantize_seconds"] / rows[(m, 2)]["quantize_seconds"], 3)
                                            for m in args.modes},
                      "rows": [{"mode": m, "workers": w, **{k: r[k] for k in ("quantize_seconds", "total_seconds", "kl_mean", "ppl_nvfp4")}}
                               for (m, w), r in rows.items()]}))


if __name__ == "__main__":
    main()
