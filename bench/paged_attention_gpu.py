"""Paged decode attention: the Triton flash-decoding kernel against the torch reference on CUDA.

    python bench/paged_attention_gpu.py [--reps 30] [--peak-gbps 4800]

Shapes of the 9B model's sparse layers: Hq = 32, Hkv = 2, D = 128, BF16 K/V in pages of 64
tokens, batch 1 / 8 / 32, every sequence at 1K / 4K / 16K tokens, page ids shuffled across the
pool. Reported: time per call of the reference, of the kernel with one split per sequence
(one program per sequence and kv head) and with its default split length, the reference /
kernel ratio, and the fraction of HBM peak the kernel reaches reading K/V (the bytes a decode
step must read: B * context * Hkv * D * 2 bytes, for K and for V).

Timing as bench/nvfp4_gemm_gpu.py does it: calls replayed from one CUDA graph (no Python or
launch overhead), each call reading different pages of a pool that covers 4x the L2 cache,
so K/V come from HBM as they do layer after layer. Before timing, the kernel is checked
against the reference.
"""
import argparse
import json
import math
import sys

import torch
from nvfp4_gemm_gpu import graph_time_us, peak_bandwidth_gbps, require_gpu  # bench/ is this script's sys.path[0]

BATCHES = [1, 8, 32]
CONTEXTS = [1024, 4096, 16384]
HQ, HKV, D, PAGE = 32, 2, 128, 64


def rotating_block_tables(batch: int, context: int, page: int, kv_bytes: int):
    """Block tables for `batch` sequences of `context` tokens in as many disjoint copies as make
    their K/V (kv_bytes a copy, in bf16) four times the L2, so that replaying the copies in turn
    no call finds its pages left in L2 by the one before. -> (pool pages, tables, lengths)."""
    pages = context // page
    copies = max(1, math.ceil(4 * torch.cuda.get_device_properties(0).L2_cache_size / kv_bytes))
    pool = copies * batch * pages
    perm = torch.randperm(pool, device="cuda").int()
    tables = [perm[i * batch * pages : (i + 1) * batch * pages].view(batch, pages) for i in range(copies)]
    return pool, tables, torch.full((batch,), context, device="cuda", dtype=torch.int32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30, help="graph replays per measurement (median taken)")
    ap.add_argument("--peak-gbps", type=float, help="HBM peak in GB/s (default: from the device properties)")
    args = ap.parse_args()
    require_gpu(__file__, "the kernel's CPU checks are in tests/kernels/test_paged_attention.py")

    from kernels.paged_attention import SPLIT_LEN, paged_decode_attention_reference, paged_decode_attention_triton

    torch.manual_seed(0)
    peak = args.peak_gbps or peak_bandwidth_gbps()
    name = torch.cuda.get_device_name(0)
    scale = D**-0.5
    print(f"{name}: HBM peak {peak:,.0f} GB/s; Hq={HQ} Hkv={HKV} D={D} page {PAGE}, bf16; "
          f"default split {SPLIT_LEN} tokens; torch {torch.__version__}")
    print(f"{'B':>4}{'context':>9}{'ref us':>10}{'1 split us':>12}{'kernel us':>11}{'ref/kernel':>12}"
          f"{'GB/s':>9}{'% peak':>8}{'1-split % peak':>16}{'max err':>10}")
    rows = []
    for b in BATCHES:
        for ctx in CONTEXTS:
            kv_bytes = 2 * b * ctx * HKV * D * 2
            pool, tables, lens = rotating_block_tables(b, ctx, PAGE, kv_bytes)
            k_cache = torch.randn(pool, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
            v_cache = torch.randn_like(k_cache)
            q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
            ref = paged_decode_attention_reference(q, k_cache, v_cache, tables[0], lens, scale)
            out = paged_decode_attention_triton(q, k_cache, v_cache, tables[0], lens, scale)
            err = (out.float() - ref.float()).abs().max().item()
            if err > 2**-6 * v_cache.abs().max().item():
                sys.exit(f"kernel disagrees with the reference at B={b}, context {ctx}: max error {err:.3g}")
            t_ref = graph_time_us([lambda t=t: paged_decode_attention_reference(q, k_cache, v_cache, t, lens, scale)
                                   for t in tables], args.reps)
            t_one = graph_time_us([lambda t=t: paged_decode_attention_triton(q, k_cache, v_cache, t, lens, scale,
                                                                             split_len=ctx) for t in tables], args.reps)
            t_k = graph_time_us([lambda t=t: paged_decode_attention_triton(q, k_cache, v_cache, t, lens, scale)
                                 for t in tables], args.reps)
            gbps = kv_bytes / (t_k * 1e-6) / 1e9
            gbps_one = kv_bytes / (t_one * 1e-6) / 1e9
            row = {"batch": b, "context": ctx, "reference_us": t_ref, "one_split_us": t_one, "kernel_us": t_k,
                   "speedup": t_ref / t_k, "kernel_gbps": gbps, "kernel_peak_fraction": gbps / peak,
                   "one_split_peak_fraction": gbps_one / peak, "max_err": err}
            rows.append(row)
            print(f"{b:>4}{ctx:>9}{t_ref:>10.1f}{t_one:>12.1f}{t_k:>11.1f}{row['speedup']:>12.1f}{gbps:>9,.0f}"
                  f"{row['kernel_peak_fraction']:>8.0%}{row['one_split_peak_fraction']:>16.0%}{err:>10.1e}")
    print(json.dumps({
        "bench": "paged_attention_gpu", "device": name, "peak_gbps": round(peak, 1), "split_len": SPLIT_LEN,
        "shape": {"hq": HQ, "hkv": HKV, "d": D, "page_size": PAGE, "dtype": "bfloat16"},
        "rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
