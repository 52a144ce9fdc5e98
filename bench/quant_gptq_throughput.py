"""GPTQ throughput on one 4096x4096 Linear with 256 calibration sequences, against plain RTN.

    python bench/quant_gptq_throughput.py [--dim 4096] [--sequences 256] [--seq-len 128]

The inputs are synthetic but correlated (a low-rank mix plus noise, unequal feature scales),
which is what gives GPTQ something to win; the weight is Gaussian. Hessian accumulation is
timed on its own: in the pipeline it overlaps the forward passes that produce the inputs.
"""
import argparse
import json
import time

import torch

from sala.quant.gptq import HessianAccumulator, gptq_quantize, relative_output_error, relative_weight_error
from sala.quant.nvfp4 import quantize_rtn


def calibration_batches(args, g):
    """Yield [batch, seq_len, dim] activations, a few sequences at a time to bound memory."""
    rank = 256
    mix = torch.randn(rank, args.dim, generator=g) / rank**0.5
    scales = torch.logspace(-1, 0.5, args.dim)[torch.randperm(args.dim, generator=g)]
    for start in range(0, args.sequences, args.batch):
        b = min(args.batch, args.sequences - start)
        z = torch.randn(b, args.seq_len, rank, generator=g)
        yield (z @ mix + 0.2 * torch.randn(b, args.seq_len, args.dim, generator=g)) * scales


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=4096, help="in = out features")
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="sequences per Hessian update")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(args.dim, args.dim, generator=g) * 0.02

    acc = HessianAccumulator(args.dim)
    t_hessian = 0.0
    for x in calibration_batches(args, g):
        t0 = time.perf_counter()
        acc.add(x)
        t_hessian += time.perf_counter() - t0
    h = acc.hessian("bench")

    rows = []
    for rule in ["6", "4over6"]:
        t0 = time.perf_counter()
        rtn = quantize_rtn(w, rule)
        t_rtn = time.perf_counter() - t0
        deq = rtn.dequantize()
        rows.append(dict(method=f"RTN-{rule}", seconds=t_rtn, rtn_seconds=t_rtn,
                         weight_error=relative_weight_error(w, deq),
                         output_error=relative_output_error(w, deq, h)))  # fmt: skip
        for act_order in [False, True]:
            q, stats = gptq_quantize(w, h, scale_rule=rule, act_order=act_order, name="bench")
            rows.append(dict(method=f"GPTQ-{rule}" + ("-actorder" if act_order else ""),
                             seconds=stats.seconds, rtn_seconds=t_rtn,
                             weight_error=stats.weight_error, output_error=stats.output_error))  # fmt: skip

    tokens = acc.tokens
    print(
        f"GPTQ on NVFP4, {args.dim}x{args.dim} weight, {args.sequences} sequences x {args.seq_len} "
        f"tokens = {tokens} tokens, {torch.get_num_threads()} CPU threads"
    )
    print(f"Hessian accumulation: {t_hessian:.2f} s ({tokens / t_hessian:,.0f} tokens/s)")
    print(f"{'method':<20}{'seconds':>9}{'x RTN':>8}{'weight err':>12}{'output err':>12}{'out err x RTN':>15}")
    rtn_err = {r["method"].split("-")[1]: r["output_error"] for r in rows if r["method"].startswith("RTN")}
    for r in rows:
        rule = r["method"].split("-")[1]
        r["ratio_to_rtn"] = r["seconds"] / r["rtn_seconds"]
        r["output_error_ratio_to_rtn"] = r["output_error"] / rtn_err[rule]
        print(
            f"{r['method']:<20}{r['seconds']:>9.2f}{r['ratio_to_rtn']:>8.0f}{r['weight_error']:>12.5f}"
            f"{r['output_error']:>12.5f}{r['output_error_ratio_to_rtn']:>15.3f}"
        )
    print(json.dumps({
        "bench": "quant_gptq_throughput", "dim": args.dim, "sequences": args.sequences,
        "seq_len": args.seq_len, "tokens": tokens, "threads": torch.get_num_threads(),
        "hessian_seconds": round(t_hessian, 3),
        "rows": [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
