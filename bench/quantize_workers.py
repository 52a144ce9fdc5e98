"""Quantize pipeline scaling: the quantize stage's wall time with 1 and 2 Ray workers, on a model
big enough that a layer's GPTQ dominates (random weights, width 1024, 8 layers, built here with
tiny-sala's tokenizer), and whether both runs write the same checkpoint bytes.

    python bench/quantize_workers.py [--hidden 1024] [--intermediate 2048] [--modes sequential parallel]

Each configuration runs the real CLI (pipelines/quantize.py) in a subprocess with its own local
Ray and a throwaway MLflow store. "quantize s" is the stage the workers run (pool start-up,
Hessian forwards, GPTQ), as the pipeline reports it; "total s" adds Ray start-up, loading,
export and evaluation.
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_model(target: Path, hidden: int, intermediate: int, layers: int) -> None:
    """A SALA model with tiny-sala's architecture and tokenizer at the asked width, random weights."""
    import torch
    from transformers import AutoTokenizer

    from sala.checkpoint import read_config, save_checkpoint
    from sala.config import SALAConfig
    from sala.model import SALAForCausalLM
    from sala.tiny import ensure_tiny_sala

    tiny = ensure_tiny_sala()
    base = read_config(tiny).to_dict()
    kinds = base["mixer_types"]
    config = SALAConfig.from_dict({**base, "hidden_size": hidden, "intermediate_size": intermediate,
                                   "num_hidden_layers": layers, "num_attention_heads": hidden // 128,
                                   "num_key_value_heads": 2, "head_dim": 128, "lightning_nh": hidden // 128,
                                   "lightning_nkv": hidden // 128, "lightning_head_dim": 128,
                                   "mixer_types": [kinds[i % len(kinds)] for i in range(layers)]})
    torch.manual_seed(0)
    save_checkpoint(SALAForCausalLM(config), target, AutoTokenizer.from_pretrained(tiny), dtype=torch.bfloat16)


def calibration_file(path: Path, rows: int) -> None:
    """`rows` chunks of tiny-sala's held-out text (about 300 tokens each)."""
    from sala.tiny import RECIPE, split_corpus

    text = "\n\n".join(split_corpus(RECIPE["heldout_every"])[1])
    chunks = [text[i:i + 1200] for i in range(0, 1200 * rows, 1200)]
    path.write_text("".join(json.dumps({"text": c}) + "\n" for c in chunks))


def run(mode: str, workers: int, args, home: Path, model: Path, calib: Path) -> dict:
    env = {**os.environ, "SALA_HOME": str(home), "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    out = home / f"out-{mode}-{workers}"
    cmd = [sys.executable, str(ROOT / "pipelines" / "quantize.py"), "--model", str(model), "--output", str(out),
           "--mode", mode, "--workers", str(workers), "--calibration", str(calib), "--num-samples", str(args.rows),
           "--seq-len", "256", "--shards", str(args.shards), "--eval-sequences", "2", "--no-register", "--act-order",
           "--max-kl", "10"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"{mode}/{workers} failed:\n{r.stderr[-2000:]}")
    summary = json.loads(next(line for line in reversed(r.stdout.splitlines()) if line.startswith("{")))
    summary["sha256"] = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    print(f"  {mode} with {workers} worker(s): {summary['quantize_seconds']:.1f} s quantizing", file=sys.stderr, flush=True)
    return summary


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=8, help="calibration rows of ~300 tokens")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--modes", nargs="+", choices=["sequential", "parallel"], default=["sequential"])
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, calib = tmp / "random-sala", tmp / "calibration.jsonl"
        build_model(model, args.hidden, args.intermediate, args.layers)
        calibration_file(calib, args.rows)
        for mode in args.modes:
            for workers in (1, 2):
                rows[(mode, workers)] = run(mode, workers, args, tmp, model, calib)
    print(f"quantize pipeline, random-weight SALA: width {args.hidden}, intermediate {args.intermediate}, "
          f"{args.layers} layers; GPTQ + FourOverSix + act-order, {args.rows} calibration rows in {args.shards} shards")
    print(f"{'mode':<12}{'workers':>8}{'quantize s':>12}{'total s':>10}{'speed-up':>10}  checkpoint sha256")
    for (mode, w), r in rows.items():
        speed = rows[(mode, 1)]["quantize_seconds"] / r["quantize_seconds"]
        print(f"{mode:<12}{w:>8}{r['quantize_seconds']:>12.1f}{r['total_seconds']:>10.1f}{speed:>10.2f}  {r['sha256'][:16]}")
    result = {"bench": "quantize_workers", "hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers}
    for mode in args.modes:
        one, two = rows[(mode, 1)], rows[(mode, 2)]
        ratio, same = one["quantize_seconds"] / two["quantize_seconds"], one["sha256"] == two["sha256"]
        print(f"{mode}: 2 workers vs 1: {ratio:.2f}x faster (goal 1.7x); checkpoints identical: {'yes' if same else 'NO'}")
        result[mode] = {"speedup_2_workers": round(ratio, 3), "identical_bytes": same,
                        "quantize_seconds": {"1": one["quantize_seconds"], "2": two["quantize_seconds"]}}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
