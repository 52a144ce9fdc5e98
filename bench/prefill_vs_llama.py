"""Prefill time: tiny-sala vs a transformers LlamaForCausalLM of the same width, depth and
vocabulary (random weights, sdpa attention), in the same run, at 1K, 4K and 8K tokens.

SALA's hybrid design keeps 5 of tiny-sala's 8 layers linear in sequence length, so its
advantage should grow with context. 8K is measured at 8191 tokens: from 8192 on, the official
sparse layers switch to InfLLM-v2 block selection.

    python bench/prefill_vs_llama.py [--lengths 1024 4096 8191]
"""
import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sala.checkpoint import load_model
from sala.tiny import ensure_tiny_sala


def equal_size_llama(c, max_len: int) -> LlamaForCausalLM:
    """A random-weight transformers Llama of tiny-sala's width, depth, heads and vocabulary (sdpa attention)."""
    return LlamaForCausalLM(
        LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                    num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                    num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                    max_position_embeddings=max_len, attn_implementation="sdpa")
    ).eval()


@torch.no_grad()
def prefill_seconds(model, ids, repeat=3):
    model(ids[:, :64], use_cache=False)  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        model(ids, use_cache=False, logits_to_keep=1)
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8191])
    args = ap.parse_args()
    sala = load_model(ensure_tiny_sala())
    c = sala.config
    llama = equal_size_llama(c, max(args.lengths))
    print(f"prefill, hidden={c.hidden_size}, layers={c.num_hidden_layers} "
          f"({len(c.sparse_layers)} sparse + {len(c.lightning_layers)} lightning), threads={torch.get_num_threads()}")
    print(f"{'tokens':>8}{'tiny-sala s':>14}{'llama s':>12}{'llama/sala':>12}")
    rows = []
    for n in args.lengths:
        ids = torch.randint(0, c.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        ts, tl = prefill_seconds(sala, ids), prefill_seconds(llama, ids)
        rows.append({"tokens": n, "sala_s": round(ts, 3), "llama_s": round(tl, 3), "ratio": round(tl / ts, 2)})
        print(f"{n:>8}{ts:>14.3f}{tl:>12.3f}{tl / ts:>12.2f}")
    print(json.dumps({"bench": "prefill_vs_llama", "rows": rows}))


if __name__ == "__main__":
    main()
