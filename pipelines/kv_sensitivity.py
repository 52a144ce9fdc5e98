"""The cache-plan ablation: which sparse layers' K/V may go NVFP4 and which lightning states bf16.

Baseline: every sparse layer FP8 (scales calibrated on calibration windows), every state fp32.
Then one Ray task per unit (a sparse layer downgraded to NVFP4, a lightning state to bf16),
retried when its worker dies, each measuring on held-out windows the mean KL to the
unquantized cache, top-1 agreement and perplexity (sala/kv/measure.py: prefill, then
teacher-forced decode, as serving uses the cache; scored by sala.eval.logprob against the
unquantized cache's top-256, the metrics the logprob evaluation reports). Then the greedy plan under the budget
(sala/kv/search.py; `--max-kl`, `--fp8-layers`, default a KL of 1.2x the all-FP8 baseline's),
each combined candidate re-measured. MLflow gets the sensitivity table, a bar plot per layer
(PNG), the plan and its metrics; the plan goes into a copy of the checkpoint (kv_plan.json,
manifest rewritten), which `Engine.from_pretrained` and the server then use as it is, and that
copy is registered in the MLflow model registry as a new version of `--register-name` (default
<model>-kv), tagged with the plan (kv_plan, kv_bytes_per_token, state_bytes_per_seq) and its KL.

Memory: the driver loads the model (in the checkpoint's dtype) for the calibration and the
reference and frees it before any task starts; each task loads it in turn. Loading maps the
shards, so the tasks of a host share one copy of the weights and each adds only its own
measurement (one batch's log-probs, cache and activations) and runtime. Before loading, the
driver prints what it and each task need (sala/kv/measure.py's measure_bytes, from the shards'
headers and the config) and refuses, naming a `--max-concurrent` that fits, a run whose tasks
at once a host cannot hold (pipelines/capacity.py); Ray schedules each task with its own bytes
as its `memory` resource.

    python pipelines/kv_sensitivity.py [--model DIR|models:/name@alias] [--max-kl X] [--fp8-layers N] [--output DIR]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from sala.process_exit import exit_now

PREFIX, SEQ = 64, 128


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pipelines/kv_sensitivity.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory or models:/name@alias (default: tiny-sala)")
    ap.add_argument("--texts", help="held-out text file, documents separated by blank lines "
                                    "(default: the checkpoint's heldout.txt)")
    ap.add_argument("--max-kl", type=float, help="budget: mean KL of the plan to the unquantized cache at most")
    ap.add_argument("--fp8-layers", type=int, help="budget: keep this many sparse layers FP8 (the most sensitive)")
    ap.add_argument("--kv-format", default="nvfp4", choices=("nvfp4", "nvfp4_4over6"), help="what K/V downgrade to")
    ap.add_argument("--windows", type=int, default=16, help="held-out windows scored per plan")
    ap.add_argument("--calib-windows", type=int, default=8, help="windows FP8 scales are calibrated on")
    ap.add_argument("--output", help="checkpoint copy with the plan (default: $SALA_HOME/kv/<model>-kv)")
    ap.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    ap.add_argument("--max-retries", type=int, default=3, help="retries of a measurement whose worker died")
    ap.add_argument("--max-concurrent", type=int, help="measurement tasks running at once (default: as many as Ray has CPUs)")
    ap.add_argument("--experiment", default="kv_sensitivity", help="MLflow experiment")
    ap.add_argument("--register-name", help="registered model the checkpoint with its plan becomes a version of "
                                            "(default: <model>-kv)")
    ap.add_argument("--no-register", action="store_true", help="write the checkpoint copy only, register nothing")
    args = ap.parse_args(argv)
    if args.max_kl is not None and not args.max_kl >= 0:
        ap.error("--max-kl must be >= 0")
    if args.fp8_layers is not None and args.fp8_layers < 0:
        ap.error("--fp8-layers must be >= 0")
    if args.windows <= 0 or args.calib_windows <= 0:
        ap.error("--windows and --calib-windows must be positive")
    if args.max_concurrent is not None and args.max_concurrent <= 0:
        ap.error("--max-concurrent must be positive")
    return args


def measure_task(model_path: str, plan_json: dict, windows, reference, num_threads: int = 1) -> dict:
    """One plan's metrics on the held-out windows (the body of the Ray task)."""
    import torch

    from sala.checkpoint import load_model
    from sala.kv import load_plan
    from sala.kv.measure import measure_plan

    torch.set_num_threads(num_threads)
    model = load_model(model_path)
    return measure_plan(model, windows, load_plan(plan_json, model.config), reference, PREFIX)


def bar_plot(table: list[dict], kinds: list[str]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1 + 0.45 * len(table), 3.5))
    rows = sorted(table, key=lambda r: r["layer"])
    ax.bar([f"{r['layer']}{'S' if r['kind'] == 'kv' else 'L'}" for r in rows], [r["kl_mean"] for r in rows],
           color=["tab:red" if r["kind"] == "kv" else "tab:blue" for r in rows])
    ax.set_xlabel("layer (S: K/V to NVFP4, L: state to bf16)")
    ax.set_ylabel("mean KL to unquantized")
    ax.set_title("cache sensitivity per layer (one unit downgraded from the FP8 / fp32 baseline)")
    fig.tight_layout()
    return fig


