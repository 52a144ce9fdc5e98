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

Memory: one model per process, in the checkpoint's dtype (the heads train in fp32; the backbone
is never upcast). Each distillation actor loads an engine sized for its windows; once they are
gone the driver loads the model once, encodes, trains, evaluates, and measures accept length
with an engine on that same model; the drift scoring's three engines share one model too.
Loading maps the shards, so a host's processes share the weights, and an engine's own copies
are its fused projections and its cache. Before loading anything, the driver prints what each
actor, its training and its drift scoring need (sala/medusa/train.py's training_bytes,
sala/footprint.py) and refuses, naming a --replicas or --batch-size that fits, what the hosts
cannot hold (pipelines/capacity.py); Ray places each actor by its own bytes as its `memory`.
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pipelines.cli import HelpFormatter  # noqa: E402
from sala.process_exit import exit_now  # noqa: E402


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
    if args.tree:
        from sala.medusa.tree import MC_SIM_7B_63, InvalidTree, build_tree

        try:  # the check loading the heads would make, before anything runs
            build_tree(MC_SIM_7B_63, args.topk, args.num_heads)
        except InvalidTree as e:
            ap.error(f"--tree {args.tree} does not fit --num-heads {args.num_heads} --topk {args.topk}: {e}")
    if args.seq_len <= args.prompt_len + args.num_heads + 1:
        ap.error("--seq-len must exceed --prompt-len by more than --num-heads + 1 tokens")
    return args


ACCEPT_PROMPTS, ACCEPT_TOKENS = 32, 48  # accept length: validation prompts decoded greedily, new tokens each


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


class DistillStage:
    """A Ray Data actor holding one engine: windows' prompts in, the model's continuations out."""

    def __init__(self, model_path: str, prompt_len: int, max_tokens: int, temperature: float, num_gpus: float):
        import torch

        from sala.checkpoint import gpu_device
        from sala.engine import Engine, SamplingParams

        torch.set_num_threads(1)
        self.engine = Engine.from_pretrained(model_path, device=gpu_device(num_gpus), medusa=False,
                                             **distill_settings(prompt_len, max_tokens))
        self.params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                                     seed=0 if temperature else None)

    def __call__(self, batch):
        outs = self.engine.generate([list(map(int, p)) for p in batch["prompt"]], self.params)
        return {"index": batch["index"], "continuation": [o.token_ids for o in outs]}


def distill_settings(prompt_len: int, max_tokens: int) -> dict:
    """A distillation engine's settings (it decodes plainly): its cache sized for a prompt and its continuation."""
    from pipelines.evaluate import engine_context

    return {"compile": False, "max_model_len": engine_context(prompt_len + max_tokens)}


def accept_settings(prompt_len: int) -> dict:
    """The accept-length engine's settings: its cache sized for a prompt and ACCEPT_TOKENS more."""
    from pipelines.evaluate import engine_context

    return {"compile": False, "max_model_len": engine_context(prompt_len + ACCEPT_TOKENS)}


def actor_need(args, model):
    """What each distillation actor holds: an engine on the model (CheckpointFootprint) sized for its windows."""
    from sala.footprint import RUNTIME_BYTES

    return model.engine_need("distillation actor", {"runtime": RUNTIME_BYTES},
                             **distill_settings(args.prompt_len, args.seq_len - args.prompt_len))


def driver_needs(args, model, windows: int, batch: int) -> list:
    """What the driver holds at the peaks of its two phases on one model (CheckpointFootprint),
    training on `windows` windows in batches of `batch`: the training (encoding first), then
    the accept-length engine on that model (the heads and their gradients kept, the optimizer
    and the encoded windows gone)."""
    from sala.footprint import RUNTIME_BYTES, Need, forward_bytes
    from sala.medusa import train
    from sala.medusa.heads import MedusaConfig

    config, runtime = model.config, {"runtime": RUNTIME_BYTES}
    heads = MedusaConfig(config.hidden_size, config.vocab_size, args.num_heads, args.num_layers, args.shared_lm_head, args.topk)
    training = train.training_bytes(heads, windows, args.seq_len, batch, model.dtype)
    encoding = forward_bytes(config, train.ENCODE_BATCH, args.seq_len, model.dtype)
    work = {"training step, evaluation or encoding": max(training.pop("training step or evaluation"), encoding)}
    return [Need(f"the driver's training (--batch-size {batch})", model.mapped, runtime | model.own() | training | work),
            model.engine_need("the driver's accept-length engine", runtime | {"heads": training["heads"]},
                              tree_rows=tree_rows(args), **accept_settings(args.prompt_len))]


def drift_need(args, model):
    """What the drift scoring holds: score_medusa's three engines on one model."""
    from pipelines.evaluate import drift_engine_settings
    from sala.footprint import RUNTIME_BYTES

    return model.engine_need("the drift scoring (three engines on one model)", {"runtime": RUNTIME_BYTES}, engines=3,
                             tree_rows=tree_rows(args), compile=False, **drift_engine_settings())


