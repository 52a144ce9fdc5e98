"""The quantize pipeline: a BF16 SALA checkpoint in, an NVFP4 (GPTQ + FourOverSix) checkpoint out,
evaluated against the BF16 model, tracked in MLflow and registered in its model registry.

    python pipelines/quantize.py                               # tiny-sala, local Ray, sqlite MLflow
    ray job submit --working-dir . -- python pipelines/quantize.py --model /abs/ckpt --output /abs/out

Stages: calibration set (matched to a target task mix) -> a pool of Ray actors, each holding the
model and some calibration shards (pipelines/layer_pool.py) -> per-layer Hessians (layer by layer
through the already quantized layers, or all at once from BF16 in parallel mode), summed per
shard in order -> GPTQ, one Linear per actor call -> compressed-tensors checkpoint -> held-out
perplexity, and the logprob evaluation against BF16 (pipelines/evaluate.py: KL, flips, cosine;
the quality gate, `GATE`) -> MLflow run, plots, model version, alias if the gate passes. The
checkpoint is the same bytes whatever the number of workers. Finished layers are kept beside the
output, so a rerun resumes.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python pipelines/quantize.py` from a checkout or a Ray working_dir
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pipelines.capacity import check_driver, check_workers, ray_nodes  # noqa: E402
from pipelines.cli import HelpFormatter  # noqa: E402
from pipelines.generate import PROMPT_COLUMN  # noqa: E402
from pipelines.layer_pool import RESULTS_FORMAT, Job, LayerPool, results_from_bytes, results_to_bytes  # noqa: E402
from pipelines.raycluster import RayUnavailable, check_address, init_ray  # noqa: E402
from registry.models import ModelSpecError, model_name, register_checkpoint, resolve_model_path, set_alias  # noqa: E402
from registry.tracking import TrackingError, check_reachable, interrupt_deferred, setup_mlflow, tracking_uri  # noqa: E402
from sala.checkpoint import CheckpointError, write_file_atomic  # noqa: E402
from sala.eval import calibration as cal  # noqa: E402
from sala.footprint import MemoryShortfall  # noqa: E402
from sala.kv import PLAN_FILE, KVPlanError, load_plan  # noqa: E402
from sala.process_exit import exit_now  # noqa: E402
from sala.quant.export import MAX_SHARD_BYTES  # noqa: E402
from sala.quant.memory import QuantizeMemory, quantize_memory  # noqa: E402
from sala.tiny import ensure_tiny_sala, sala_home  # noqa: E402

# The registry gate: pipelines/evaluate.py's score_checkpoint, the written checkpoint against its
# source rounded to BF16 (built-in prompts, their first GATE_PROMPT_TOKENS each teacher-forced,
# top-256 of the last 128 positions, one layer at a time). Measured on tiny-sala by
# bench/logprob_eval.py (64 calibration rows x 128 tokens, 64 prompts):
#                 mean KL   flips   cosine
#   GPTQ-4/6      0.0119    9.8%    0.991    (this pipeline's default method)
#   GPTQ-M6       0.0143    9.9%    0.989
#   RTN-4/6       0.0152   10.8%    0.988
#   RTN-M6        0.0179   11.7%    0.987
#   broken        0.1178   30.2%    0.919    (GPTQ-4/6 of the weights + noise of 0.25 x their RMS)
#   noise alone   0.1109   26.9%    0.925    (0.25 x RMS, not quantized, 32 prompts: test_gate_refuses_a_broken_checkpoint)
# The limits sit at ~2.5x the measured GPTQ-4/6 KL (room for calibration sets and seeds) and ~4x
# below the broken checkpoint's.
GATE = {"max_kl": 0.03, "max_flip_rate": 0.15, "min_cosine": 0.98}
GATE_PROMPT_TOKENS = 96  # each gate prompt's first tokens, all scored but the first


def gate_failures(score: dict, max_kl: float, max_flip_rate: float, min_cosine: float) -> list[str]:
    """What keeps a logprob score (pipelines.evaluate.score_checkpoint's summary) from the registry alias."""
    return [m for bad, m in [
        (not score["kl_mean"] <= max_kl, f"mean KL {score['kl_mean']:.5f} > {max_kl:g}"),
        (not score["flip_rate"] <= max_flip_rate, f"flip rate {score['flip_rate']:.2%} > {max_flip_rate:.2%}"),
        (not score["cosine_mean"] >= min_cosine, f"mean cosine {score['cosine_mean']:.5f} < {min_cosine:g}"),
    ] if bad]


# ----------------------------------------------------------------------------- arguments
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pipelines/quantize.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--model", help="checkpoint directory or models:/name@alias (default: tiny-sala)")
    ap.add_argument("--output", help="checkpoint directory to write (default: $SALA_HOME/quantized/<model>-nvfp4-<method>-<rule>, "
                                     "replaced on each run)")
    ap.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    ap.add_argument("--method", choices=["gptq", "rtn"], default="gptq")
    ap.add_argument("--scale-rule", choices=["6", "4over6"], default="4over6", help="FourOverSix or plain NVFP4")
    ap.add_argument("--act-order", action="store_true", help="GPTQ columns by descending Hessian diagonal")
    ap.add_argument("--damp", type=float, default=0.01, help="GPTQ dampening, fraction of the mean diagonal")
    ap.add_argument("--mode", choices=["sequential", "parallel"], default="sequential",
                    help="sequential: Hessians through already quantized layers (accurate); parallel: all from BF16 (fast)")
    ap.add_argument("--calibration", help="jsonl / parquet / a datasets.save_to_disk directory / a dataset name in the local "
                                          "datasets cache (default: tiny-sala corpus + generated code, Q&A, lists)")
    ap.add_argument("--split", help="split of a DatasetDict given to --calibration (default: its only split)")
    ap.add_argument("--text-column", help="column holding the text (default: text, prompt, messages or content)")
    ap.add_argument("--mix-from", help="dataset whose task mix the calibration set should match (e.g. the eval set)")
    ap.add_argument("--target-mix", help="explicit task mix, e.g. code=0.3,qa=0.3,prose=0.3,list=0.1")
    ap.add_argument("--num-samples", type=int, default=128, help="calibration rows")
    ap.add_argument("--seq-len", type=int, default=256, help="calibration sequence length (tokens)")
    ap.add_argument("--shards", type=int, default=4, help="calibration shards the workers share out; the output depends on this, not on --workers")
    ap.add_argument("--workers", type=int, default=None,
                    help="worker actors (default: one per GPU, else one per CPU); on a local Ray also the CPUs it starts with")
    ap.add_argument("--eval-sequences", type=int, default=32, help="held-out sequences for perplexity and KL")
    ap.add_argument("--max-kl", type=float, default=GATE["max_kl"],
                    help="quality gate: the alias moves only if the logprob evaluation's mean KL <= this")
    ap.add_argument("--max-flip-rate", type=float, default=GATE["max_flip_rate"],
                    help="quality gate: ... and its share of positions whose most likely token changed <= this")
    ap.add_argument("--min-cosine", type=float, default=GATE["min_cosine"],
                    help="quality gate: ... and its mean cosine similarity of the probability vectors >= this")
    ap.add_argument("--gate-prompts", type=int, default=64,
                    help="built-in prompts the gate's logprob evaluation scores (fewer is faster and noisier; the "
                         "limits were measured on 64)")
    ap.add_argument("--register-name", help="registered model name (default: <model>-nvfp4)")
    ap.add_argument("--alias", default="champion", help="alias to move when the gate passes")
    ap.add_argument("--no-register", action="store_true", help="skip the model registry")
    ap.add_argument("--experiment", default="sala-quantize", help="MLflow experiment")
    ap.add_argument("--kv-plan", help="kv_plan.json (e.g. from pipelines/kv_sensitivity.py) to ship with the checkpoint: "
                                      "FP8 k_scale / v_scale under a compressed-tensors kv_cache_scheme, the plan beside "
                                      "config.json and on the registered version; K/V scales it lacks are calibrated here "
                                      "(default: the source checkpoint's kv_plan.json, if it has one)")
    args = ap.parse_args(argv)
    for name in ("num_samples", "seq_len", "shards", "eval_sequences", "gate_prompts"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.workers is not None and args.workers <= 0:
        ap.error("--workers must be positive")
    if not 0 <= args.max_flip_rate <= 1 or not -1 <= args.min_cosine <= 1:
        ap.error("--max-flip-rate must be within [0, 1] and --min-cosine within [-1, 1]")
    return args


def parse_mix(text: str) -> dict[str, float]:
    try:
        mix = {k.strip(): float(v) for k, v in (kv.split("=") for kv in text.split(","))}
    except ValueError as e:
        raise cal.DatasetError(f"--target-mix {text!r}: expected task=share,... ({e})") from e
    if not mix or any(v < 0 for v in mix.values()) or sum(mix.values()) <= 0:
        raise cal.DatasetError(f"--target-mix {text!r}: shares must be non-negative and not all zero")
    return mix


# ------------------------------------------------------------------------------ calibration
def target_mix(args) -> dict[str, float] | None:
    if args.target_mix:
        return parse_mix(args.target_mix)
    if args.mix_from:
        records, _ = cal.read_records(args.mix_from)
        column = cal.text_column(records, args.mix_from, args.text_column)
        return cal.analyse(cal.to_rows(records, column)).proportions
    return None


# ----------------------------------------------------------------------- per-layer results
class LayerStore:
    """Finished layers beside the output, each a safetensors file plus a JSON record with its
    sha256 and the options that produced it; a rerun reuses exactly those that still verify."""

    def __init__(self, directory: Path, fingerprint: str):
        self.dir = directory
        self.fingerprint = fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)

    def _paths(self, idx: int):
        return self.dir / f"layer_{idx:03d}.safetensors", self.dir / f"layer_{idx:03d}.json"

    def save(self, idx: int, blob: bytes, stats: dict) -> None:
        st_path, rec_path = self._paths(idx)
        write_file_atomic(st_path, blob)  # the record last: it vouches for the weights by their sha256
        write_file_atomic(rec_path, json.dumps({"fingerprint": self.fingerprint, "stats": stats,
                                                "sha256": hashlib.sha256(blob).hexdigest()}).encode())

    def load(self, idx: int) -> tuple[bytes, dict] | None:
        """The layer's (blob, stats) if a finished, verified, same-options file exists, else None."""
        st_path, rec_path = self._paths(idx)
        if not (st_path.exists() and rec_path.exists()):
            return None
        record = json.loads(rec_path.read_text())
        blob = st_path.read_bytes()
        if record["fingerprint"] != self.fingerprint or record["sha256"] != hashlib.sha256(blob).hexdigest():
            return None
        return blob, record["stats"]


# --------------------------------------------------------------------------------- stages
def run_quantization(args, model_dir: Path, config, seqs: torch.Tensor, store: LayerStore, workers: int, log_layer,
                     need: QuantizeMemory) -> list[dict]:
    """Every layer quantized on a pool of Ray actors, each finished layer saved in `store` as it
    completes (the driver keeps none in memory); returns the per-module table of every layer."""
    import ray
    from tqdm import tqdm

    from sala.model import SALAForCausalLM
    from sala.quant.layerwise import layer_groups

    with torch.device("meta"):  # the layers' structure only: the workers read the weights
        layers = SALAForCausalLM(config).model.layers
    opts = {"method": args.method, "scale_rule": args.scale_rule, "act_order": args.act_order, "damp": args.damp}
    rows: dict[int, list[dict]] = {}
    for i in range(len(layers)):
        if (finished := store.load(i)) is not None:
            rows[i] = per_layer_table({i: results_from_bytes(*finished)})
    if rows:
        print(f"resuming: reusing {len(rows)} finished layer(s) {sorted(rows)}", flush=True)
    todo = [i for i in range(len(layers)) if i not in rows]
    bar = tqdm(total=len(layers), initial=len(rows), desc="quantizing layers", file=sys.stderr)

    def jobs(idx: int) -> list[Job]:
        named = dict(layers[idx].named_modules())
        # GPTQ costs about K^2 (N + K) for an [N, K] weight, RTN about N K: the longest first.
        cost = (lambda n, k: k * k * (n + k)) if args.method == "gptq" else (lambda n, k: n * k)
        return [Job(layer=idx, group=group, module=m, site=site, cost=cost(named[m].out_features, named[m].in_features))
                for site, groups in layer_groups(layers[idx]).items() for group in groups for m in group]

    def finish(idx: int, results: dict) -> tuple[bytes, dict]:
        blob = results_to_bytes(dict(sorted(results.items())))  # completion order varies with the workers; the bytes must not
        store.save(idx, *blob)
        log_layer(idx, results)
        rows[idx] = per_layer_table({idx: results})
        bar.update(1)
        return blob

    if todo:
        sequential = args.mode == "sequential" and args.method == "gptq"
        pool = LayerPool(model_dir, seqs, args.shards, workers, ray.cluster_resources().get("GPU", 0), need,
                         finished=store.load if sequential else None)
        print(f"workers    {len(pool.live)} Ray actors on {pool.nodes} node(s) (pids {' '.join(map(str, pool.pids))}) over "
              f"{pool.shards} calibration shards", flush=True)
        if not sequential:  # parallel mode, or RTN (it reads no inputs: nothing to be sequential about)
            partial = {i: {} for i in todo}
            needed = {i: len(jobs(i)) for i in todo}

            def done(job: Job, out) -> None:
                partial[job.layer].update(results_from_bytes(*out))
                if len(partial[job.layer]) == needed[job.layer]:
                    finish(job.layer, partial.pop(job.layer))

            pool.run([j for i in todo for j in jobs(i)], opts, done)
        else:
            # Layer by layer: layer i's Hessians come from inputs that went through the quantized
            # layers before it (the actors apply them first, read from `store`), so GPTQ corrects
            # the error those introduced.
            for i in todo:
                results = {}
                pool.run(jobs(i), opts, lambda job, out: results.update(results_from_bytes(*out)))
                finish(i, results)
        pool.close()
        if pool.calls_by_node:
            print("work by node: " + ", ".join(f"node {n}: {c} calls" for n, c in pool.calls_by_node.items())
                  + (f"; {pool.lost} worker(s) lost and replaced" if pool.lost else ""), flush=True)
    bar.close()
    return [r for i in sorted(rows) for r in rows[i]]


# ----------------------------------------------------------------------------------- report
def calibrate_kv_scales(plan, reference, seqs: torch.Tensor) -> None:
    """Per-head K/V amax on the calibration set for the sparse layers the plan has none for
    (static FP8 scales and NVFP4 global scales are built from them, sala/kv/formats.py), from the
    BF16 reference read one layer at a time, in batches of 8 calibration rows."""
    from sala.eval.layerwise import LayerwiseModel
    from sala.kv.measure import amax_observer, amax_table

    missing = [i for i in reference.config.sparse_layers if i not in plan.amax]
    if missing:
        seen: dict = {}

        def observe(i, layer):
            if not layer.is_lightning:
                layer.self_attn.kv_quant = amax_observer(seen, i)

        LayerwiseModel(reference, torch.bfloat16).hidden([seqs[b : b + 8] for b in range(0, len(seqs), 8)], observe)
        amax = amax_table(seen)
        plan.amax |= {i: amax[i] for i in missing}
        print(f"kv plan: K/V scales of sparse layer(s) {missing} calibrated on {len(seqs)} sequences", flush=True)


def per_layer_table(results: dict) -> list[dict]:
    rows = []
    for idx in sorted(results):
        for m, (q, st) in sorted(results[idx].items()):
            rows.append({"layer": idx, "module": m, "m4_share": q.m4_share,
                         "weight_error": st.weight_error if st else None,
                         "output_error": st.output_error if st else None,
                         "seconds": st.seconds if st else None})
    return rows


def plots(rows: list[dict], kinds: list[str]):
    """PNG figures: M=4 share per layer and module type, output error per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    layers = sorted({r["layer"] for r in rows})
    mtypes = sorted({r["module"].split(".")[-1] for r in rows})
    share = np.full((len(mtypes), len(layers)), np.nan)
    for r in rows:
        share[mtypes.index(r["module"].split(".")[-1]), layers.index(r["layer"])] = r["m4_share"]
    fig1, ax = plt.subplots(figsize=(1 + 0.5 * len(layers), 0.5 + 0.4 * len(mtypes)))
    im = ax.imshow(share, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    ax.set_xticks(range(len(layers)), [f"{i}{'S' if kinds[i] == 'minicpm4' else 'L'}" for i in layers])
    ax.set_yticks(range(len(mtypes)), mtypes)
    ax.set_xlabel("layer (S = sparse, L = lightning)")
    ax.set_title("FourOverSix: share of 16-blocks scaled to 4")
    fig1.colorbar(im, ax=ax)
    fig1.tight_layout()
    fig2, ax = plt.subplots(figsize=(7, 3.5))
    for mt in mtypes:
        pts = [(r["layer"], r["output_error"]) for r in rows if r["module"].endswith(mt) and r["output_error"] is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=mt)
    ax.set_xlabel("layer")
    ax.set_ylabel("relative output error")
    ax.set_yscale("log")
    ax.set_title("GPTQ output error on calibration inputs")
    ax.legend(fontsize=7, ncol=2)
    fig2.tight_layout()
    return {"m4_share_per_layer.png": fig1, "output_error_per_layer.png": fig2}


# ------------------------------------------------------------------------------------- main
def default_output(name: str, args) -> Path:
    return sala_home() / "quantized" / f"{name}-nvfp4-{args.method}-{args.scale_rule}"


def fingerprint(args, model_dir: Path, seqs: torch.Tensor) -> str:
    keys = {k: getattr(args, k) for k in ("method", "scale_rule", "act_order", "damp", "mode", "shards")}
    h = hashlib.sha256(json.dumps(keys, sort_keys=True).encode())
    h.update(RESULTS_FORMAT.encode())
    h.update(str(model_dir).encode())
    h.update(seqs.numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (ModelSpecError, CheckpointError, cal.DatasetError, TrackingError, RayUnavailable, FileExistsError,
            KVPlanError, MemoryShortfall) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: finished layers are kept; run the same command again to resume", file=sys.stderr)
        return 130


def run(args) -> int:
    import mlflow

    from pipelines.evaluate import score_checkpoint
    from sala.checkpoint import CheckpointReader, load_tokenizer
    from sala.eval.compare import window_sequences
    from sala.quant.export import export_checkpoint
    from sala.tiny import split_corpus, token_stream

    t_start = time.time()
    # Everything cheap that can fail is checked before any model is loaded or Ray is started.
    check_reachable(tracking_uri())
    if os.environ.get("RAY_ADDRESS"):
        check_address(os.environ["RAY_ADDRESS"])
    model_dir = resolve_model_path(args.model or str(ensure_tiny_sala()))
    # The checkpoint's manifest and every tensor's name and shape, checked once here (reading no
    # weight): the workers and the gate then read it a tensor at a time.
    reference = CheckpointReader(model_dir)
    config = reference.config
    if args.kv_plan is None and (model_dir / PLAN_FILE).is_file():
        args.kv_plan = str(model_dir / PLAN_FILE)  # the source's plan (pipelines/kv_sensitivity.py) travels on
    kv_plan = None if args.kv_plan is None else load_plan(args.kv_plan, config)  # a bad plan fails here, before any work
    name = model_name(args.model, model_dir)
    output = Path(args.output).absolute() if args.output else default_output(name, args)
    # The default output is a cache slot the bare command reuses (registered versions keep their
    # own copy in MLflow); an output the user names is never replaced without --overwrite.
    args.overwrite = args.overwrite or args.output is None
    if output.exists() and not args.overwrite:
        raise FileExistsError(f"{output} exists; pass --overwrite to replace it")
    tokenizer = load_tokenizer(model_dir)
    rows, report = cal.calibration_source(tokenizer, args.calibration, args.text_column, args.split)
    mix = target_mix(args)
    seqs = cal.sample_and_pack(rows, tokenizer, args.num_samples, args.seq_len, mix)
    print(f"model      {model_dir}\noutput     {output}\nmlflow     {tracking_uri()}")
    print(f"calibration source mix:\n{report.table()}")
    print(f"calibration set: {len(seqs)} sequences x {args.seq_len} tokens, target mix {mix or 'source mix'}")

    resources = init_ray(num_cpus=args.workers)
    workers = args.workers or int(resources.get("GPU") or resources.get("CPU", 1))
    # What the run needs, said and checked before anything of the model is loaded.
    need = quantize_memory(config, len(seqs), args.seq_len, args.shards, args.method, MAX_SHARD_BYTES,
                           args.gate_prompts * GATE_PROMPT_TOKENS + args.eval_sequences * args.seq_len)
    on_gpu = resources.get("GPU", 0) > 0
    print(need.describe(on_gpu), flush=True)
    check_driver(need.driver(), "lower --gate-prompts / --eval-sequences, or run the driver on a host with more memory")
    check_workers(need.worker(on_gpu), workers, ray_nodes(), lambda n: f"pass --workers {n}")
    setup_mlflow(args.experiment)
    store = LayerStore(output.with_name(f".{output.name}.layers"), fingerprint(args, model_dir, seqs))
    register_name = args.register_name or f"{name}-nvfp4"

    with mlflow.start_run(run_name=f"quantize-{args.method}-{args.scale_rule}-{args.mode}") as run:
        mlflow.log_params({k: v for k, v in vars(args).items() if v is not None} | {"model_dir": str(model_dir),
                          "calibration_sequences": len(seqs), "workers": workers})
        mlflow.log_dict(report.to_dict(), "calibration_mix.json")
        mlflow.log_text(report.table(), "calibration_mix.txt")

        def log_layer(idx, res):
            metrics = {f"m4_share/layer_{idx:02d}": sum(q.m4_share for q, _ in res.values()) / len(res)}
            errs = [st.output_error for _, st in res.values() if st is not None]
            if errs:
                metrics[f"output_error/layer_{idx:02d}"] = sum(errs) / len(errs)
            with interrupt_deferred():
                mlflow.log_metrics(metrics)
                mlflow.log_metric("layers_done", len(list(store.dir.glob("layer_*.json"))), step=idx)

        t0 = time.time()
        rows_table = run_quantization(args, model_dir, config, seqs, store, workers, log_layer, need)
        quant_seconds = time.time() - t0
        m4 = sum(r["m4_share"] for r in rows_table) / len(rows_table)

        # The reference is the model as served in BF16, so the comparison measures NVFP4 alone.
        if kv_plan is not None:
            calibrate_kv_scales(kv_plan, reference, seqs)
            mlflow.log_dict(kv_plan.to_json(), "kv_plan.json")
            mlflow.log_param("kv_plan_layers", kv_plan.describe())

        def layer_results(idx: int) -> dict:
            return {f"model.layers.{idx}.{m}": q for m, (q, _) in results_from_bytes(*store.load(idx)).items()}

        print(f"writing    {output}", flush=True)
        export_checkpoint(reference, layer_results, output, tokenizer, scale_rule=args.scale_rule, method=args.method,
                          overwrite=args.overwrite, kv_plan=kv_plan,
                          producer={"name": "pipelines/quantize.py", "args": {k: v for k, v in vars(args).items()}},
                          metrics={"m4_share": m4, "quantize_seconds": quant_seconds})
        shutil.rmtree(store.dir, ignore_errors=True)

        _, heldout = split_corpus(10)
        windows = window_sequences(token_stream(tokenizer, heldout), args.seq_len, args.eval_sequences)
        # What was written is scored, not what is in memory; a layer at a time, the two models never together.
        score = score_checkpoint(output, model_dir, num_prompts=args.gate_prompts, prompt_tokens=GATE_PROMPT_TOKENS,
                                 windows=windows,
                                 progress=lambda stage: print(f"gate       scoring the {stage}", flush=True))
        quality = {k.removeprefix("heldout_"): v for k, v in score.items() if k.startswith("heldout_")}
        failures = gate_failures(score, args.max_kl, args.max_flip_rate, args.min_cosine)
        gate = not failures
        mlflow.log_metrics({"ppl_bf16": quality["ppl_reference"], "ppl_nvfp4": quality["ppl"],
                            "heldout_kl_mean": quality["kl_mean"], "top1_agreement": quality["top1_agreement"],
                            "kl_mean": score["kl_mean"], "kl_p99": score["kl_p99"], "flip_rate": score["flip_rate"],
                            "cosine_mean": score["cosine_mean"], "covered_mass_mean": score["covered_mass_mean"],
                            "m4_share": m4, "quantize_seconds": quant_seconds, "gate_passed": float(gate)})
        mlflow.log_table({k: [r[k] for r in rows_table] for k in rows_table[0]}, artifact_file="per_layer.json")
        for name, fig in plots(rows_table, config.mixer_types).items():
            mlflow.log_figure(fig, name)
        version = None
        if not args.no_register:
            version = register_checkpoint(output, register_name, tags={"method": args.method, "scale_rule": args.scale_rule,
                                          "kl_mean": f"{score['kl_mean']:.5f}", "flip_rate": f"{score['flip_rate']:.4f}",
                                          "gate": "passed" if gate else "failed"})
            if gate:
                set_alias(register_name, args.alias, version)

    print_summary(rows_table, quality, score, failures, args, output, register_name, version, run.info.run_id,
                  time.time() - t_start, quant_seconds)
    print(next_steps(output, register_name, version, gate, args.alias, run.info.experiment_id, run.info.run_id), flush=True)
    return 0


def print_summary(rows, quality, score, failures, args, output, name, version, run_id, seconds, quant_seconds) -> None:
    gate = not failures
    print(f"\n{'layer':>5}  {'module':<22}{'M=4 share':>10}{'weight err':>12}{'output err':>12}")
    for r in rows:
        we = f"{r['weight_error']:.2e}" if r["weight_error"] is not None else "-"
        oe = f"{r['output_error']:.2e}" if r["output_error"] is not None else "-"
        print(f"{r['layer']:>5}  {r['module']:<22}{r['m4_share']:>10.1%}{we:>12}{oe:>12}")
    print(f"\n{'':<18}{'BF16':>10}{'NVFP4':>10}")
    print(f"{'perplexity':<18}{quality['ppl_reference']:>10.3f}{quality['ppl']:>10.3f}")
    print(f"held-out mean KL {quality['kl_mean']:.5f}  top-1 agreement {quality['top1_agreement']:.2%}")
    print(f"logprob evaluation vs BF16: mean KL {score['kl_mean']:.5f}, flips {score['flip_rate']:.2%}, "
          f"cosine {score['cosine_mean']:.5f} over {score['positions']} positions")
    print(f"gate (KL <= {args.max_kl:g}, flips <= {args.max_flip_rate:.0%}, cosine >= {args.min_cosine:g}) "
          + ("passed" if gate else "FAILED: " + "; ".join(failures)))
    reg = f"{name} v{version}" + (f" @{args.alias}" if gate else " (alias not moved)") if version else "not registered"
    print(f"checkpoint {output}\nregistry   {reg}\nmlflow run {run_id}")
    print(f"time       {seconds:.1f} s total, {quant_seconds:.1f} s quantizing")
    print(json.dumps({"pipeline": "quantize", "mode": args.mode, "method": args.method, "scale_rule": args.scale_rule,
                      "ppl_bf16": round(quality["ppl_reference"], 4), "ppl_nvfp4": round(quality["ppl"], 4),
                      "heldout_kl_mean": round(quality["kl_mean"], 6), "top1_agreement": round(quality["top1_agreement"], 4),
                      "kl_mean": round(score["kl_mean"], 6), "flip_rate": round(score["flip_rate"], 4),
                      "cosine_mean": round(score["cosine_mean"], 6),
                      "gate_passed": gate, "quantize_seconds": round(quant_seconds, 2), "total_seconds": round(seconds, 2),
                      "output": str(output), "registered_version": version}))


def next_steps(output: Path, name: str, version: str | None, gate: bool, alias: str, experiment_id: str, run_id: str) -> str:
    """The commands that use this run's checkpoint, with its real URIs and paths, ready to paste into
    the same shell (the environment that located the registry is spelled out)."""
    spec = (f"models:/{name}@{alias}" if gate else f"models:/{name}/{version}") if version else str(output)
    env = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in ("SALA_HOME", "MLFLOW_TRACKING_URI") if os.environ.get(k))
    prefix = f"{env} " if env else ""

    def here(path: Path) -> str:  # relative to the working directory when under it, as the user typed it
        return shlex.quote(os.path.relpath(path) if Path(path).absolute().is_relative_to(Path.cwd()) else str(path))

    python = here(Path(sys.executable))
    uri = tracking_uri()
    if uri.startswith(("http://", "https://")):
        ui = f"open {uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
    else:
        ui = (f"{here(Path(sys.executable).with_name('mlflow'))} ui --backend-store-uri {shlex.quote(uri)}, "
              f"then open http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{run_id}")
    out = sala_home() / "generated" / model_name(spec, output)
    steps = [
        "\nnext steps",
        f"  serve it     {prefix}{python} -m serve.app --model {shlex.quote(spec)}",
        f"               then: curl -s 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' "
        f"""-d '{{"model": "{model_name(spec, output)}", "prompt": "The for statement", "max_tokens": 16}}'""",
        f"  batch        {prefix}{python} {here(ROOT / 'pipelines' / 'generate.py')} --model {shlex.quote(spec)} "
        f"--dataset PROMPTS.jsonl --output {shlex.quote(str(out))}",
        f"""               PROMPTS.jsonl: one JSON object a line, the prompt in "{PROMPT_COLUMN}", """
        f"""e.g. {{"{PROMPT_COLUMN}": "The for statement"}}""",
    ]
    if version:  # a registered model, which MLflow serves too
        # mlflow models serve runs `uvicorn` from PATH: this environment's bin directory goes first.
        bin_dir = shlex.quote(str(Path(sys.executable).parent))
        steps += [
            f"  MLflow serve PATH={bin_dir}:\"$PATH\" MLFLOW_TRACKING_URI={shlex.quote(uri)} "
            f"{here(Path(sys.executable).with_name('mlflow'))} models serve -m {shlex.quote(spec)} --env-manager local "
            "--port 5001",
            "               then: curl -s 127.0.0.1:5001/invocations -H 'Content-Type: application/json' "
            """-d '{"inputs": ["The for statement"], "params": {"max_new_tokens": 16}}'""",
        ]
    return "\n".join([*steps, f"  MLflow UI    {ui}"])


if __name__ == "__main__":
    exit_now(main())
