"""Time candidate tiles of the memory-bound decode kernels on this GPU; print the fastest as
entries to write back into the kernels' per-target tables.

    python bench/tune_kernels.py [--reps 20]

- W4A16 decode (kernels/nvfp4_gemm.py DECODE_TILES): the 9B model's fused q/k/v/gate
  (4096 x 8704) and down (16384 x 4096) projections at M = 1 and 16;
- lightning decode (kernels/lightning_decode.py TILES): a 9B lightning layer's fp32 states
  (32 heads of 128 x 128) at batch 1, 8 and 64.

Each candidate is tried by setting the table's entry for this GPU's compute capability (what
kernels.target.pick reads), checked against the current entry's output, and replayed from a
CUDA graph over enough copies of the weights / state pools to miss L2
(bench/nvfp4_gemm_gpu.py). A candidate's score is its summed time over the kernel's shapes.
Prints every candidate's GB/s, the fastest, the line to paste, and a ratio line (the current
entry's time / the fastest's). The compile check (sala/compile_check.py, in CI) still has
to pass with the entry written back: it refuses tiles that spill on any target.
"""
import argparse
import contextlib
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nvfp4_gemm_gpu import copies_for, fused_weight, graph_time_us, require_gpu  # noqa: E402

W4A16_SHAPES = [("qkv+gate", 4096, [4096, 256, 256, 4096]), ("down", 16384, [4096])]
DECODE_ROWS = (1, 16)
STATE_BATCHES = (1, 8, 64)


@contextlib.contextmanager
def entry(table: dict, arch: int, value):
    """table[arch] = value for the duration (kernels.target.pick then returns it on this GPU)."""
    had, old = arch in table, table.get(arch)
    table[arch] = value
    try:
        yield
    finally:
        if had:
            table[arch] = old
        else:
            del table[arch]


def tune(name: str, table: dict, arch: int, candidates: list, cases: list, reps: int) -> dict:
    """Time every candidate over `cases` ((label, timed call, check, bytes, copies)); the
    current entry first. `check()` compares the kernel with its torch reference on inputs of its
    own; a graph replays the timed call once per copy of its inputs, each copy cold in L2."""
    from kernels.target import pick

    current = pick(table, torch.device("cuda"))
    results = []
    for tiles in [current] + [c for c in candidates if c != current]:
        with entry(table, arch, tiles):
            try:
                for _, _, check, _, _ in cases:
                    check()
                us = [graph_time_us([call] * copies, reps) for _, call, _, _, copies in cases]
            except Exception as e:  # a candidate that does not build or run is skipped, and said so
                print(f"  {name} {tiles}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
                continue
        gbs = [c[3] / (t * 1e-6) / 1e9 for c, t in zip(cases, us)]
        results.append({"tiles": tiles, "us": sum(us), "gb_s": gbs})
        print(f"  {name} {tiles}: {sum(us):8.1f} us  " + "  ".join(f"{c[0]} {g:6.0f} GB/s" for c, g in zip(cases, gbs)))
    best = min(results, key=lambda r: r["us"])
    return {"kernel": name, "current": repr(current), "best": repr(best["tiles"]),
            "speedup": round(results[0]["us"] / best["us"], 3), "best_gb_s": [round(g) for g in best["gb_s"]]}


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
        raise AssertionError(f"{what} differs from the torch reference")


def w4a16_cases():
    from kernels.nvfp4_gemm import nvfp4_matmul_reference, nvfp4_matmul_triton

    cases = []
    for label, k, parts in W4A16_SHAPES:
        packed, scale, gscale, _ = fused_weight(k, parts)
        weights = [(packed.clone(), scale.clone(), gscale.clone()) for _ in range(copies_for(packed.numel()))]
        for m in DECODE_ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            turn = itertools.cycle(weights)
            cases.append((f"{label} M={m}", lambda x=x, turn=turn: nvfp4_matmul_triton(x, *next(turn)),
                          lambda x=x, w=weights[0], label=label: close(nvfp4_matmul_triton(x, *w),
                                                                       nvfp4_matmul_reference(x, *w), label),
                          packed.numel() + scale.numel(), len(weights)))
    return cases


def lightning_cases():
    from kernels.lightning_decode import lightning_decode_reference, lightning_decode_triton

    h, d = 32, 128
    g = -torch.rand(h, device="cuda")
    cases = []
    for b in STATE_BATCHES:
        state_bytes = b * h * d * d * 4
        pools = [torch.randn(b, h, d, d, device="cuda") * 0.1 for _ in range(copies_for(state_bytes))]
        q, k, v = (torch.randn(b, h, d, device="cuda") for _ in range(3))
        slots = torch.arange(b, device="cuda")
        turn = itertools.cycle(pools)

        def check(q=q, k=k, v=v, slots=slots, pool=pools[0], b=b):
            mine, ref = pool.clone(), pool.clone()
            close(lightning_decode_triton(q, k, v, g, 0.1, mine, slots), lightning_decode_reference(q, k, v, g, 0.1, ref, slots),
                  f"batch {b} output")
            close(mine, ref, f"batch {b} states")

        # Timed calls decay their pools in place, round after round: values shrink, bytes do not.
        cases.append((f"batch {b}", lambda turn=turn, q=q, k=k, v=v, slots=slots:
                      lightning_decode_triton(q, k, v, g, 0.1, next(turn), slots), check, 2 * state_bytes, len(pools)))
    return cases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    require_gpu(__file__, "sala/compile_check.py builds the same kernels for every target without one")
    from kernels import lightning_decode, nvfp4_gemm
    from kernels.nvfp4_gemm import Tiles

    major, minor = torch.cuda.get_device_capability()
    arch = 10 * major + minor
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} (sm_{arch}): candidate tiles, time summed over each kernel's shapes")
    w4a16 = [Tiles(16, n, k, w) for n, k, w in itertools.product((32, 64, 128), (64, 128, 256), (4, 8))]
    state = [(k, v, w) for k, v, w in itertools.product((32, 64, 128), (32, 64, 128), (4, 8))]
    found = [tune("W4A16 decode", nvfp4_gemm.DECODE_TILES, arch, w4a16, w4a16_cases(), args.reps),
             tune("lightning decode", lightning_decode.TILES, arch, state, lightning_cases(), args.reps)]
    print("\nwrite back (then run python -m sala.compile_check):")
    print(f"  kernels/nvfp4_gemm.py       DECODE_TILES[{arch}] = {found[0]['best']}")
    print(f"  kernels/lightning_decode.py TILES[{arch}] = {found[1]['best']}")
    for f in found:
        print(f"ratio: {f['kernel']} current {f['current']} / fastest {f['best']}: {f['speedup']:.2f}x")
    print(json.dumps({"bench": "tune_kernels", "device": torch.cuda.get_device_name(), "arch": arch, "kernels": found}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
