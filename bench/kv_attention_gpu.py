"""Paged decode attention over bf16, FP8 and NVFP4 pages on CUDA: the Triton kernel's time and
fraction of HBM bandwidth per format, against bf16 pages in the same run.

    python bench/kv_attention_gpu.py [--reps 30] [--peak-gbps 4800]

Shapes of the 9B model's sparse layers (Hq = 32, Hkv = 2, D = 128, pages of 64 tokens),
batch 1 / 8 / 32 at 4K and 16K tokens; the pages are written through the engine's own path
(sala/kv KVPages: the Triton quantize-on-write kernels), page ids shuffled across a pool that
covers 4x the L2 cache, timed by replaying a CUDA graph (bench/nvfp4_gemm_gpu.py). Bytes a call
must read: every K/V byte of the context, scales included (fp8 with calibrated per-head
scales: 1 byte an element; nvfp4: 0.5625). Before timing, each format's kernel output is
checked against the torch path over the same pages (dequantize, then attend).
"""
import argparse
import json
import sys

import torch
from nvfp4_gemm_gpu import graph_time_us, peak_bandwidth_gbps, require_gpu  # bench/ is this script's sys.path[0]
from paged_attention_gpu import rotating_block_tables

BATCHES = [1, 8, 32]
CONTEXTS = [4096, 16384]
FORMATS = ["bf16", "fp8", "nvfp4", "nvfp4_4over6"]
HQ, HKV, D, PAGE = 32, 2, 128, 64


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30, help="graph replays per measurement (median taken)")
    ap.add_argument("--peak-gbps", type=float, help="HBM peak in GB/s (default: from the device properties)")
    args = ap.parse_args()
    require_gpu(__file__, "the kernels' CPU checks are in tests/kernels/test_kv_kernels.py")

    from sala.kv import KVPages, decode_attention, make_codec
    from sala.kv.pages import decode_attention_reference

    torch.manual_seed(0)
    peak = args.peak_gbps or peak_bandwidth_gbps()
    name = torch.cuda.get_device_name(0)
    scale = D**-0.5
    print(f"{name}: HBM peak {peak:,.0f} GB/s; Hq={HQ} Hkv={HKV} D={D} page {PAGE}; torch {torch.__version__}")
    print(f"{'B':>4}{'context':>9}{'format':>14}{'us':>10}{'MB read':>10}{'GB/s':>9}{'% peak':>8}{'bf16 us / us':>14}"
          f"{'max err':>10}")
    rows = []
    for b in BATCHES:
        for ctx in CONTEXTS:
            pool, tables, lens = rotating_block_tables(b, ctx, PAGE, 2 * b * ctx * HKV * D * 2)
            q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
            bf16_us = None
            for fmt in FORMATS:
                amax = None if fmt == "bf16" else [4.5] * HKV
                k, v = (KVPages(make_codec(fmt, amax), pool, PAGE, HKV, D, "cuda") for _ in range(2))
                rows_all = torch.arange(pool * PAGE, device="cuda")
                for pages_ in (k, v):
                    for chunk in rows_all.split(1 << 20):
                        pages_.write(chunk, torch.randn(len(chunk), HKV, D, device="cuda", dtype=torch.bfloat16))
                ref = decode_attention_reference(q, k, v, tables[0], lens, scale)
                out = decode_attention(q, k, v, tables[0], lens, scale)
                err = (out.float() - ref.float()).abs().max().item()
                if err > 2**-6 * 4.5:
                    sys.exit(f"{fmt}: kernel disagrees with the torch path at B={b}, context {ctx}: max error {err:.3g}")
                us = graph_time_us([lambda t=t, k=k, v=v: decode_attention(q, k, v, t, lens, scale) for t in tables], args.reps)
                read = 2 * b * ctx * k.codec.bytes_per_token(HKV, D)
                bf16_us = bf16_us or us
                gbps = read / (us * 1e-6) / 1e9
                row = {"batch": b, "context": ctx, "format": fmt, "us": us, "bytes_read": read, "gbps": gbps,
                       "peak_fraction": gbps / peak, "speedup_vs_bf16": bf16_us / us, "max_err": err}
                rows.append(row)
                print(f"{b:>4}{ctx:>9}{fmt:>14}{us:>10.1f}{read / 1e6:>10.1f}{gbps:>9,.0f}{gbps / peak:>8.0%}"
                      f"{bf16_us / us:>14.2f}{err:>10.1e}", flush=True)
                del k, v
    for r in rows:
        if r["format"] != "bf16":
            print(f"ratio {r['format']}_vs_bf16_speed_b{r['batch']}_{r['context']}: {r['speedup_vs_bf16']:.3f}")
    print(json.dumps({"bench": "kv_attention_gpu", "device": name, "peak_gbps": round(peak, 1),
                      "rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]}))


if __name__ == "__main__":
    main()
