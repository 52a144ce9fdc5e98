"""Logprob evaluation: how fast it scores, and whether its cheap KL ranks models as perplexity does.

    python bench/logprob_eval.py [--prompts 1000] [--positions 128] [--top-k 256] [--num-samples 64]

1. Scoring speed on CPU: `divergence` over prompts x positions x top-k synthetic baseline/test
   pairs (the vocabulary of the 9B model, 73,448), next to the reference, the full-vocabulary
   KL in numpy over the same positions (timed on a slice and scaled: the whole would need
   ~75 GB of float64).
2. Ranking: tiny-sala's NVFP4 variants (RTN / GPTQ x M6 / FourOverSix), quantized as
   `python -m sala.quant` does and loaded back, scored with the logprob tool against a BF16
   baseline (engine, evaluation mode, built-in prompt set) and by held-out perplexity; the
   Spearman rank correlation of the two orderings; and a deliberately broken checkpoint. The
   quantize pipeline's gate (pipelines/evaluate.py's score_checkpoint: the same prompts, each
   teacher-forced as it is, one layer at a time) scores each variant too: the figures its
   thresholds come from. Beside them the cache
   plans on the BF16 weights (all-FP8, all-NVFP4, all-NVFP4-4/6, and the mixed plan of the
   published recipe: the first and last sparse layers FP8, the others NVFP4-4/6; K/V scales
   calibrated on the calibration rows): the engine serving the plan scored the same way, and
   the held-out perplexity of the model's forward over K/V stored as the plan stores them,
   ranked in the same correlation.
"""
import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sala.eval import logprob as lp  # noqa: E402

VOCAB_9B = 73448
VARIANTS = {"RTN-M6": ("rtn", "6"), "RTN-4/6": ("rtn", "4over6"), "GPTQ-M6": ("gptq", "6"), "GPTQ-4/6": ("gptq", "4over6"),
            "broken": ("gptq", "4over6")}
# "broken": GPTQ-4/6 of weights with Gaussian noise of BROKEN_NOISE x each decoder Linear's weight
# RMS added first: a checkpoint as a quantizer bug would leave it (a wrong Hessian, a scale off),
# which the registry gate (pipelines/quantize.py) must refuse.
BROKEN_NOISE = 0.25
# Cache plans, all with fp32 lightning states: (the sparse layers' format, formats of the first and last).
PLANS = {"KV-FP8": ("fp8", None), "KV-NVFP4": ("nvfp4", None), "KV-NVFP4-4/6": ("nvfp4_4over6", None),
         "KV-mixed": ("nvfp4_4over6", "fp8")}


def cache_plan(config, amax, kv: str, ends: str | None):
    from sala.kv import KVPlan

    plan = KVPlan.uniform(config, kv, "fp32", amax)
    first, last = config.sparse_layers[0], config.sparse_layers[-1]
    return plan.with_units(kv={first: ends, last: ends}) if ends else plan


def synthetic_pairs(rng, rows: int, k: int, vocab: int):
    """Top-k of LM-like rows (Zipf ranks over a random permutation) and of a noisy copy."""
    ids = np.stack([rng.choice(vocab, 2 * k, replace=False) for _ in range(min(rows, 256))])
    ids = ids[rng.integers(0, len(ids), rows)]
    base = -1.3 * np.log(np.arange(1, 2 * k + 1))[None, :] + 0.1 * rng.standard_normal((rows, 2 * k))
    noisy = base + 0.05 * rng.standard_normal(base.shape)

    def top(x):
        x = x - np.log(np.exp(x).sum(1, keepdims=True)) - 0.01
        order = np.argsort(-x, axis=1)[:, :k]
        return np.take_along_axis(ids, order, 1).astype(np.int32), np.take_along_axis(x, order, 1).astype(np.float32)

    return top(base), top(noisy)


