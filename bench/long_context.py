"""Long context on CPU: tiny-sala with the real InfLLM-v2 settings (dense_len 8192, 64-token
blocks, 96 selected) against the same weights attending densely and the equal-size Llama of
bench/prefill_vs_llama.py, at 8K, 32K and 128K tokens: prefill time, decode tokens/s, peak memory.

Each (model, length) runs in its own process, so its peak resident memory (VmHWM less the RSS
once the model is built: activations, K/V, compressed keys and states) is its own. The dense runs grow
quadratically; they stop at --dense-max (default 32K), and a run past --timeout seconds is
stopped. Every entry that was not measured says so in the table, and next to it stands an
extrapolation from the two longest measured lengths of that model (a power law through them),
labelled as such: it is never reported as a measurement.

    python bench/long_context.py [--lengths 8192 32768 131072] [--dense-max 32768] [--timeout 1200] [--png long_context.png]
"""
import argparse
import json
import math
import subprocess
import sys
import time

import torch
from memwatch import status_bytes
from prefill_vs_llama import equal_size_llama

from sala.checkpoint import load_model
from sala.config import SALAConfig
from sala.model import SALAForCausalLM
from sala.tiny import ensure_tiny_sala

DECODE_TOKENS = 16


@torch.no_grad()
def measure(model, n: int) -> dict:
    """One-shot prefill of n tokens with a cache, then greedy cached decode."""
    base = status_bytes("VmRSS")
    ids = torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
    t0 = time.perf_counter()
    o = model(ids, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - t0
    cache, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)
    t0 = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        o = model(tok, past_key_values=cache, use_cache=True)
        tok = o.logits[:, -1:].argmax(-1)
    decode = time.perf_counter() - t0
    return {"prefill_s": round(prefill, 2), "decode_tok_s": round(DECODE_TOKENS / decode, 1),
            "peak_mib": round((status_bytes("VmHWM") - base) / 2**20, 1)}


def build(name: str, max_len: int):
    tiny = load_model(ensure_tiny_sala())
    if name == "llama":
        return equal_size_llama(tiny.config, max_len)
    return variant(tiny, max_len, **({"dense_len": 1 << 40} if name == "dense" else {}))


def run(name: str, n: int, max_len: int, timeout: float) -> dict | None:
    """In a fresh process (forking a process that has run OpenMP threads can hang); None when it
    ran past `timeout` seconds."""
    try:
        out = subprocess.run([sys.executable, __file__, "--one", name, str(n), str(max_len)], check=True,
                             capture_output=True, text=True, timeout=timeout).stdout
    except subprocess.TimeoutExpired:
        return None
    return json.loads(out.strip().splitlines()[-1])


def extrapolate(rows: list[dict], name: str, n: int) -> dict | None:
    """A model's figures at n tokens from a power law through its two longest measured lengths
    below n (prefill time and peak memory grow, decode speed falls); None with fewer than two."""
    pts = [r for r in rows if r.get(name) and r["tokens"] < n][-2:]
    if len(pts) < 2:
        return None
    (a, ra), (b, rb) = ((p["tokens"], p[name]) for p in pts)
    scale = math.log(n / b) / math.log(b / a)
    return {key: round(rb[key] * (rb[key] / ra[key]) ** scale, 2) for key in ("prefill_s", "decode_tok_s", "peak_mib")}


def variant(tiny, max_len: int, **sparse_over) -> SALAForCausalLM:
    config = SALAConfig.from_dict({**tiny.config.to_dict(), "max_position_embeddings": max_len,
                                   "sparse_config": {**tiny.config.sparse_config, **sparse_over}})
    m = SALAForCausalLM(config).eval()
    m.load_state_dict(tiny.state_dict())
    return m


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for key, ax, label in (("prefill_s", axes[0], "prefill s"), ("decode_tok_s", axes[1], "decode tokens/s"),
                           ("peak_mib", axes[2], "peak MiB")):
        for name in ("sparse", "dense", "llama"):
            pts = [(r["tokens"], r[name][key]) for r in rows if r.get(name)]
            if pts:
                line, = ax.plot(*zip(*pts), marker="o", label=name)
                guesses = [(r["tokens"], r["extrapolated"][name][key]) for r in rows
                           if (r.get("extrapolated") or {}).get(name)]
                if guesses:  # dashed, hollow: not measured
                    ax.plot(*zip(pts[-1], *guesses), ls="--", marker="o", mfc="none", color=line.get_color(),
                            label=f"{name} (extrapolated)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_title(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--dense-max", type=int, default=32768, help="longest prompt for the dense and Llama runs")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds before a run is stopped and reported unmeasured")
    ap.add_argument("--png", default="long_context.png")
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "TOKENS", "MAX_LEN"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        name, n, max_len = args.one[0], int(args.one[1]), int(args.one[2])
        print(json.dumps(measure(build(name, max_len), n)))
        return
    tiny = load_model(ensure_tiny_sala())
    max_len = max(args.lengths) + DECODE_TOKENS + 1
    sc = tiny.config.sparse_config
    print(f"long context, tiny-sala hidden={tiny.config.hidden_size} ({len(tiny.config.sparse_layers)} sparse + "
          f"{len(tiny.config.lightning_layers)} lightning layers), InfLLM-v2 dense_len={sc['dense_len']} "
          f"block={sc['block_size']} topk={sc['topk']} window={sc['window_size']}, threads={torch.get_num_threads()}, "
          f"decode {DECODE_TOKENS} tokens after the prefill")
    head = f"{'tokens':>8} | {'model':<7}{'prefill s':>11}{'decode tok/s':>14}{'peak MiB':>10}"
    print(head)
    rows = []
    for n in args.lengths:
        row = {"tokens": n}
        for name in ("sparse", "dense", "llama"):
            skipped = name != "sparse" and n > args.dense_max
            row[name] = None if skipped else run(name, n, max_len, args.timeout)
            r = row[name]
            if r:
                print(f"{n:>8} | {name:<7}{r['prefill_s']:>11.2f}{r['decode_tok_s']:>14.1f}{r['peak_mib']:>10.1f}", flush=True)
                continue
            why = "not run (--dense-max)" if skipped else f"stopped after {args.timeout:.0f} s"
            e = row.setdefault("extrapolated", {})[name] = extrapolate(rows, name, n)
            guess = (f"; EXTRAPOLATED, not measured: prefill {e['prefill_s']} s, decode {e['decode_tok_s']} tok/s, "
                     f"peak {e['peak_mib']} MiB" if e else "")
            print(f"{n:>8} | {name:<7}{why}{guess}", flush=True)
        rows.append(row)
    for row in rows:
        s, d, ll = row["sparse"], row["dense"], row["llama"]
        if s and d and ll:
            print(f"{row['tokens']:>8} tokens: dense/sparse prefill time {d['prefill_s'] / s['prefill_s']:.2f}x, "
                  f"sparse/dense decode tokens/s {s['decode_tok_s'] / d['decode_tok_s']:.2f}x, "
                  f"llama/sala-sparse prefill time {ll['prefill_s'] / s['prefill_s']:.2f}x, "
                  f"llama/sala-sparse peak memory {ll['peak_mib'] / max(s['peak_mib'], 0.1):.2f}x")
    plot(rows, args.png)
    print(f"plot: {args.png}")
    print(json.dumps({"bench": "long_context", "decode_tokens": DECODE_TOKENS, "rows": rows}))


if __name__ == "__main__":
    main()
