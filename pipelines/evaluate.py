"""Logprob evaluation: collect a BF16 baseline once, then score any model or server against it.

    python pipelines/evaluate.py baseline                                    # tiny-sala, built-in prompts
    python pipelines/evaluate.py baseline --url http://127.0.0.1:8000 --output base/
    python pipelines/evaluate.py compare --baseline base/ --model /abs/ckpt-nvfp4 --max-kl 0.02
    python pipelines/evaluate.py compare --baseline base/ --url http://host:30000 --api sglang --drift

`baseline`: the reference greedily continues each prompt (the built-in set, or --prompts), then
the top-256 logprobs of the last 128 positions of prompt + continuation are written as
baseline_bs{1,8,32}.npz, one per batch size the scoring requests were sent at. `compare`: the
model under test (a checkpoint run in this process in evaluation mode, or any server: ours,
SGLang's /generate, an OpenAI-compatible /v1/completions) scores the same sequences
teacher-forced at each batch size; KL, cosine, flips and the worst prompts go to stdout and
MLflow (metrics, a per-position KL histogram as PNG, the worst-prompts table). --drift adds
decode drift: the model under test decodes on its own and the reference (--reference-model or
--reference-url) scores its path. Exit status: 0 scored (and the --max-kl gate passed), 3 the
gate failed, 2 bad input or an unusable source. A partial result is never reported as a score.

`score_checkpoint` is the quantize pipeline's gate: a checkpoint directory against its reference,
computed one layer at a time (models larger than memory score too); `score_medusa` the decode
drift of a checkpoint served with its Medusa heads (pipelines/train_medusa.py).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python pipelines/evaluate.py` from a checkout or a Ray working_dir
    sys.path.insert(0, str(ROOT))

from pipelines.cli import HelpFormatter  # noqa: E402
from pipelines.logprob_client import APIS, HTTPSource  # noqa: E402
from sala.eval import logprob as lp  # noqa: E402
from sala.process_exit import exit_now  # noqa: E402


# ------------------------------------------------------------------------------ prompt set
def builtin_rows(limit: int):
    """The built-in evaluation prompts: tiny-sala's held-out documents (prose), held-out chat turns
    (qa), and stdlib function sources and name lists (code, list) the calibration set does not use."""
    from sala.eval.calibration import Row, low_semantic_reason
    from sala.tiny import DOC_MODULES, RECIPE, chat_examples, documents, split_corpus, stdlib_definitions

    every = RECIPE["heldout_every"]
    _, heldout = split_corpus(every)
    rows = [Row(t, "prose") for t in heldout]
    rows += [Row(c, "qa") for i, c in enumerate(chat_examples(documents())) if i % every == 0]
    for name in DOC_MODULES:
        _, defs = stdlib_definitions(name)
        rows += [Row(src, "code") for _, _, src in [d for d in defs if d[2].lstrip().startswith("def ")][6:9]]
        items = [f"- {attr}: {doc.splitlines()[0][:80]}" for attr, doc, _ in defs[12:24] if doc]
        if len(items) >= 3:
            rows.append(Row(f"More names of {name}:\n" + "\n".join(items), "list"))
    for r in rows:
        r.low_semantic = low_semantic_reason(r.text)
    # Interleave task types so any prefix of the set keeps the mix.
    by_task: dict[str, list] = {}
    for r in rows:
        by_task.setdefault(r.task, []).append(r)
    mixed = [r for group in zip(*by_task.values()) for r in group]
    mixed += [r for r in rows if r not in mixed]
    return mixed[:limit]


def prompt_rows(path: str | None, column: str | None, split: str | None, limit: int):
    from sala.eval import calibration as cal

    if not path:
        return builtin_rows(limit)
    records, _ = cal.read_records(path, split)
    return cal.to_rows(records, cal.text_column(records, path, column))[:limit]


def tokenize_prompts(rows, tokenize, prompt_tokens: int) -> list[list[int]]:
    """Each prompt's first `prompt_tokens` tokens (a baseline scores the end, so long texts are cut)."""
    return [ids[:prompt_tokens] for ids in (tokenize(r.text) for r in rows) if len(ids) >= 2]


