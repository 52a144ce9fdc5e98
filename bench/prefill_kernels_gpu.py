"""The prefill kernels on CUDA: dense causal GQA attention against torch SDPA, and the fused
chunked lightning prefill against sala/lightning.py's torch chunked form.

    python bench/prefill_kernels_gpu.py [--reps 20] [--peak-bf16-tflops 989] [--peak-fp32-tflops 67]

Shapes of the 9B model: sparse layers Hq = 32, Hkv = 2, D = 128, bf16, a fresh prompt of 1K /
4K / 8K tokens and a 2K chunk after 6K cached keys (the chunked-prefill case); lightning layers
32 heads of D = 128, fp32 (as the engine keeps them), prompts of 4K and 16K tokens from a state.
Reported: time per call of each, the torch / kernel ratio, and the kernel's fraction of the
hardware limit: attention's causal FLOPs (4 D per visible query-key pair and head) against the
bf16 tensor-core peak; the lightning kernel's FLOPs (per token 2 C (Dk + Dv) + 4 Dk Dv, C = 64)
against the fp32 peak (its tiles are fp32, as the recurrence needs). Timing replays the calls
from one CUDA graph (bench/nvfp4_gemm_gpu.py's graph_time_us). Each kernel is checked against
its reference first. Peaks default to the H100/H200 SXM figures; pass the right ones elsewhere.
"""
import argparse
import json
import sys

import torch
from nvfp4_gemm_gpu import graph_time_us, require_gpu  # bench/ is this script's sys.path[0]

HQ, HKV, D = 32, 2, 128
ATTENTION = [(1024, 0), (4096, 0), (8192, 0), (2048, 6144)]  # (chunk tokens, cached keys before it)
LIGHTNING_H, LIGHTNING = 32, [4096, 16384]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20, help="graph replays per measurement (median taken)")
    ap.add_argument("--peak-bf16-tflops", type=float, default=989.0, help="dense bf16 tensor-core peak")
    ap.add_argument("--peak-fp32-tflops", type=float, default=67.0, help="fp32 (non-tensor) peak")
    args = ap.parse_args()
    require_gpu(__file__, "the kernels' CPU checks are in tests/kernels/test_prefill_kernels.py")

    from kernels.lightning_prefill import lightning_prefill_triton
    from kernels.prefill_attention import prefill_attention_reference, prefill_attention_triton
    from sala import lightning

    torch.manual_seed(0)
    name = torch.cuda.get_device_name(0)
    print(f"{name}; torch {torch.__version__}; peaks {args.peak_bf16_tflops:.0f} TFLOP/s bf16, "
          f"{args.peak_fp32_tflops:.0f} TFLOP/s fp32")
    print(f"{'attention T':>12}{'past':>7}{'sdpa us':>10}{'kernel us':>11}{'sdpa/kernel':>13}{'TFLOP/s':>9}{'% peak':>8}")
    rows = []
    for t, past in ATTENTION:
        q = torch.randn(HQ, t, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(HKV, past + t, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        err = (prefill_attention_triton(q, k, v).float() - prefill_attention_reference(q, k, v).float()).abs().max().item()
        if err > 2e-2:
            sys.exit(f"attention kernel disagrees with SDPA at T={t}, past={past}: max error {err:.3g}")
        t_ref = graph_time_us([lambda: prefill_attention_reference(q, k, v)], args.reps)
        t_k = graph_time_us([lambda: prefill_attention_triton(q, k, v)], args.reps)
        flops = 4 * D * HQ * (t * past + t * (t + 1) / 2)
        tflops = flops / (t_k * 1e-6) / 1e12
        rows.append({"kind": "attention", "tokens": t, "past": past, "torch_us": t_ref, "kernel_us": t_k,
                     "speedup": t_ref / t_k, "tflops": tflops, "peak_fraction": tflops / args.peak_bf16_tflops,
                     "max_err": err})
        print(f"{t:>12}{past:>7}{t_ref:>10.1f}{t_k:>11.1f}{t_ref / t_k:>13.2f}{tflops:>9.1f}"
              f"{tflops / args.peak_bf16_tflops:>8.0%}")
    print(f"{'lightning T':>12}{'':>7}{'torch us':>10}{'kernel us':>11}{'torch/kernel':>13}{'TFLOP/s':>9}{'% peak':>8}")
    g = lightning.log_decay(LIGHTNING_H).cuda()
    for t in LIGHTNING:
        q, k, v = (torch.randn(1, LIGHTNING_H, t, D, device="cuda") * 0.1 for _ in range(3))
        s0 = torch.randn(1, LIGHTNING_H, D, D, device="cuda")
        o_k, s_k = lightning_prefill_triton(q, k, v, g, D**-0.5, s0)
        o_r, s_r = lightning.chunked_torch(q, k, v, g, D**-0.5, s0)
        err = max((o_k - o_r).abs().max().item(), (s_k - s_r).abs().max().item() / s_r.abs().max().item())
        if err > 1e-3:
            sys.exit(f"lightning kernel disagrees with the torch form at T={t}: max error {err:.3g}")
        t_ref = graph_time_us([lambda: lightning.chunked_torch(q, k, v, g, D**-0.5, s0)], args.reps)
        t_k = graph_time_us([lambda: lightning_prefill_triton(q, k, v, g, D**-0.5, s0)], args.reps)
        flops = LIGHTNING_H * t * (2 * 64 * (D + D) + 4 * D * D)
        tflops = flops / (t_k * 1e-6) / 1e12
        rows.append({"kind": "lightning", "tokens": t, "torch_us": t_ref, "kernel_us": t_k, "speedup": t_ref / t_k,
                     "tflops": tflops, "peak_fraction": tflops / args.peak_fp32_tflops, "max_err": err})
        print(f"{t:>12}{'':>7}{t_ref:>10.1f}{t_k:>11.1f}{t_ref / t_k:>13.2f}{tflops:>9.1f}"
              f"{tflops / args.peak_fp32_tflops:>8.0%}")
    print(json.dumps({"bench": "prefill_kernels_gpu", "device": name, "peak_bf16_tflops": args.peak_bf16_tflops,
                      "peak_fp32_tflops": args.peak_fp32_tflops,
                      "rows": [{k: (round(x, 4) if isinstance(x, float) else x) for k, x in r.items()} for r in rows]}))


if __name__ == "__main__":
    main()
