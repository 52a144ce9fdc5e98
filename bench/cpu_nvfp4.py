"""The CPU W4A16 path (kernels/nvfp4_gemm.py: W dequantized a tile of rows at a time in every call)
against an fp32 matmul of a kept dequantized weight, the CPU path before weights stayed packed
(4 bytes a weight in memory instead of 0.56).

1. ns per weight of `nvfp4_matmul_tiled` by tile size (CPU_TILE_WEIGHTS is the default) on the
   9B model's linear shapes (bench/nvfp4_gemm_gpu.py's SHAPES) at M = 1 and 8 BF16 rows, and of
   the fp32 matmul; best of --reps calls.
2. With --model, an NVFP4 checkpoint (e.g. tiny-sala: `python -m sala.quant --output DIR --method
   rtn`): greedy engine decode tokens/s, eager and compiled, batch 1 and 8, 32-token prompts and
   64 new tokens, best of --reps runs.

With one thread the times are CPU time (time.process_time): on a machine shared with other work
they stay comparable where wall time does not; with more, wall time.

    python bench/cpu_nvfp4.py [--threads 1] [--reps 5] [--model DIR]
"""
import argparse
import json
import time

import torch

from kernels.nvfp4_gemm import CPU_TILE_WEIGHTS, nvfp4_dequantize_reference, nvfp4_matmul_tiled

TILES = sorted({1 << 16, 1 << 17, 1 << 18, 1 << 20, 1 << 22, CPU_TILE_WEIGHTS})


def best(fn, reps: int) -> float:
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


def matmul_table(reps: int) -> dict:
    from nvfp4_gemm_gpu import SHAPES

    out = {}
    print(f"ns per weight by tile size in weights (* CPU_TILE_WEIGHTS; fp32: a matmul of the dequantized weight), "
          f"{torch.get_num_threads()} thread(s)")
    print(f"{'shape':<22}{'M':>3}" + "".join(f"{f'{t >> 10}K' + '*' * (t == CPU_TILE_WEIGHTS):>9}" for t in TILES) + f"{'fp32':>9}")
    for name, k, parts in SHAPES:
        n = sum(parts)
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
        scale = (torch.rand(n, k // 16) * 100 + 1).to(torch.float8_e4m3fn)
        g = torch.tensor([300.0])
        dense = nvfp4_dequantize_reference(packed, scale, g)
        for m in (1, 8):
            x = torch.randn(m, k).bfloat16()
            ns = [best(lambda: nvfp4_matmul_tiled(x, packed, scale, g, None, t), reps) / (n * k) * 1e9 for t in TILES]
            ns.append(best(lambda: torch.nn.functional.linear(x.float(), dense).to(x.dtype), reps) / (n * k) * 1e9)
            print(f"{name + f' {k}x{n}':<22}{m:>3}" + "".join(f"{v:>9.2f}" for v in ns))
            out[f"{name}_m{m}"] = [round(v, 3) for v in ns]
    return out


def engine_decode(model: str, reps: int) -> dict:
    from sala.engine import Engine, SamplingParams

    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    out = {}
    for mode in ("eager", "compiled"):
        engine = Engine.from_pretrained(model, device="cpu", compile=mode == "compiled")
        for b in (1, 8):
            prompts = [[1] + [5 + (7 * i + j) % 200 for j in range(31)] for i in range(b)]
            engine.generate(prompts, params)  # warm-up (and the compile)
            times = []
            for _ in range(reps):
                t0 = clock()
                engine.generate(prompts, params)
                times.append(clock() - t0)
            out[f"b{b}_{mode}_tok_s"] = round(b * params.max_tokens / min(times), 1)
            print(f"engine decode, {mode:<8} batch {b}: {out[f'b{b}_{mode}_tok_s']:8.1f} tok/s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model", help="an NVFP4 checkpoint directory to decode from")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = {"threads": args.threads, "tile_weights": TILES, "matmul_ns_per_weight": matmul_table(args.reps)}
    if args.model:
        result |= engine_decode(args.model, args.reps)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