def needs(model, windows: int, calib_windows: int):
    """What the driver and each measurement task hold at their peaks, for the model's
    CheckpointFootprint: from the config and the windows, without loading anything."""
    from sala.footprint import RUNTIME_BYTES, Need
    from sala.kv.measure import calibrate_bytes, measure_bytes

    measuring = measure_bytes(model.config, windows, SEQ + 1, PREFIX, model.dtype)
    calibrating = calibrate_bytes(model.config, calib_windows, SEQ + 1, model.dtype)
    own = {"runtime": RUNTIME_BYTES, **model.own()}
    driver = Need("the driver (calibration, then the reference)", model.mapped,
                  own | max(calibrating, measuring, key=lambda part: sum(part.values())))
    return driver, Need("measurement task", model.mapped, own | measuring)


def plan_memory(args, model_path: Path, tasks: int):
    """Print what the driver and each task need; refuse (MemoryShortfall) what the hosts cannot
    hold, the first `tasks` measurements running at once up to --max-concurrent or the CPUs.
    Returns the task's Need."""
    from pipelines.capacity import check_driver, check_workers, ray_nodes
    from sala.footprint import CheckpointFootprint, gib, host_memory

    model = CheckpointFootprint(model_path)
    driver, task = needs(model, args.windows, args.calib_windows)
    print(f"memory: model {model.describe()}\nmemory: {driver.describe()}\nmemory: each {task.describe()}", flush=True)
    least = needs(model, 1, 1)[0].total
    check_driver(driver, "fewer --windows and --calib-windows would fit" if least <= host_memory() else
                 f"even 1 window of each needs {gib(least)}: run on a host with more memory")
    nodes = ray_nodes()
    at_once = min(args.max_concurrent or tasks, tasks)
    for line in check_workers(task, at_once, nodes, lambda n: f"--max-concurrent {n} would fit"):
        print(f"memory: measurement tasks, {line}", flush=True)
    return task


def main(argv=None) -> int:
    args = parse_args(argv)
    from pipelines.raycluster import RayUnavailable, init_ray
    from registry.models import ModelSpecError, model_name, resolve_model_path
    from registry.tracking import TrackingError, setup_mlflow
    from sala.checkpoint import read_config
    from sala.footprint import MemoryShortfall
    from sala.kv.search import units
    from sala.tiny import ensure_tiny_sala, sala_home

    try:
        model_path = resolve_model_path(args.model or str(ensure_tiny_sala(progress=False)))
        config = read_config(model_path)
        texts = Path(args.texts) if args.texts else model_path / "heldout.txt"
        if not texts.is_file():
            raise ModelSpecError(f"{texts}: no held-out texts; pass --texts FILE")
        if args.fp8_layers is not None and args.fp8_layers > len(config.sparse_layers):
            raise ModelSpecError(f"--fp8-layers {args.fp8_layers}: the model has {len(config.sparse_layers)} sparse layers")
        output = Path(args.output or sala_home() / "kv" / f"{model_path.name}-kv").expanduser().absolute()
        if output.exists() and not args.overwrite:
            raise ModelSpecError(f"{output} exists; pass --overwrite to replace it")
        setup_mlflow(args.experiment)
        init_ray()
        task = plan_memory(args, model_path, 1 + len(units(config)))  # the baseline and every unit, submitted at once
    except (ModelSpecError, TrackingError, RayUnavailable, MemoryShortfall) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run(args, model_path, texts, output, model_name(args.model, model_path), task)


def reference_inputs(model_path: Path, windows, calib_windows: int, name: str):
    """The driver's part, on a model loaded here and freed on return: FP8 scales calibrated on
    the first `calib_windows` windows, and the unquantized cache's reference on the rest."""
    from sala.checkpoint import load_model
    from sala.kv.measure import calibrate_amax, reference_baseline

    model = load_model(model_path)
    amax = calibrate_amax(model, windows[:calib_windows])
    return amax, reference_baseline(model, windows[calib_windows:], PREFIX, name=name)


def bounded(submit, items: list, limit: int) -> list:
    """ray.get of submit(item) for every item, in order, with at most `limit` of them in flight."""
    import ray

    pending, results, queue = {}, {}, list(enumerate(items))[::-1]
    while queue or pending:
        while queue and len(pending) < limit:
            i, item = queue.pop()
            pending[submit(item)] = i
        (done,), _ = ray.wait(list(pending), num_returns=1)
        results[pending.pop(done)] = ray.get(done)
    return [results[i] for i in range(len(items))]