def tree_rows(args) -> int:
    """The most tokens a request's verify step checks: the root and every path of the tree."""
    from sala.medusa.tree import MC_SIM_7B_63

    return 1 + (len(MC_SIM_7B_63) if args.tree else args.tree_nodes)


def plan_memory(args, model_path: Path, windows: int):
    """Print what each distillation actor, the driver's training and its drift scoring need, from
    the shards' headers, the config and the settings; refuse (MemoryShortfall) what the hosts
    cannot hold. Returns the actors' Need (None when there are none or they run on GPUs)."""
    from pipelines.capacity import check_driver, check_workers, ray_nodes
    from sala.footprint import CheckpointFootprint, gib, host_memory

    model = CheckpointFootprint(model_path)
    print(f"memory: model {model.describe()}", flush=True)
    actor = None if args.given_text else actor_need(args, model)
    if actor and args.num_gpus:
        print(f"memory: each {actor.describe()}, the model on the GPU: host memory not checked", flush=True)
    elif actor:
        print(f"memory: each {actor.describe()}", flush=True)
        for line in check_workers(actor, args.replicas, ray_nodes(),
                                  lambda n: f"--replicas {n} would fit, or --given-text (no distillation)"):
            print(f"memory: distillation actors, {line}", flush=True)
    phases = driver_needs(args, model, windows, args.batch_size)
    for need in phases:
        print(f"memory: {need.describe()}", flush=True)
    fits = next((b for b in range(args.batch_size - 1, 0, -1)
                 if max(n.total for n in driver_needs(args, model, windows, b)) <= host_memory()), None)
    least = max(n.total for n in driver_needs(args, model, windows, 1))
    for need in phases:
        check_driver(need, f"--batch-size {fits} would fit" if fits else f"even --batch-size 1 needs {gib(least)}: run on a "
                     "host with more memory")
    if args.eval_prompts:
        drift = drift_need(args, model)
        print(f"memory: {drift.describe()}", flush=True)
        check_driver(drift, "--eval-prompts 0 skips it")
    return None if args.num_gpus else actor


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
    from pipelines.raycluster import RayUnavailable
    from registry.models import ModelSpecError, resolve_model_path
    from registry.tracking import TrackingError, setup_mlflow
    from sala.checkpoint import CheckpointError, DeviceUnavailable, gpu_device
    from sala.eval.calibration import DatasetError
    from sala.footprint import MemoryShortfall
    from sala.tiny import sala_home

    try:
        gpu_device(args.num_gpus)
        model_path = resolve_model_path(args.model)
        output = Path(args.output).expanduser().absolute() if args.output else sala_home() / "models" / f"{model_path.name}-medusa"
        if output.exists() and not args.overwrite:
            raise DatasetError(f"{output} exists; pass --overwrite to replace it")
        setup_mlflow(args.experiment)
        return run(args, model_path, output)
    except DeviceUnavailable as e:
        return fail(f"--num-gpus: {e}")
    except (DatasetError, ModelSpecError, TrackingError, RayUnavailable, CheckpointError, ValueError, MemoryShortfall) as e:
        return fail(str(e))
    except LosslessError as e:  # the checkpoint is written; the engine serving it is what is wrong
        print(f"error: {e}", file=sys.stderr)
        return 1


@dataclass
class Trained:
    """What the driver's work on the backbone leaves: the heads (their tree chosen), the training
    log, the effective training windows, validation before and after, accept length."""

    heads: object
    history: list[dict]
    effective: float
    val_before: dict
    val: dict
    accept: float


def train_on_backbone(args, model_path: Path, tok, seqs, val_seqs, val_prompts, state_dir: Path | None,
                      on_step=None) -> Trained:
    """The driver's part on the frozen backbone, which it loads once (in the checkpoint's dtype)
    and frees on return: the windows encoded, the heads trained and evaluated, the tree chosen,
    and accept length measured by an engine on that same model."""
    from sala.checkpoint import load_model
    from sala.engine import Engine
    from sala.medusa import train
    from sala.medusa.heads import MedusaConfig, MedusaHeads
    from sala.medusa.tree import MC_SIM_7B_63, top_paths

    model = load_model(model_path)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    print(f"encoding {len(seqs)} training and {len(val_seqs)} validation windows through the frozen backbone", flush=True)
    encoded, val_encoded = train.encode(model, seqs, pad), train.encode(model, val_seqs, pad)
    weights = train.row_weights(seqs, val_seqs, args.weighting)
    effective = train.effective_rows(weights, len(seqs))
    print(f"{args.weighting} weighting: an effective {effective:.0f} of {len(seqs)} training windows", flush=True)
    cfg = train.TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, checkpoint_every=args.checkpoint_every)
    heads = MedusaHeads(MedusaConfig(model.config.hidden_size, model.config.vocab_size, args.num_heads, args.num_layers,
                                     args.shared_lm_head, args.topk), model.lm_head)
    eval_batch = train.evaluate_batch(args.batch_size)
    val_before = train.evaluate(heads, model, val_encoded, eval_batch)
    history = train.train_heads(heads, model, encoded, train.RowSampler(len(seqs), weights, cfg.batch_size, cfg.seed),
                                cfg, state_dir, on_step)
    val = train.evaluate(heads, model, val_encoded, eval_batch)
    heads.config.path_acceptance = val["path_acceptance"]
    tree = [list(p) for p in MC_SIM_7B_63] if args.tree else top_paths(heads.config.acceptance, args.tree_nodes) or [[0]]
    heads.config.tree = tree
    heads.tree = heads.config.build_tree()
    del encoded, val_encoded  # gone before the engine makes its fused copies and its cache
    # The engine decodes the model loaded here: its fused projections replace the unfused ones.
    engine = Engine(model, tok, medusa=heads, medusa_nodes=len(tree), **accept_settings(args.prompt_len))
    accept = train.accept_length(engine, val_prompts[:ACCEPT_PROMPTS], ACCEPT_TOKENS)
    return Trained(heads, history, effective, val_before, val, accept)