# ---------------------------------------------------------------------------------- sources
def source_from(args, prefix: str = ""):
    """--model (the engine in this process) or --url (a server); prefix selects --reference-*."""
    model, url = getattr(args, f"{prefix}model"), getattr(args, f"{prefix}url")
    if url:
        return HTTPSource(url, args.api, model=args.served_model, api_key=args.api_key, vocab_size=args.vocab_size,
                          timeout=args.timeout, retries=args.retries)
    from registry.models import model_name, resolve_model_path
    from sala.eval.engine_source import EngineSource

    path = resolve_model_path(model)
    return EngineSource.from_pretrained(path, model_name(model, path))


def http_tokenize(source: HTTPSource):
    return lambda text: source.request("POST", "/tokenize", {"prompt": text})["tokens"]


def score_checkpoint(candidate: str | Path, reference: str | Path, *, num_prompts: int = 64, prompt_tokens: int = 96,
                     top_k: int = lp.TOP_K, positions: int = lp.LAST_POSITIONS, windows=None, device=None,
                     progress=None) -> dict:
    """Score a checkpoint against a reference checkpoint in this process, one layer at a time
    (sala/eval/layerwise.py: never a whole model in memory, never both), on the built-in prompt
    set, each prompt teacher-forced as it is -> the summary dict (kl_mean, kl_p99, flip_rate,
    cosine_mean, ...). Given held-out `windows` [N, T + 1], their perplexities and full-vocabulary
    comparison are added as heldout_ppl_reference, heldout_ppl, heldout_kl_mean and
    heldout_top1_agreement. The quantize pipeline's gate."""
    import torch

    from sala.checkpoint import CheckpointReader, load_tokenizer
    from sala.eval.layerwise import gate_scores

    tok = load_tokenizer(reference)
    prompts = tokenize_prompts(builtin_rows(num_prompts), lambda t: tok(t)["input_ids"], prompt_tokens)
    if windows is None:
        windows = torch.zeros(0, 2, dtype=torch.long)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    summary, quality = gate_scores(CheckpointReader(reference), CheckpointReader(candidate), prompts, windows,
                                   positions=positions, top_k=top_k, device=device, progress=progress)
    return summary | ({f"heldout_{k}": v for k, v in quality.items()} if len(windows) else {})


class LosslessError(RuntimeError):
    """Greedy Medusa decoding left the plain greedy path: tree verify is broken, not the heads."""


DRIFT_PROMPT_TOKENS, DRIFT_NEW_TOKENS = 64, 32  # score_medusa's prompts and continuations


