"""Decode speed per K/V format: the engine's decode tokens/s and the cache bytes a step reads at
4K and 16K tokens of context, bf16 vs fp8 vs nvfp4 vs a mixed plan, against bf16 in the same run.

tiny-sala's weights with a long max_model_len and InfLLM-v2 switched off (dense_len past the
longest context), so every decode step attends over the whole context and reads all of its
K/V: what the formats change. The mixed plan is the published recipe's shape: the first and
the last sparse layer FP8, the others NVFP4, every lightning state fp32. FP8 and NVFP4 use
calibrated scales (amax 8 per head; the values do not change the speed).

Bytes read per step and sequence: the K/V of every sparse layer over the context (scales
included) plus every lightning state (read once; written back as much). On CPU the quantized
pages are dequantized into bf16 before the torch attention (sala/kv/pages.py), so fewer bytes
stored cost more work per step there: the figures are reported as they come. On CUDA the same
engine reads the pages with the Triton kernel, dequantizing in registers.

    python bench/kv_decode.py [--contexts 4096 16384] [--batch 2] [--new-tokens 16]
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for sala/

from sala.checkpoint import load_model
from sala.config import SALAConfig
from sala.engine import Engine, SamplingParams
from sala.kv import KVPlan
from sala.model import SALAForCausalLM
from sala.tiny import ensure_tiny_sala

FORMATS = ("bf16", "fp8", "nvfp4", "plan")


def long_model(tiny, max_len: int) -> SALAForCausalLM:
    config = SALAConfig.from_dict({**tiny.config.to_dict(), "max_position_embeddings": max_len,
                                   "sparse_config": {**tiny.config.sparse_config, "dense_len": 1 << 40}})
    m = SALAForCausalLM(config).eval()
    m.load_state_dict(tiny.state_dict())
    return m.to(torch.bfloat16)


def plan_for(config, name: str) -> KVPlan:
    amax = {i: {"k": [8.0] * config.num_key_value_heads, "v": [8.0] * config.num_key_value_heads}
            for i in config.sparse_layers}
    if name != "plan":
        return KVPlan.uniform(config, name, "fp32", amax)
    first, *_, last = config.sparse_layers
    return KVPlan.uniform(config, "nvfp4", "fp32", amax).with_units({first: "fp8", last: "fp8"})


def step_bytes(config, plan: KVPlan, context: int) -> int:
    return context * sum(plan.kv_bytes_per_token(config).values()) + sum(plan.state_bytes_per_seq(config).values())


@torch.no_grad()
def decode_rate(engine: Engine, context: int, batch: int, new_tokens: int) -> float:
    """Decode tokens/s of `batch` sequences at `context` tokens: prefill first, then time the
    steps that each add one token to every sequence."""
    g = torch.Generator().manual_seed(context)
    params = SamplingParams(max_tokens=new_tokens + 1, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(torch.randint(3, engine.model.config.vocab_size, (context,), generator=g).tolist(), params)
            for _ in range(batch)]
    while any(not r.output_ids for r in reqs):
        engine.step()
    t0 = time.perf_counter()
    done = sum(len(r.output_ids) for r in reqs)
    while engine.has_work():
        engine.step()
    tokens = sum(len(r.output_ids) for r in reqs) - done
    return tokens / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--batch", type=int, default=2, help="sequences decoded together")
    ap.add_argument("--new-tokens", type=int, default=16, help="decode steps timed per sequence")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = ensure_tiny_sala(progress=False)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tiny = load_model(path)
    max_len = max(args.contexts) + args.new_tokens + 2
    base = long_model(tiny, max_len)
    config = base.config
    from sala.config import MINICPM_SALA_9B  # the released config.json

    real = SALAConfig(**MINICPM_SALA_9B)
    plans = {f: plan_for(config, f) for f in FORMATS}
    print(f"decode, tiny-sala bf16 ({len(config.sparse_layers)} sparse layers {config.sparse_layers}, "
          f"{len(config.lightning_layers)} lightning), dense attention, batch {args.batch}, {args.new_tokens} steps "
          f"timed, eager engine, {args.threads} thread(s), {'CUDA' if torch.cuda.is_available() else 'CPU'}; "
          f"plan: {plans['plan'].describe()}")
    print(f"{'format':<7}{'context':>9}{'tokens/s':>10}{'tiny KiB read/step':>20}{'9B MiB read/step':>18}")
    rows = []
    for f, plan in plans.items():
        engine = Engine(long_model(tiny, max_len), tok, compile=False, kv_plan=plan, max_seqs=args.batch,
                        max_model_len=max_len)
        for ctx in args.contexts:
            rate = decode_rate(engine, ctx, args.batch, args.new_tokens)
            b9 = None if f == "plan" else step_bytes(real, plan_for(real, f), ctx)
            row = {"format": f, "context": ctx, "tokens_per_s": round(rate, 2), "tiny_bytes_per_step": step_bytes(config, plan, ctx),
                   "9b_bytes_per_step": b9}
            rows.append(row)
            b9s = f"{b9 / 2**20:>18.1f}" if b9 else f"{'-':>18}"
            print(f"{f:<7}{ctx:>9}{rate:>10.1f}{row['tiny_bytes_per_step'] / 1024:>20.1f}{b9s}", flush=True)
        del engine
    ratios = {}
    for ctx in args.contexts:
        at = {r["format"]: r for r in rows if r["context"] == ctx}
        for f in FORMATS[1:]:
            ratios[f"{f}_vs_bf16_tokens_per_s_{ctx}"] = at[f]["tokens_per_s"] / at["bf16"]["tokens_per_s"]
            ratios[f"{f}_vs_bf16_bytes_per_step_{ctx}"] = at[f]["tiny_bytes_per_step"] / at["bf16"]["tiny_bytes_per_step"]
    for k, v in ratios.items():
        print(f"ratio {k}: {v:.3f}")
    print(json.dumps({"bench": "kv_decode", "device": "cuda" if torch.cuda.is_available() else "cpu",
                      "batch": args.batch, "new_tokens": args.new_tokens, "plan": plans["plan"].describe(), "rows": rows,
                      "ratios": {k: round(v, 4) for k, v in ratios.items()}}))


if __name__ == "__main__":
    main()