def run(args, model_path: Path, output: Path) -> int:
    import mlflow
    import ray
    import torch

    from pipelines.capacity import ray_memory
    from pipelines.raycluster import init_ray
    from sala.checkpoint import load_tokenizer
    from sala.eval.calibration import Row, guess_task
    from sala.medusa import train
    from sala.medusa.tree import expected_accept_length

    start = time.perf_counter()
    torch.manual_seed(0)
    tok = load_tokenizer(model_path)
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
    if data.self_distill:
        init_ray()  # the distillation actors' (training on the given text runs in this process alone)
    actor = plan_memory(args, model_path, len(seqs) + len(val_seqs))
    with mlflow.start_run(run_name=f"train_medusa-{model_path.name}") as mlflow_run:
        mlflow.log_params(params)
        mlflow.log_dict(report.to_dict(), "train_mix.json")
        if data.self_distill:
            print(f"self-distilling {len(seqs) + len(val_seqs)} windows on {args.replicas} engine actor(s)", flush=True)
            items = [{"index": i, "prompt": p} for i, p in enumerate(prompts + val_prompts)]
            ds = ray.data.from_items(items).map_batches(
                DistillStage, fn_constructor_kwargs=dict(model_path=str(model_path), prompt_len=data.prompt_len,
                                                         max_tokens=data.seq_len - data.prompt_len,
                                                         temperature=data.temperature, num_gpus=args.num_gpus),
                batch_size=64, compute=ray.data.ActorPoolStrategy(size=args.replicas), num_gpus=args.num_gpus,
                memory=ray_memory(actor) if actor else None, max_restarts=0)
            cont = {int(r["index"]): list(map(int, r["continuation"])) for r in ds.iter_rows()}
            seqs = train.self_distilled(seqs, [cont[i] for i in range(len(seqs))], data.prompt_len)
            val_seqs = train.self_distilled(val_seqs, [cont[len(seqs) + i] for i in range(len(val_seqs))], data.prompt_len)
        state_dir = output.with_name(f".{output.name}.train-state")
        if (state_dir / "train_state.json").exists():
            print(f"resuming from {state_dir}", flush=True)

        def on_step(step: int, row: dict) -> None:
            if step % 10 == 0 or step == args.steps:
                mlflow.log_metrics({k: v for k, v in row.items() if k != "step"}, step=step)
                print(f"step {step}/{args.steps}  loss {row['loss']:.3f}  top1 "
                      + " ".join(f"{row[f'top1_{k}']:.2f}" for k in range(args.num_heads)), flush=True)

        trained = train_on_backbone(args, model_path, tok, seqs, val_seqs, val_prompts, state_dir, on_step)
        gc.collect()  # the Medusa engine's parts refer to each other: only the cycle collector frees them and the model
        heads, val_before, val, tree = trained.heads, trained.val_before, trained.val, trained.heads.config.tree
        metrics = {"accept_length": trained.accept, "expected_accept_length": expected_accept_length(heads.config.acceptance, tree),
                   "tree_nodes": len(tree), "seconds": time.perf_counter() - start,
                   "effective_train_windows": trained.effective,
                   **{f"val_loss_{k}": v for k, v in enumerate(val["loss"])},
                   **{f"val_top1_{k}": v for k, v in enumerate(val["top1"])},
                   **{f"val_top5_{k}": v for k, v in enumerate(val["top5"])},
                   **{f"val_loss_before_{k}": v for k, v in enumerate(val_before["loss"])}}
        mlflow.log_metrics(metrics)
        plot = state_dir.parent / f".{output.name}.accuracy.png"
        plot_accuracy(trained.history, args.num_heads, plot)
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
    print(f"accept length {trained.accept:.2f} tokens per verify step on {min(ACCEPT_PROMPTS, len(val_prompts))} validation prompts "
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
    exit_now(main())