def engine_context(tokens: int) -> int:
    """The max_model_len of an engine whose requests hold at most `tokens` tokens, its cache sized
    for them: whole K/V pages, since its default cache holds max_seqs requests of max_model_len
    tokens and a request takes whole pages (with less, requests would wait for pages, and what
    shares a step would change)."""
    from sala.engine.config import PAGE_SIZE

    return -(-tokens // PAGE_SIZE) * PAGE_SIZE


def drift_engine_settings(prompt_tokens: int = DRIFT_PROMPT_TOKENS, max_new_tokens: int = DRIFT_NEW_TOKENS) -> dict:
    """The settings of score_medusa's engines: a context of a prompt, its continuation and one
    more token."""
    return {"max_model_len": engine_context(prompt_tokens + max_new_tokens + 1)}


def score_medusa(checkpoint: str | Path, *, batch_size: int = 8, num_prompts: int = 16,
                 prompt_tokens: int = DRIFT_PROMPT_TOKENS, max_new_tokens: int = DRIFT_NEW_TOKENS,
                 temperature: float = 0.7, seed: int = 0) -> dict:
    """Decode drift of `checkpoint` served with its Medusa heads, against its own backbone decoding
    plainly in evaluation mode (the baseline, in the checkpoint's dtype: BF16 for a BF16 model).
    Greedy tree verify is lossless, so its path must be the baseline's (LosslessError otherwise,
    except where the baseline had an exact tie); sampled requests use typical acceptance, which
    is not, and are reported beside plain sampling at the same temperature and seed, so what the
    acceptance rule adds to the drift sampling has anyway is visible. -> {medusa_greedy_*,
    medusa_typical_*, plain_sampled_*: drift summaries (identical share, first divergence, KL,
    flips)}. The three engines decode one model, loaded once."""
    from sala.engine import Engine
    from sala.eval.engine_source import EngineSource
    from sala.medusa.heads import load_heads

    settings = drift_engine_settings(prompt_tokens, max_new_tokens)
    ref = EngineSource.from_pretrained(checkpoint, **settings)  # evaluation mode decodes plainly
    model, tok, kv_plan = ref.engine.model, ref.engine.tokenizer, ref.engine.config.kv_plan
    prompts = tokenize_prompts(builtin_rows(num_prompts), lambda t: tok(t)["input_ids"], prompt_tokens)
    base = lp.collect_baseline(ref, prompts, max_new_tokens=max_new_tokens, batch_sizes=(batch_size,))[batch_size]
    heads = load_heads(checkpoint, model.config, ref.engine.config.device)
    # The whole tree at every step, so that every decode step is a verify step the drift can catch.
    medusa = Engine(model, tok, medusa=heads, kv_plan=kv_plan, compile=False, medusa_nodes=heads.tree.num_nodes - 1,
                    **settings)
    plain = Engine(model, tok, kv_plan=kv_plan, compile=False, **settings)
    out = {}
    for label, engine, temp in (("medusa_greedy", medusa, 0.0), ("medusa_typical", medusa, temperature),
                                ("plain_sampled", plain, temperature)):
        drift = lp.decode_drift(base, EngineSource(engine, label, temp, seed), ref, batch_size)
        out |= {f"{label}_{k}": v for k, v in drift.summary().items()}
        if label == "medusa_greedy":
            untied = lp.untied_departures(base, drift)
            out["medusa_greedy_untied_departures"] = len(untied)
            if untied:
                i = untied[0]
                raise LosslessError(f"greedy Medusa decoding left the plain greedy path in {len(untied)} of "
                                    f"{len(prompts)} prompts without a tie (prompt {i} at decode step "
                                    f"{drift.first_divergence[i]}): tree verify is not lossless")
    return out


# -------------------------------------------------------------------------------- commands
def cmd_baseline(args) -> int:
    from sala.eval.calibration import analyse

    source = source_from(args)
    if args.url:
        tokenize = http_tokenize(source)
    else:
        tok = source.engine.tokenizer
        tokenize = lambda t: tok(t)["input_ids"]  # noqa: E731
    rows = prompt_rows(args.prompts, args.text_column, args.split, args.num_prompts)
    composition = analyse(rows)
    print(f"prompt set: {args.prompts or 'built-in'}\n{composition.table()}")
    prompts = tokenize_prompts(rows, tokenize, args.prompt_tokens)
    if not prompts:
        raise lp.SourceError("no prompt has 2 tokens or more")
    out = Path(args.output)
    settings = {"prompts": args.prompts or "built-in", "prompt_tokens": args.prompt_tokens,
                "source": args.url or str(args.model or "tiny-sala"), "composition": composition.to_dict(),
                "composition_table": composition.table()}
    t0 = time.time()
    baselines = lp.collect_baseline(source, prompts, max_new_tokens=args.max_new_tokens, batch_sizes=args.batch_sizes,
                                    top_k=args.top_k, positions=args.positions, settings=settings, progress=_progress)
    for b, base in baselines.items():
        path = base.save(lp.baseline_path(out, b))
        print(f"\nwrote {path}  ({len(base.sequences)} sequences, {len(base.top_ids)} positions x top-{args.top_k})")
    print(json.dumps({"baseline": str(out), "sequences": len(prompts), "seconds": round(time.time() - t0, 2)}))
    return 0


def cmd_compare(args) -> int:
    baselines = lp.load_baselines(args.baseline)
    sizes = args.batch_sizes or sorted(baselines)
    missing = [b for b in sizes if b not in baselines]
    if missing:
        raise lp.BaselineError(f"{args.baseline} has no baseline for batch size {missing[0]} (it has {sorted(baselines)})")
    first = baselines[sizes[0]]
    print(f"baseline: {first.meta['model']}, {len(first.sequences)} sequences, top-{first.top_ids.shape[1]}")
    if first.meta.get("settings", {}).get("composition_table"):
        print(f"prompt set composition:\n{first.meta['settings']['composition_table']}")
    test = source_from(args)
    reports, t0 = {}, time.time()
    for b in sizes:
        reports[b] = lp.compare(baselines[b], test, b, progress=_progress)
        print()
    drift = lp.decode_drift(baselines[sizes[0]], test, source_from(args, "reference_"), sizes[0]) if args.drift else None
    seconds = time.time() - t0
    worst = reports[sizes[0]].worst(args.worst)
    print_report(reports, drift, worst, args.max_kl)
    gate = None if args.max_kl is None else all(r.summary()["kl_mean"] <= args.max_kl for r in reports.values())
    if not args.no_mlflow:
        log_mlflow(args, reports, drift, worst, gate, seconds)
    line = {"model": reports[sizes[0]].meta["model"], "seconds": round(seconds, 2), "gate_passed": gate}
    line |= {f"{k}/bs{b}": round(v, 8) for b, r in reports.items() for k, v in r.summary().items()}
    if drift:
        line |= {k: round(v, 6) for k, v in drift.summary().items()}
    print(json.dumps(line))
    return 3 if gate is False else 0


def print_report(reports: dict, drift, worst: list[dict], max_kl: float | None) -> None:
    print(f"{'batch':>6}{'mean KL':>12}{'KL p99':>11}{'KL max':>11}{'lower bd':>11}{'cosine':>10}{'flips':>8}{'covered':>9}")
    for b, r in reports.items():
        s = r.summary()
        print(f"{b:>6}{s['kl_mean']:>12.3e}{s['kl_p99']:>11.3e}{s['kl_max']:>11.3e}{s['kl_lower_mean']:>11.3e}"
              f"{s['cosine_mean']:>10.6f}{s['flip_rate']:>8.2%}{s['covered_mass_mean']:>9.4f}")
    print("worst prompts (mean KL):  " + "  ".join(f"#{w['sequence']} {w['kl_mean']:.2e} ({w['flips']} flips)" for w in worst[:5]))
    if drift:
        s = drift.summary()
        print(f"decode drift: {s['drift_identical_share']:.1%} of continuations identical, first divergence at step "
              f"{s['drift_first_divergence_mean']:.1f} on average, reference KL along the test path {s['drift_kl_mean']:.3e}")
    if max_kl is not None:
        passed = all(r.summary()["kl_mean"] <= max_kl for r in reports.values())
        print(f"gate (mean KL <= {max_kl:g} at every batch size) {'passed' if passed else 'FAILED'}")


def kl_figure(reports: dict, drift):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3 if drift else 2, figsize=(13 if drift else 9, 3.5))
    for b, r in reports.items():
        kl = r.divergence.kl
        bins = np.logspace(np.log10(max(kl[kl > 0].min(), 1e-12)) if (kl > 0).any() else -12, np.log10(max(kl.max(), 1e-11)), 40)
        axes[0].hist(np.maximum(kl, bins[0]), bins=bins, histtype="step", label=f"batch {b}")
        axes[1].plot(r.kl_by_position()[::-1], label=f"batch {b}")
    axes[0].set(xscale="log", xlabel="KL(baseline || test) per position", ylabel="positions", title="per-position KL")
    axes[1].set(xlabel="scored position (last = end of sequence)", ylabel="mean KL", title="KL by position")
    axes[0].legend(fontsize=7)
    if drift:
        axes[2].plot(drift.kl_by_step)
        axes[2].set(xlabel="decode step", ylabel="mean KL(reference || test)", title="decode drift")
    fig.tight_layout()
    return fig


