"""Cache bytes and quality per K/V format on tiny-sala, against all-FP8 measured in the same run.

Bytes a token and a 32K-token sequence (K/V of every sparse layer plus the lightning states)
for the 9B config and tiny-sala; mean KL to the unquantized cache and top-1 agreement on
held-out windows (sala/kv/measure.py: prefill 64 tokens, then teacher-forced decode) for
all-FP8, all-NVFP4, all-NVFP4-4/6 and a plan chosen by downgrading one unit at a time (a sparse
layer to NVFP4-4/6, a lightning state to bf16) from least to most sensitive while the combined
plan's KL stays within 1.2x all-FP8's. Ratios printed; last line JSON.

    python bench/kv_cache.py [--windows 16]
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for sala/

from sala.checkpoint import load_model
from sala.config import SALAConfig
from sala.eval.compare import window_sequences
from sala.kv import KVPlan
from sala.kv.measure import calibrate_amax, measure_plan, reference_baseline
from sala.kv.search import downgraded, greedy_plan, units
from sala.tiny import ensure_tiny_sala, heldout_texts, token_stream

PREFIX, SEQ = 64, 128


def cache_bytes(config, plan: KVPlan, tokens: int) -> int:
    return tokens * sum(plan.kv_bytes_per_token(config).values()) + sum(plan.state_bytes_per_seq(config).values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=16, help="held-out windows scored per plan")
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = ensure_tiny_sala(progress=False)
    from transformers import AutoTokenizer

    model, tok = load_model(path), AutoTokenizer.from_pretrained(path)
    config = model.config
    windows = window_sequences(token_stream(tok, heldout_texts(path)), SEQ, args.windows + 8)
    amax = calibrate_amax(model, windows[:8])
    held = windows[8:]
    ref = reference_baseline(model, held, PREFIX)

    def measure(plan):
        return measure_plan(model, held, plan, ref, PREFIX)

    plans = {f: KVPlan.uniform(config, f, "fp32", amax) for f in ("bf16", "fp8", "nvfp4", "nvfp4_4over6")}
    quality = {f: measure(p) for f, p in plans.items()}
    budget = 1.2 * quality["fp8"]["kl_mean"]
    sensitivity = {u: measure(downgraded(plans["fp8"], u, "nvfp4_4over6"))["kl_mean"] for u in units(config)}
    plan, plan_q = greedy_plan(plans["fp8"], quality["fp8"], sensitivity, measure, max_kl=budget, kv_format="nvfp4_4over6")
    plans["plan"], quality["plan"] = plan, plan_q

    from sala.config import MINICPM_SALA_9B  # the released config.json

    big = SALAConfig(**MINICPM_SALA_9B)
    big_amax = {i: {"k": [1.0] * big.num_key_value_heads, "v": [1.0] * big.num_key_value_heads} for i in big.sparse_layers}
    print(f"{'format':<14}{'9B B/token':>11}{'9B MiB/32K seq':>16}{'tiny B/token':>13}{'KL to unquantized':>19}{'top-1':>8}")
    rows = {}
    for f, p in plans.items():
        b9 = None
        if f != "plan":  # the plan is tiny-sala's own; the 9B figures are per uniform format
            big_plan = KVPlan.uniform(big, f, "fp32", big_amax)
            b9 = (sum(big_plan.kv_bytes_per_token(big).values()), cache_bytes(big, big_plan, 32768) / 2**20)
        tiny_b = sum(p.kv_bytes_per_token(config).values())
        q = quality[f]
        rows[f] = {"tiny_bytes_per_token": tiny_b, "tiny_bytes_32k": cache_bytes(config, p, 32768), "kl_mean": q["kl_mean"],
                   "top1": q["top1_agreement"], "ppl": q["ppl"]}
        if b9:
            rows[f] |= {"9b_bytes_per_token": b9[0], "9b_mib_32k": b9[1]}
        b9s = f"{b9[0]:>11}{b9[1]:>16.0f}" if b9 else f"{'-':>11}{'-':>16}"
        print(f"{f:<14}{b9s}{tiny_b:>13}{q['kl_mean']:>19.3e}{q['top1_agreement']:>8.4f}")
    print(f"plan: {plan.describe()}")
    nv, fp8 = rows["nvfp4"], rows["fp8"]
    ratios = {
        "plan_bytes_vs_nvfp4": rows["plan"]["tiny_bytes_32k"] / nv["tiny_bytes_32k"],
        "plan_kl_vs_fp8": rows["plan"]["kl_mean"] / fp8["kl_mean"],
        "nvfp4_4over6_kl_vs_nvfp4": rows["nvfp4_4over6"]["kl_mean"] / nv["kl_mean"],
        "nvfp4_bytes_vs_fp8": nv["tiny_bytes_per_token"] / fp8["tiny_bytes_per_token"],
    }
    for k, v in ratios.items():
        print(f"ratio {k}: {v:.3f}")
    print(json.dumps({"bench": "kv_cache", "rows": rows, "ratios": ratios,
                      "sensitivity": {f"{k}{i}": v for (k, i), v in sensitivity.items()}}))


if __name__ == "__main__":
    main()