def add_noise(model, scale: float) -> None:
    """Each decoder Linear's weight plus Gaussian noise of `scale` x its RMS (seeded)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, m in model.model.layers.named_modules():
            if isinstance(m, torch.nn.Linear):
                w = m.weight
                w += scale * w.pow(2).mean().sqrt() * torch.randn(w.shape, generator=gen, dtype=w.dtype)


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def bench_speed(args) -> dict:
    rng = np.random.default_rng(0)
    rows = args.prompts * args.positions
    (p_ids, p_lp), (q_ids, q_lp) = synthetic_pairs(rng, rows, args.top_k, VOCAB_9B)
    t0 = time.perf_counter()
    d = lp.divergence(p_ids, p_lp, q_ids, q_lp, VOCAB_9B)
    ours = time.perf_counter() - t0
    slice_rows = 256
    full_p = rng.standard_normal((slice_rows, VOCAB_9B)).astype(np.float32)
    full_q = full_p + 0.05 * rng.standard_normal(full_p.shape).astype(np.float32)
    full_p -= np.log(np.exp(full_p).sum(1, keepdims=True))
    full_q -= np.log(np.exp(full_q).sum(1, keepdims=True))
    t0 = time.perf_counter()
    lp.full_divergence(full_p, full_q)
    full = (time.perf_counter() - t0) * rows / slice_rows
    print(f"scoring {args.prompts} prompts x {args.positions} positions x top-{args.top_k} on CPU: {ours:.2f} s "
          f"(mean KL {d.kl.mean():.2e}); full-vocabulary KL (V={VOCAB_9B}) over the same positions: {full:.1f} s; "
          f"ratio {full / ours:.1f}x")
    return {"score_seconds": round(ours, 3), "full_vocab_seconds": round(full, 2), "speedup": round(full / ours, 2),
            "positions": rows}


def bench_ranking(args) -> dict:
    import torch
    from transformers import AutoTokenizer

    from pipelines.evaluate import builtin_rows, score_checkpoint, tokenize_prompts
    from sala.checkpoint import load_model
    from sala.eval.calibration import calibration_sequences
    from sala.eval.compare import compare_models, window_sequences
    from sala.eval.engine_source import EngineSource
    from sala.kv import apply_to_model
    from sala.kv.measure import calibrate_amax
    from sala.quant.export import export_checkpoint
    from sala.quant.layerwise import quantize_model
    from sala.tiny import ensure_tiny_sala, split_corpus, token_stream

    torch.set_num_threads(1)
    model_dir = ensure_tiny_sala(progress=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    seqs = calibration_sequences(tokenizer, args.num_samples, 128)
    _, heldout = split_corpus(10)
    windows = window_sequences(token_stream(tokenizer, heldout), 128, 32)
    model = load_model(model_dir, dtype=torch.float32)
    reference = copy.deepcopy(model).to(torch.bfloat16).float()
    ref = EngineSource.from_pretrained(model_dir, dtype=torch.bfloat16)  # the BF16 baseline, as served
    prompts = tokenize_prompts(builtin_rows(64), lambda t: tokenizer(t)["input_ids"], 96)
    t0 = time.perf_counter()
    base = lp.collect_baseline(ref, prompts, max_new_tokens=32, batch_sizes=(8,))[8]
    baseline_s = time.perf_counter() - t0
    rows = []

    def add_row(variant, test, candidate, path=None):
        t0 = time.perf_counter()
        s = lp.compare(base, test, 8).summary()
        score_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        q = compare_models(reference, candidate, windows)
        ppl_s = time.perf_counter() - t0
        gate = score_checkpoint(path, model_dir, num_prompts=64) if path is not None else {}
        rows.append({"variant": variant, "logprob_kl": s["kl_mean"], "kl_p99": s["kl_p99"], "flip_rate": s["flip_rate"],
                     "cosine": s["cosine_mean"], "ppl": q["ppl"],
                     "ppl_bf16": q["ppl_reference"], "full_kl": q["kl_mean"], "score_s": score_s, "ppl_s": ppl_s,
                     "gate_kl": gate.get("kl_mean"), "gate_flip_rate": gate.get("flip_rate"),
                     "gate_cosine": gate.get("cosine_mean")})
        print(f"  {variant}: logprob KL {s['kl_mean']:.5f}, ppl {q['ppl']:.3f}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        for variant, (method, rule) in VARIANTS.items():
            source = copy.deepcopy(model)
            if variant == "broken":
                add_noise(source, BROKEN_NOISE)
            quantized, _ = quantize_model(source, seqs, method, rule)
            path = export_checkpoint(model, quantized, Path(tmp) / variant.replace("/", "over"), tokenizer, scale_rule=rule,
                                     method=method)
            add_row(variant, EngineSource.from_pretrained(path), load_model(path, dtype=torch.float32), path)
    amax = calibrate_amax(reference, seqs[:8])
    for variant, (kv, ends) in PLANS.items():
        plan = cache_plan(model.config, amax, kv, ends)
        candidate = copy.deepcopy(reference)
        apply_to_model(candidate, plan)  # its forward attends over K/V as the plan's pages store them
        add_row(variant, EngineSource.from_pretrained(model_dir, dtype=torch.bfloat16, kv_plan=plan), candidate)
    print(f"\nBF16 baseline: {len(base.sequences)} prompts, {len(base.top_ids)} positions x top-{base.top_ids.shape[1]} "
          f"({baseline_s:.1f} s); perplexity on {windows[:, 1:].numel()} held-out tokens (BF16 {rows[0]['ppl_bf16']:.3f})")
    print(f"{'variant':<14}{'logprob KL':>12}{'KL p99':>10}{'flips':>8}{'cosine':>10}{'ppl':>10}{'held-out KL':>13}"
          f"{'score s':>9}{'ppl s':>8}{'gate KL':>10}{'flips':>8}{'cosine':>9}")
    for r in rows:
        gate = (f"{r['gate_kl']:>10.5f}{r['gate_flip_rate']:>8.2%}{r['gate_cosine']:>9.4f}" if r["gate_kl"] is not None
                else f"{'-':>10}{'-':>8}{'-':>9}")
        print(f"{r['variant']:<14}{r['logprob_kl']:>12.5f}{r['kl_p99']:>10.4f}{r['flip_rate']:>8.2%}{r['cosine']:>10.5f}"
              f"{r['ppl']:>10.3f}{r['full_kl']:>13.5f}{r['score_s']:>9.2f}{r['ppl_s']:>8.2f}{gate}")
    rho_ppl = spearman([r["logprob_kl"] for r in rows], [r["ppl"] for r in rows])
    rho_kl = spearman([r["logprob_kl"] for r in rows], [r["full_kl"] for r in rows])
    plans = [r for r in rows if r["variant"] in PLANS]
    rho_plans = spearman([r["logprob_kl"] for r in plans], [r["ppl"] for r in plans])
    print(f"Spearman rank correlation over all {len(rows)} rows, logprob KL vs held-out perplexity: {rho_ppl:.2f}; vs "
          f"held-out full-vocabulary KL: {rho_kl:.2f}; over the {len(plans)} cache plans alone vs perplexity: {rho_plans:.2f}")
    return {"rows": [{k: round(v, 6) if isinstance(v, float) else v for k, v in r.items()} for r in rows],
            "spearman_kl_vs_ppl": round(rho_ppl, 3), "spearman_kl_vs_heldout_kl": round(rho_kl, 3),
            "spearman_plans_kl_vs_ppl": round(rho_plans, 3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--positions", type=int, default=lp.LAST_POSITIONS)
    ap.add_argument("--top-k", type=int, default=lp.TOP_K)
    ap.add_argument("--num-samples", type=int, default=64, help="calibration rows per variant")
    ap.add_argument("--skip-ranking", action="store_true", help="only the scoring speed")
    args = ap.parse_args()
    out = {"bench": "logprob_eval", **bench_speed(args)}
    if not args.skip_ranking:
        out |= bench_ranking(args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