def log_mlflow(args, reports: dict, drift, worst: list[dict], gate: bool | None, seconds: float) -> None:
    import mlflow

    from registry.tracking import setup_mlflow

    setup_mlflow(args.experiment)
    with mlflow.start_run(run_name=f"evaluate-{reports[next(iter(reports))].meta['model']}"):
        mlflow.log_params({k: v for k, v in vars(args).items() if v is not None and k not in ("func", "api_key")})
        for b, r in reports.items():
            mlflow.log_metrics({f"{k}/bs{b}": float(v) for k, v in r.summary().items()})
        mlflow.log_metrics({"kl_mean": max(r.summary()["kl_mean"] for r in reports.values()), "score_seconds": seconds}
                           | ({} if gate is None else {"gate_passed": float(gate)}) | (drift.summary() if drift else {}))
        mlflow.log_figure(kl_figure(reports, drift), "kl_per_position.png")
        mlflow.log_table({k: [w[k] for w in worst] for k in worst[0]}, artifact_file="worst_prompts.json")
        settings = reports[next(iter(reports))].meta
        mlflow.log_dict(settings, "compare_meta.json")


def _progress(stage_or_done, done_or_total, total=None) -> None:
    stage, done, total = ("score", stage_or_done, done_or_total) if total is None else (stage_or_done, done_or_total, total)
    print(f"\r{stage}: {done}/{total}", end="" if done < total else "\n", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pipelines/evaluate.py", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    def source_args(p, prefix="", what="model"):
        p.add_argument(f"--{prefix}model", help=f"{what}: checkpoint directory or models:/name@alias, run in this process "
                                                 "in evaluation mode (default: tiny-sala)")
        p.add_argument(f"--{prefix}url", help=f"{what}: a server's base URL instead, e.g. http://127.0.0.1:8000")

    def common(p):
        p.add_argument("--api", choices=APIS, default="sglang",
                       help="how to talk to --url: sglang (/generate; also ours) or openai (/v1/completions echo + logprobs)")
        p.add_argument("--served-model", help="model name to send to the server (default: its first)")
        p.add_argument("--api-key", help="bearer token for the server")
        p.add_argument("--vocab-size", type=int, help="the model's vocabulary size, for servers whose /v1/models omits it")
        p.add_argument("--timeout", type=float, default=120.0, help="seconds per HTTP request")
        p.add_argument("--retries", type=int, default=3, help="retries of a request that failed to connect, timed out or got a 5xx")
        p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")],
                       help="batch sizes, comma-separated (baseline default: 1,8,32; compare default: every baseline)")

    b = sub.add_parser("baseline", help="collect a reference's top-k logprobs", formatter_class=HelpFormatter)
    source_args(b, what="reference")
    common(b)
    b.add_argument("--prompts", help="jsonl / parquet / datasets directory of prompts (default: the built-in set)")
    b.add_argument("--text-column", help="column holding the text (default: text, prompt, messages or content)")
    b.add_argument("--split", help="split of a DatasetDict given to --prompts")
    b.add_argument("--num-prompts", type=int, default=64, help="prompts to use")
    b.add_argument("--prompt-tokens", type=int, default=192, help="each prompt is cut to its first N tokens")
    b.add_argument("--max-new-tokens", type=int, default=64, help="greedy continuation length")
    b.add_argument("--top-k", type=int, default=lp.TOP_K, help="logprobs kept per position")
    b.add_argument("--positions", type=int, default=lp.LAST_POSITIONS, help="last positions scored per sequence")
    b.add_argument("--output", default="logprob-baseline", help="directory for baseline_bs<batch>.npz")
    b.set_defaults(func=cmd_baseline)

    c = sub.add_parser("compare", help="score a model or server against a baseline", formatter_class=HelpFormatter)
    c.add_argument("--baseline", required=True, help="directory written by `baseline`")
    source_args(c, what="model under test")
    common(c)
    c.add_argument("--drift", action="store_true", help="also measure decode drift (needs the reference)")
    source_args(c, "reference-", what="reference for --drift")
    c.add_argument("--max-kl", type=float, help="gate: exit 3 unless mean KL <= this at every batch size")
    c.add_argument("--worst", type=int, default=10, help="worst prompts to report")
    c.add_argument("--experiment", default="sala-evaluate", help="MLflow experiment")
    c.add_argument("--no-mlflow", action="store_true", help="print only")
    c.set_defaults(func=cmd_compare)
    args = ap.parse_args(argv)
    if args.model and args.url:
        ap.error("give --model or --url, not both")
    if args.command == "compare" and args.drift and not (args.reference_model or args.reference_url):
        ap.error("--drift needs the reference: --reference-model or --reference-url")
    for name in ("num_prompts", "prompt_tokens", "max_new_tokens", "top_k", "positions"):
        if getattr(args, name, 1) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.batch_sizes is not None and any(x <= 0 for x in args.batch_sizes):
        ap.error("--batch-sizes must be positive")
    if args.command == "baseline" and args.batch_sizes is None:
        args.batch_sizes = list(lp.BATCH_SIZES)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return args.func(args)
    except (lp.BaselineError, lp.SourceError) as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # model specs, datasets, tracking: each raises with a message naming the problem
        from registry.models import ModelSpecError
        from registry.tracking import TrackingError
        from sala.checkpoint import CheckpointError
        from sala.eval.calibration import DatasetError

        if isinstance(e, (ModelSpecError, CheckpointError, DatasetError, TrackingError)):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    exit_now(main())
