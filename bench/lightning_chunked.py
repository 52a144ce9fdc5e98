"""Chunked lightning attention vs the naive recurrence at T = 4096: speed ratio and max error.

    python bench/lightning_chunked.py [--t 4096] [--heads 4] [--dim 32]
"""
import argparse
import json
import time

import torch

from sala import lightning


def timed(fn, repeat):
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    return (time.perf_counter() - t0) / repeat, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--t", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=32, help="head dim (tiny-sala: 32; the 9B model: 128)")
    ap.add_argument("--chunk", type=int, default=64)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, args.t, args.dim, generator=g) for _ in range(3))
    s0 = torch.randn(1, args.heads, args.dim, args.dim, generator=g)
    decay = lightning.log_decay(args.heads)
    scale = args.dim**-0.5
    t_naive, (o_ref, s_ref) = timed(lambda: lightning.recurrent(q, k, v, decay, scale, s0), 1)
    t_chunk, (o, s) = timed(lambda: lightning.chunked(q, k, v, decay, scale, s0, args.chunk), 5)
    err = (o - o_ref).abs().max().item()
    serr = (s - s_ref).abs().max().item()
    print(f"lightning attention, T={args.t}, heads={args.heads}, head_dim={args.dim}, chunk={args.chunk}")
    print(f"{'form':<12}{'ms':>10}{'speed-up':>10}")
    print(f"{'recurrent':<12}{t_naive * 1e3:>10.1f}{1.0:>10.1f}")
    print(f"{'chunked':<12}{t_chunk * 1e3:>10.1f}{t_naive / t_chunk:>10.1f}")
    print(f"max |chunked - recurrent|: output {err:.2e}, final state {serr:.2e}")
    print(json.dumps({"bench": "lightning_chunked", "T": args.t, "recurrent_ms": round(t_naive * 1e3, 2),
                      "chunked_ms": round(t_chunk * 1e3, 2), "speedup": round(t_naive / t_chunk, 2),
                      "max_abs_err": err, "state_max_abs_err": serr}))


if __name__ == "__main__":
    main()