def run(args, model_path: Path, texts: Path, output: Path, name: str, task_need) -> int:
    import mlflow
    import ray
    import torch

    from pipelines.capacity import ray_memory
    from registry.models import register_checkpoint
    from sala.checkpoint import load_tokenizer, read_config
    from sala.checkpoint_files import atomic_directory, write_manifest
    from sala.eval.compare import window_sequences
    from sala.kv import KVPlan
    from sala.kv.search import downgraded, greedy_plan, units
    from sala.tiny import token_stream

    torch.set_num_threads(1)
    config = read_config(model_path)
    stream = token_stream(load_tokenizer(model_path), texts.read_text().split("\n\n"))
    windows = window_sequences(stream, SEQ, args.calib_windows + args.windows)
    if len(windows) <= args.calib_windows:
        print(f"error: {texts} holds {len(windows)} windows of {SEQ + 1} tokens; need more than --calib-windows",
              file=sys.stderr)
        return 2
    held = windows[args.calib_windows :]
    amax, reference = reference_inputs(model_path, windows, args.calib_windows, f"{model_path.name} unquantized cache")
    task = ray.remote(num_cpus=1, max_retries=args.max_retries, memory=ray_memory(task_need))(measure_task)
    path, held_ref, ref_ref = str(model_path), ray.put(held), ray.put(reference)

    def submit(plan: KVPlan):
        return task.remote(path, plan.to_json(), held_ref, ref_ref)

    baseline = KVPlan.uniform(config, "fp8", "fp32", amax)
    all_units = units(config)
    with mlflow.start_run(run_name=f"kv-sensitivity-{model_path.name}") as mlflow_run:
        mlflow.log_params({k: v for k, v in vars(args).items() if v is not None} | {"model_path": str(model_path)})
        plans = [baseline] + [downgraded(baseline, u, args.kv_format) for u in all_units]
        base_metrics, *unit_metrics = bounded(submit, plans, args.max_concurrent or len(plans))
        print(f"baseline (all FP8, fp32 states): KL {base_metrics['kl_mean']:.3e}", flush=True)
        sensitivity = {u: m["kl_mean"] for u, m in zip(all_units, unit_metrics)}
        max_kl = args.max_kl
        if max_kl is None and args.fp8_layers is None:
            max_kl = 1.2 * base_metrics["kl_mean"]
        tried = []

        def measure(plan):
            tried.append(plan)
            q = ray.get(submit(plan))
            print(f"  candidate {len(tried)}: {plan.describe()} -> KL {q['kl_mean']:.3e}", flush=True)
            return q

        plan, metrics = greedy_plan(baseline, base_metrics, sensitivity, measure, max_kl, args.fp8_layers, args.kv_format)
        # The table with every metric of each unit, not only the KL the search ranked by.
        plan.table = [row | {k: v for k, v in unit_metrics[all_units.index((row["kind"], row["layer"]))].items()}
                      for row in plan.table]
        plan.metrics = {**metrics, "baseline_kl_mean": base_metrics["kl_mean"],
                        "kv_bytes_per_token": sum(plan.kv_bytes_per_token(config).values()),
                        "state_bytes_per_seq": sum(plan.state_bytes_per_seq(config).values())}
        mlflow.log_table({k: [r[k] for r in plan.table] for k in plan.table[0]}, artifact_file="sensitivity.json")
        fig = bar_plot(plan.table, config.layer_kinds)
        mlflow.log_figure(fig, "sensitivity.png")
        mlflow.log_dict(plan.to_json(), "kv_plan.json")
        mlflow.log_metrics({f"plan_{k}": v for k, v in plan.metrics.items()}
                           | {f"baseline_{k}": v for k, v in base_metrics.items()})
        with atomic_directory(output, overwrite=args.overwrite) as tmp:
            shutil.copytree(model_path, tmp, dirs_exist_ok=True)
            plan.save(tmp)
            write_manifest(tmp, producer={"tool": "pipelines/kv_sensitivity.py", "source": name, "run_id": mlflow_run.info.run_id},
                           metrics=plan.metrics)
        version, register_name = None, args.register_name or f"{name}-kv"
        if not args.no_register:  # plan_tags adds kv_plan, kv_bytes_per_token and state_bytes_per_seq
            version = register_checkpoint(output, register_name, tags={
                "kl_mean": f"{plan.metrics['kl_mean']:.6g}", "baseline_kl_mean": f"{base_metrics['kl_mean']:.6g}",
                "budget": json.dumps(plan.budget), "source": name}, description=f"{name} with cache plan {plan.describe()}")
    print(f"plan: {plan.describe()}", flush=True)
    print(f"plan written to {output / 'kv_plan.json'} (checkpoint {output}); mlflow run {mlflow_run.info.run_id}", flush=True)
    if version:
        print(f"registered models:/{register_name}/{version} (the checkpoint with its plan)", flush=True)
    print(json.dumps({"output": str(output), "budget": plan.budget, "metrics": plan.metrics,
                      "registered": f"models:/{register_name}/{version}" if version else None}), flush=True)
    return 0


if __name__ == "__main__":
    exit_now(main())
