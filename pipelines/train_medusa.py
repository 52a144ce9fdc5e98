"""Train Medusa heads for a checkpoint (frozen backbone) and write the checkpoint plus `medusa/`.

    python pipelines/train_medusa.py                       # tiny-sala, a few minutes on CPU
    python pipelines/train_medusa.py --model /ckpt --train-data chats.jsonl --val-data eval.jsonl \\
        --output /ckpt-medusa --replicas 4 --num-gpus 1

Data: `--train-data` rows (any dataset calibration reads; default: the built-in mixed set of
prose, Q&A, code and lists) cut into windows; with self-distillation (default) Ray Data shards
the windows' prompts over engine actors (`--replicas`) that write the model's own
continuations, `--given-text` trains on the text itself. `--weighting matched` (default)
draws training windows so their (task type, length) mix matches that of the windows of
`--val-data` (default: the model's held-out text, else a tenth of the training rows held out)
that accept length is measured on; `uniform` draws all alike.

The tree: on the validation windows, how often each path of draft ranks is right (what a greedy
verify would keep) is measured and stored with the heads; `--tree-nodes N` keeps the N paths
most often right (the largest tree an engine may verify: by default it picks, per batch size,
the subtree that pays best on the machine that serves), `--tree mc_sim_7b_63` Medusa's default.

MLflow: parameters, per-head loss / top-1 / top-5 while training and on validation, a PNG plot
of per-head top-1 and top-5, accept length on validation prompts, and the written checkpoint's
decode drift as served with its heads, scored by the logprob evaluation against its backbone
decoding plainly (pipelines/evaluate.py score_medusa: greedy must not drift at all, typical
acceptance is reported next to plain sampling; `--eval-prompts 0` skips it). Training state is saved
beside --output every --checkpoint-every steps; running the same command again resumes it.
Prints the checkpoint directory; the last line is JSON.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipelines.cli import HelpFormatter  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="pipelines/train_medusa.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--model", help="checkpoint directory or models:/name@alias (default: tiny-sala)")
    ap.add_argument("--output", help="checkpoint directory to write (default: $SALA_HOME/models/<model>-medusa)")
    ap.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    ap.add_argument("--train-data", help="training rows (.jsonl, .parquet, datasets directory or cached name; "
                                         "default: the built-in mixed set)")
    ap.add_argument("--val-data", help="validation rows (default: the model's heldout.txt, else 10%% of the training rows)")
    ap.add_argument("--text-column", help="text column (default: the first of text, prompt, messages, content)")
    ap.add_argument("--given-text", action="store_true", help="train on the text itself instead of self-distillation")
    ap.add_argument("--temperature", type=float, default=0.0, help="of the self-distilled continuations (0 = greedy)")
    ap.add_argument("--weighting", choices=["matched", "uniform"], default="matched", help="training row weights")
    ap.add_argument("--prompt-len", type=int, default=32, help="tokens of each window's prompt")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per training window")
    ap.add_argument("--windows-per-row", type=int, default=8, help="windows taken from each row, at most")
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--num-layers", type=int, default=1, help="residual blocks per head")
    ap.add_argument("--shared-lm-head", action=argparse.BooleanOptionalAction, default=True,
                    help="heads project through lm_head (Medusa-2's choice: drafting reads one vocabulary matrix, not "
                         "one a head); --no-shared-lm-head gives each head a projection of its own")
    ap.add_argument("--topk", type=int, default=10, help="ranks per head the tree may use")
    ap.add_argument("--tree-nodes", type=int, default=63, help="the stored tree: this many paths, the most often right")
    ap.add_argument("--tree", choices=["mc_sim_7b_63"], help="use this fixed tree instead")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--checkpoint-every", type=int, default=50, help="steps between saved training states")
    ap.add_argument("--replicas", type=int, default=1, help="self-distillation engine actors")
    ap.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per distillation actor")
    ap.add_argument("--experiment", default="train_medusa", help="MLflow experiment")
    ap.add_argument("--eval-prompts", type=int, default=16, help="prompts the served checkpoint's decode drift is scored on")
    ap.add_argument("--eval-temperature", type=float, default=0.7, help="of the typical-acceptance drift")
    args = ap.parse_args(argv)
    for name in ("steps", "batch_size", "num_heads", "topk", "tree_nodes", "replicas", "prompt_len", "windows_per_row"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.eval_prompts < 0 or args.eval_temperature <= 0:
        ap.error("--eval-prompts must be >= 0 and --eval-temperature > 0")
    if args.seq_len <= args.prompt_len + args.num_heads + 1:
        ap.error("--seq-len must exceed --prompt-len by more than --num-heads + 1 tokens")
    return args


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


class DistillStage:
    """A Ray Data actor holding one engine: windows' prompts in, the model's continuations out."""

    def __init__(self, model_path: str, max_tokens: int, temperature: float, num_gpus: float):
        import torch

        from sala.checkpoint import gpu_device
        from sala.engine import Engine, SamplingParams

        torch.set_num_threads(1)
        self.engine = Engine.from_pretrained(model_path, device=gpu_device(num_gpus), medusa=False, compile=False)
        self.params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                                     seed=0 if temperature else None)

    def __call__(self, batch):
        outs = self.engine.generate([list(map(int, p)) for p in batch["prompt"]], self.params)
        return {"index": batch["index"], "continuation": [o.token_ids for o in outs]}


def read_rows(spec: str | None, column: str | None, tokenizer):
    from sala.eval.calibration import calibration_source

    rows, report = calibration_source(tokenizer, spec, column)
    return rows, report


def plot_accuracy(history: list[dict], num_heads: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    steps = [h["step"] for h in history]
    for ax, metric in zip(axes, ("top1", "top5")):
        for k in range(num_heads):
            values = [h[f"{metric}_{k}"] for h in history]
            w = max(1, len(values) // 20)  # a running mean: single batches are noisy
            smooth = [sum(values[max(0, i - w + 1) : i + 1]) / len(values[max(0, i - w + 1) : i + 1]) for i in range(len(values))]
            ax.plot(steps, smooth, label=f"head {k} (token t+{k + 2})")
        ax.set_title(f"training {metric} accuracy per head")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    from pipelines.evaluate import LosslessError
    from pipelines.raycluster import RayUnavailable, init_ray
    from registry.models import ModelSpecError, resolve_model_path
    from registry.tracking import TrackingError, setup_mlflow
    from sala.checkpoint import CheckpointError, DeviceUnavailable, gpu_device
    from sala.eval.calibration import DatasetError
    from sala.tiny import sala_home

    try:
        gpu_device(args.num_gpus)
        model_path = resolve_model_path(args.model)
        output = Path(args.output).expanduser().absolute() if args.output else sala_home() / "models" / f"{model_path.name}-medusa"
        if output.exists() and not args.overwrite:
            raise DatasetError(f"{output} exists; pass --overwrite to replace it")
        setup_mlflow(args.experiment)
        init_ray()
        return run(args, model_path, output)
    except DeviceUnavailable as e:
        return fail(f"--num-gpus: {e}")
    except (DatasetError, ModelSpecError, TrackingError, RayUnavailable, CheckpointError, ValueError) as e:
        return fail(str(e))
    except LosslessError as e:  # the checkpoint is written; the engine serving it is what is wrong
        print(f"error: {e}", file=sys.stderr)
        return 1


def run(args, model_path: Path, output: Path) -> int:
    import mlflow
    import ray
    import torch
    from transformers import AutoTokenizer

    from sala.checkpoint import load_model
    from sala.engine import Engine
    from sala.eval.calibration import Row, guess_task
    from sala.medusa import train
    from sala.medusa.heads import MedusaConfig, MedusaHeads
    from sala.medusa.tree import MC_SIM_7B_63, expected_accept_length, top_paths

    start = time.perf_counter()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_path)
    rows, report = read_rows(args.train_data, args.text_column, tok)
    if args.val_data:
        val_rows, _ = read_rows(args.val_data, args.text_column, tok)
    elif (model_path / "heldout.txt").exists():
        val_rows = [Row(t, guess_task(t)) for t in (model_path / "heldout.txt").read_text().split("\n\n") if t.strip()]
    else:
        val_rows, rows = rows[::10], [r for i, r in enumerate(rows) if i % 10]
    data = train.DataConfig(args.prompt_len, args.seq_len, args.windows_per_row, not args.given_text, args.temperature,
                            args.weighting)
    seqs, prompts = train.windows(rows, tok, data.prompt_len, data.seq_len, data.windows_per_row)
    val_seqs, val_prompts = train.windows(val_rows, tok, data.prompt_len, data.seq_len, 2)
    if not seqs or not val_seqs:
        raise ValueError(f"{'training' if not seqs else 'validation'} rows are all shorter than --prompt-len={data.prompt_len} tokens")
    params = {k: v for k, v in vars(args).items()} | {"model_path": str(model_path), "output": str(output),
                                                      "train_windows": len(seqs), "val_windows": len(val_seqs)}
    with mlflow.start_run(run_name=f"train_medusa-{model_path.name}") as mlflow_run:
        mlflow.log_params(params)
        mlflow.log_dict(report.to_dict(), "train_mix.json")
        if data.self_distill:
            print(f"self-distilling {len(seqs) + len(val_seqs)} windows on {args.replicas} engine actor(s)", flush=True)
            items = [{"index": i, "prompt": p} for i, p in enumerate(prompts + val_prompts)]
            ds = ray.data.from_items(items).map_batches(
                DistillStage, fn_constructor_kwargs=dict(model_path=str(model_path), max_tokens=data.seq_len - data.prompt_len,
                                                         temperature=data.temperature, num_gpus=args.num_gpus),
                batch_size=64, compute=ray.data.ActorPoolStrategy(size=args.replicas), num_gpus=args.num_gpus,
                max_restarts=0)
            cont = {int(r["index"]): list(map(int, r["continuation"])) for r in ds.iter_rows()}
            seqs = train.self_distilled(seqs, [cont[i] for i in range(len(seqs))], data.prompt_len)
            val_seqs = train.self_distilled(val_seqs, [cont[len(seqs) + i] for i in range(len(val_seqs))], data.prompt_len)
        model = load_model(model_path)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        print(f"encoding {len(seqs)} training and {len(val_seqs)} validation windows through the frozen backbone", flush=True)
        encoded, val_encoded = train.encode(model, seqs, pad), train.encode(model, val_seqs, pad)
        weights = train.row_weights(seqs, val_seqs, args.weighting)
        effective = train.effective_rows(weights, len(seqs))
        mlflow.log_metric("effective_train_windows", effective)
        print(f"{args.weighting} weighting: an effective {effective:.0f} of {len(seqs)} training windows", flush=True)
        cfg = train.TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, checkpoint_every=args.checkpoint_every)
        heads = MedusaHeads(MedusaConfig(model.config.hidden_size, model.config.vocab_size, args.num_heads, args.num_layers,
                                         args.shared_lm_head, args.topk), model.lm_head)
        state_dir = output.with_name(f".{output.name}.train-state")
        if (state_dir / "train_state.json").exists():
            print(f"resuming from {state_dir}", flush=True)
        val_before = train.evaluate(heads, model, val_encoded)

        def on_step(step: int, row: dict) -> None:
            if step % 10 == 0 or step == cfg.steps:
                mlflow.log_metrics({k: v for k, v in row.items() if k != "step"}, step=step)
                print(f"step {step}/{cfg.steps}  loss {row['loss']:.3f}  top1 "
                      + " ".join(f"{row[f'top1_{k}']:.2f}" for k in range(args.num_heads)), flush=True)

        history = train.train_heads(heads, model, encoded, train.RowSampler(len(seqs), weights, cfg.batch_size, cfg.seed),
                                    cfg, state_dir, on_step)
        val = train.evaluate(heads, model, val_encoded)
        heads.config.path_acceptance = val["path_acceptance"]
        acceptance = heads.config.acceptance
        tree = [list(p) for p in MC_SIM_7B_63] if args.tree else top_paths(acceptance, args.tree_nodes) or [[0]]
        heads.config.tree = tree
        heads.tree = heads.config.build_tree()
        engine = Engine(load_model(model_path), tok, medusa=heads, medusa_nodes=len(tree), compile=False)
        accept = train.accept_length(engine, val_prompts[:32], 48)
        metrics = {"accept_length": accept, "expected_accept_length": expected_accept_length(acceptance, tree),
                   "tree_nodes": len(tree), "seconds": time.perf_counter() - start,
                   "effective_train_windows": effective,
                   **{f"val_loss_{k}": v for k, v in enumerate(val["loss"])},
                   **{f"val_top1_{k}": v for k, v in enumerate(val["top1"])},
                   **{f"val_top5_{k}": v for k, v in enumerate(val["top5"])},
                   **{f"val_loss_before_{k}": v for k, v in enumerate(val_before["loss"])}}
        mlflow.log_metrics(metrics)
        plot = state_dir.parent / f".{output.name}.accuracy.png"
        plot_accuracy(history, args.num_heads, plot)
        mlflow.log_artifact(str(plot), "plots")
        plot.unlink()
        path = train.write_medusa_checkpoint(model_path, heads, output, overwrite=args.overwrite,
                                             producer={"name": "pipelines/train_medusa.py", "mlflow_run": mlflow_run.info.run_id},
                                             metrics=metrics)
        shutil.rmtree(state_dir, ignore_errors=True)
        drift = {}
        if args.eval_prompts:
            from pipelines.evaluate import score_medusa

            print(f"scoring the decode drift of {path} as served with Medusa on {args.eval_prompts} prompts", flush=True)
            drift = score_medusa(path, num_prompts=args.eval_prompts, temperature=args.eval_temperature)
            mlflow.log_metrics(drift)
    print("validation per head: " + "  ".join(f"head {k}: loss {val_before['loss'][k]:.2f} -> {val['loss'][k]:.2f}, "
                                              f"top-1 {val['top1'][k]:.2f}, top-5 {val['top5'][k]:.2f}"
                                              for k in range(args.num_heads)))
    print(f"accept length {accept:.2f} tokens per verify step on {min(32, len(val_prompts))} validation prompts "
          f"(tree of {len(tree)} nodes)")
    if drift:
        print(f"decode drift vs plain greedy: greedy Medusa {drift['medusa_greedy_drift_identical_share']:.0%} of prompts "
              f"identical (KL {drift['medusa_greedy_drift_kl_mean']:.2e}); typical acceptance at temperature "
              f"{args.eval_temperature:g}: first divergence at step {drift['medusa_typical_drift_first_divergence_mean']:.1f} "
              f"on average (plain sampling {drift['plain_sampled_drift_first_divergence_mean']:.1f}), KL "
              f"{drift['medusa_typical_drift_kl_mean']:.2e}, flips {drift['medusa_typical_drift_flip_rate']:.2%}")
    print(f"mlflow run {mlflow_run.info.run_id} (experiment {args.experiment})")
    print(f"checkpoint {path}")
    print(json.dumps({"pipeline": "train_medusa", "checkpoint": str(path), **metrics, **drift}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
