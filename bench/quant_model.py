"""Whole-model quality of four NVFP4 variants of tiny-sala: held-out perplexity and mean
KL(BF16 || NVFP4) per token, against the BF16 model.

    python bench/quant_model.py [--num-samples 128] [--seq-len 256] [--eval-sequences 64]

Each variant (RTN / GPTQ, plain NVFP4 "M6" / FourOverSix "4/6") is quantized layer by layer
as `python -m sala.quant` does, exported as a compressed-tensors checkpoint and loaded back,
so what is measured is what ships ("wall s" includes the calibration forwards). The
reference is tiny-sala with its weights rounded to BF16, which is how the checkpoint stores
everything it does not quantize: the differences are NVFP4's alone.
"""
import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from sala.checkpoint import load_model
from sala.eval.calibration import calibration_sequences
from sala.eval.compare import compare_models, window_sequences
from sala.quant.export import export_checkpoint
from sala.quant.layerwise import quantize_model
from sala.tiny import ensure_tiny_sala, split_corpus, token_stream

VARIANTS = {"RTN-M6": ("rtn", "6"), "RTN-4/6": ("rtn", "4over6"), "GPTQ-M6": ("gptq", "6"), "GPTQ-4/6": ("gptq", "4over6")}
BASE = "RTN-M6"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-samples", type=int, default=128, help="calibration rows (the CLI's default)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-sequences", type=int, default=64, help="held-out windows (tiny-sala has ~56 of 256)")
    args = ap.parse_args()

    model_dir = ensure_tiny_sala()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    seqs = calibration_sequences(tokenizer, args.num_samples, args.seq_len)
    _, heldout = split_corpus(10)
    windows = window_sequences(token_stream(tokenizer, heldout), args.seq_len, args.eval_sequences)
    model = load_model(model_dir, dtype=torch.float32)
    reference = copy.deepcopy(model).to(torch.bfloat16).float()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant, (method, rule) in VARIANTS.items():
            t0 = time.perf_counter()
            quantized, stats = quantize_model(copy.deepcopy(model), seqs, method, rule)
            seconds = time.perf_counter() - t0
            path = export_checkpoint(model, quantized, Path(tmp) / variant.replace("/", "over"), scale_rule=rule,
                                     method=method)
            q = compare_models(reference, load_model(path, dtype=torch.float32), windows)
            rows.append({"variant": variant, "ppl": q["ppl"], "ppl_bf16": q["ppl_reference"], "kl_mean": q["kl_mean"],
                         "top1_agreement": q["top1_agreement"], "m4_share": sum(s.m4_share for s in stats) / len(stats),
                         "quantize_seconds": seconds})

    base = next(r for r in rows if r["variant"] == BASE)
    ppl_bf16 = base["ppl_bf16"]
    print(f"tiny-sala NVFP4 variants vs BF16: {len(windows)} held-out windows x {args.seq_len} tokens = "
          f"{windows[:, 1:].numel()} tokens; calibration {len(seqs)} x {args.seq_len} tokens")
    print(f"{'variant':<10}{'ppl':>9}{'ppl / BF16':>12}{'mean KL':>10}{'KL x ' + BASE:>13}{'top-1 agree':>13}"
          f"{'M=4 share':>11}{'wall s':>9}")
    print(f"{'BF16':<10}{ppl_bf16:>9.3f}{1:>12.4f}")
    for r in rows:
        r["ppl_ratio"] = r["ppl"] / ppl_bf16
        r["kl_ratio"] = r["kl_mean"] / base["kl_mean"]
        print(f"{r['variant']:<10}{r['ppl']:>9.3f}{r['ppl_ratio']:>12.4f}{r['kl_mean']:>10.5f}{r['kl_ratio']:>13.3f}"
              f"{r['top1_agreement']:>13.2%}{r['m4_share']:>11.1%}{r['quantize_seconds']:>9.1f}")
    print(json.dumps({
        "bench": "quant_model", "model": model_dir.name, "eval_tokens": int(windows[:, 1:].numel()),
        "calibration_sequences": len(seqs), "seq_len": args.seq_len, "ppl_bf16": round(ppl_bf16, 4), "base": BASE,
        "rows": [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items() if k != "ppl_bf16"} for r in rows],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
