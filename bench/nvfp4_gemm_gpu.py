"""The W4A16 NVFP4 Triton kernel against torch's BF16 matmul (cuBLAS) on a CUDA GPU.

    python bench/nvfp4_gemm_gpu.py [--reps 50] [--peak-gbps 4800]

Shapes (in x out features) 4096x4096, 4096x16384 and 16384x4096 at M = 1, 16, 128 BF16
activation rows: time per call, the ratio to BF16, and the achieved fraction of HBM bandwidth
(bytes the call must read and write / time; the goal is >= 70% of peak at M = 1, where the
weight read dominates).

How it is timed, and why: every call is replayed from a CUDA graph, so Python and launch
overhead (comparable to a 5 us decode GEMV) are not counted; and each graph cycles through
enough copies of the weight to cover 4x the L2 cache, so every call reads its weight from
HBM as a decoder does layer after layer, instead of from a warm L2 (a 4096x4096 NVFP4 weight
is 9 MB). Peak bandwidth comes from the device's memory clock and bus width; a large
device-to-device copy is measured as well, as the bandwidth actually reachable. Before
timing, every shape is checked against the fp32 torch reference.
"""
import argparse
import json
import math
import os
import statistics
import sys

import torch

SHAPES = [(4096, 4096), (4096, 16384), (16384, 4096)]  # (in features K, out features N)
ROWS = [1, 16, 128]
GOAL = 0.70


def require_gpu() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench/nvfp4_gemm_gpu.py needs a CUDA GPU: torch.cuda.is_available() is False on this machine "
                 f"(torch {torch.__version__}); the kernel's CPU checks are in tests/test_nvfp4_gemm.py")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter would time Python, not the GPU kernel")
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("triton is not installed (pip install -e '.[gpu]')")


def peak_bandwidth_gbps() -> float:
    """HBM peak from cudaDeviceProp: double data rate x bus width x memory clock."""
    p = torch.cuda.get_device_properties(0)
    return 2 * p.memory_bus_width / 8 * p.memory_clock_rate * 1e3 / 1e9


def graph_time_us(calls, reps: int) -> float:
    """Median time of one call (microseconds), replaying all `calls` in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def copy_bandwidth_gbps(reps: int) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = graph_time_us([lambda: dst.copy_(src)], reps)
    return 2 * src.numel() / (us * 1e-6) / 1e9


def copies_for(weight_bytes: int) -> int:
    """Weight copies whose total covers 4x the L2 cache, so each call finds its weight cold."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, math.ceil(4 * l2 / weight_bytes))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=50, help="graph replays per measurement (median taken)")
    ap.add_argument("--peak-gbps", type=float, help="HBM peak in GB/s (default: from the device properties)")
    args = ap.parse_args()
    require_gpu()

    from kernels.nvfp4_gemm import nvfp4_matmul_reference, nvfp4_matmul_triton
    from sala.quant.nvfp4 import quantize_rtn

    torch.manual_seed(0)
    peak = args.peak_gbps or peak_bandwidth_gbps()
    copy_gbps = copy_bandwidth_gbps(args.reps)
    name = torch.cuda.get_device_name(0)
    print(f"{name}: HBM peak {peak:,.0f} GB/s, measured device copy {copy_gbps:,.0f} GB/s "
          f"({copy_gbps / peak:.0%} of peak); torch {torch.__version__}")
    print(f"{'in x out':<13}{'M':>5}{'W4A16 us':>10}{'BF16 us':>10}{'BF16/W4A16':>12}{'W4A16 GB/s':>12}"
          f"{'% peak':>8}{'BF16 GB/s':>11}{'% peak':>8}{'max rel err':>13}")
    rows = []
    for k, n in SHAPES:
        q = quantize_rtn(torch.randn(n, k, device="cuda") * 0.02)
        packed, scale, gscale = q.packed(), q.scale, q.global_scale
        w_bf16 = q.dequantize(torch.bfloat16)  # the same weight values in BF16
        nvfp4_bytes = packed.numel() + scale.numel() + gscale.numel() * 4
        quant_copies = [(packed.clone(), scale.clone(), gscale.clone()) for _ in range(copies_for(nvfp4_bytes))]
        bf16_copies = [w_bf16.clone() for _ in range(copies_for(w_bf16.numel() * 2))]
        for m in ROWS:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            y = nvfp4_matmul_triton(x, packed, scale, gscale)
            ref = nvfp4_matmul_reference(x, packed, scale, gscale)
            rel_err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            if rel_err > 1e-2:
                sys.exit(f"kernel disagrees with the reference at {k}x{n}, M={m}: max relative error {rel_err:.3g}")
            t_q = graph_time_us([lambda c=c: nvfp4_matmul_triton(x, *c) for c in quant_copies], args.reps)
            t_b = graph_time_us([lambda w=w: torch.nn.functional.linear(x, w) for w in bf16_copies], args.reps)
            io = 2 * m * (k + n)  # BF16 activations in, BF16 outputs out
            gbps_q = (nvfp4_bytes + io) / (t_q * 1e-6) / 1e9
            gbps_b = (w_bf16.numel() * 2 + io) / (t_b * 1e-6) / 1e9
            row = {"k": k, "n": n, "m": m, "w4a16_us": t_q, "bf16_us": t_b, "speedup": t_b / t_q,
                   "w4a16_gbps": gbps_q, "w4a16_peak_fraction": gbps_q / peak, "bf16_gbps": gbps_b,
                   "bf16_peak_fraction": gbps_b / peak, "max_rel_err": rel_err}
            rows.append(row)
            print(f"{f'{k}x{n}':<13}{m:>5}{t_q:>10.1f}{t_b:>10.1f}{row['speedup']:>12.2f}{gbps_q:>12,.0f}"
                  f"{row['w4a16_peak_fraction']:>8.0%}{gbps_b:>11,.0f}{row['bf16_peak_fraction']:>8.0%}{rel_err:>13.1e}")
    worst = min(r["w4a16_peak_fraction"] for r in rows if r["m"] == 1)
    met = worst >= GOAL
    print(f"goal: W4A16 at M=1 reaches >= {GOAL:.0%} of HBM peak on every shape: "
          f"{'met' if met else 'NOT met'} (lowest {worst:.0%})")
    print(json.dumps({
        "bench": "nvfp4_gemm_gpu", "device": name, "peak_gbps": round(peak, 1), "copy_gbps": round(copy_gbps, 1),
        "goal_peak_fraction_m1": GOAL, "goal_met": met,
        "rows": [{k_: (round(v, 4) if isinstance(v, float) else v) for k_, v in r.items()} for r in rows],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
