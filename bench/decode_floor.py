"""The least time a 9B decode step can take: the bytes it must read, divided by HBM bandwidth.

    python bench/decode_floor.py [--batches 1 8 32 64] [--contexts 4096 32768]

A FLOOR COMPUTED FROM BYTES, NOT A MEASUREMENT. One decode step of the released 9B config
(sala.config.MINICPM_SALA_9B) reads, whatever the kernels:
- every decoder weight once (shared by the batch): BF16, or packed NVFP4 (E2M1 codes, an FP8
  scale per 16 weights, a global scale per Linear) with lm_head in BF16 as our checkpoints keep it;
- per sequence, each sparse layer's K/V of the tokens it attends: all of them below
  sparse_config.dense_len, past it InfLLM-v2's selected blocks plus the fp32 compressed keys
  its stage-1 scoring reads; in bf16, FP8 (calibrated: one scale per head) or NVFP4;
- per sequence, each lightning layer's recurrent state, read and written back (fp32 or bf16).
Activations, logits and sampling are left out (megabytes against gigabytes). Step time =
bytes / bandwidth at the H200's 4.8 TB/s and the B200's 8 TB/s (kernels.target.TARGETS).
bench/gpu_check.sh prints each measured engine step as a fraction of this floor.

Ratio line: the quantized product's bytes (NVFP4 weights, FP8 K/V, fp32 states) against
BF16's (bf16 weights and K/V, fp32 states), at each batch and context.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.nvfp4_gemm import GROUP_SIZE  # noqa: E402
from kernels.target import TARGETS  # noqa: E402
from sala import sparse  # noqa: E402
from sala.config import MINICPM_SALA_9B, SALAConfig  # noqa: E402
from sala.engine.memory import state_bytes_per_seq  # noqa: E402
from sala.kv import KVPlan  # noqa: E402

GPUS = {"H200": TARGETS["sm_90a"].bandwidth, "B200": TARGETS["sm_100a"].bandwidth}
# (weights, K/V format, state dtype) of the configurations the table compares.
SETUPS = {"BF16": ("bf16", "bf16", "fp32"), "NVFP4 + FP8 K/V": ("nvfp4", "fp8", "fp32"),
          "NVFP4 + NVFP4 K/V + bf16 states": ("nvfp4", "nvfp4", "bf16")}


def weight_bytes(config: SALAConfig, weights: str) -> int:
    """Every decoder Linear once, plus lm_head (BF16 in both: our NVFP4 checkpoints keep it)."""
    from sala.model import SALAForCausalLM

    with torch.device("meta"):
        model = SALAForCausalLM(config)
    total = model.lm_head.weight.numel() * 2
    for layer in model.model.layers:
        for m in layer.modules():
            if isinstance(m, torch.nn.Linear):
                n, k = m.weight.shape
                total += n * k * 2 if weights == "bf16" else n * k // 2 + n * k // GROUP_SIZE + 4
    return total


def attended_tokens(config: SALAConfig, context: int) -> tuple[int, int]:
    """(K/V tokens a decode row reads, fp32 compressed keys it reads) per sparse layer: all of
    them below dense_len; past it InfLLM-v2's selected blocks and every visible K1 / K2 window."""
    s = sparse.SparseSettings.of(config)
    if context < s.dense_len:
        return context, 0
    windows = sum(sparse.num_windows(context, size, stride) for size, stride in s.levels)
    return min(context, s.num_selected * s.block_size), windows


def step_bytes(config: SALAConfig, batch: int, context: int, weights: str, kv: str, state: str) -> dict[str, int]:
    """Bytes one decode step reads (states: read and written), by kind."""
    amax = {i: {"k": [1.0] * config.num_key_value_heads, "v": [1.0] * config.num_key_value_heads}
            for i in config.sparse_layers}  # calibrated scales: what the quantize pipeline writes
    plan = KVPlan.uniform(config, kv, state, amax)
    tokens, windows = attended_tokens(config, context)
    per_token = sum(plan.kv_bytes_per_token(config).values())
    compressed = windows * len(config.sparse_layers) * config.num_key_value_heads * config.head_dim * 4
    return {"weights": weight_bytes(config, weights), "kv": batch * (tokens * per_token + compressed),
            "states": batch * 2 * state_bytes_per_seq(config, plan)}


def floor_ms(config: SALAConfig, batch: int, context: int, setup: tuple[str, str, str], bandwidth: float) -> float:
    """The floor in milliseconds of a step of `setup` (weights, K/V format, state dtype)."""
    return sum(step_bytes(config, batch, context, *setup).values()) / bandwidth * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    args = ap.parse_args()
    config = SALAConfig(**MINICPM_SALA_9B)
    gb = 1e9
    print("9B decode step: a FLOOR COMPUTED FROM BYTES (bytes read / HBM bandwidth), not a measurement")
    print(f"weights: BF16 {weight_bytes(config, 'bf16') / gb:.2f} GB, NVFP4 {weight_bytes(config, 'nvfp4') / gb:.2f} GB "
          "(lm_head BF16 in both)")
    head = f"{'batch':>5} {'context':>7}  {'K/V GB bf16 / fp8 / nvfp4':>26}  {'states GB fp32 / bf16':>21}"
    head += "".join(f"  {name + ' ms H200 / B200':>42}" for name in SETUPS)
    print(head)
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            kv = {f: step_bytes(config, batch, context, "bf16", f, "fp32")["kv"] for f in ("bf16", "fp8", "nvfp4")}
            st = {s: step_bytes(config, batch, context, "bf16", "bf16", s)["states"] for s in ("fp32", "bf16")}
            ms = {(name, gpu): floor_ms(config, batch, context, SETUPS[name], GPUS[gpu]) for name in SETUPS for gpu in GPUS}
            line = f"{batch:>5} {context:>7}  {' / '.join(f'{kv[f] / gb:.2f}' for f in kv):>26}"
            line += f"  {' / '.join(f'{st[s] / gb:.2f}' for s in st):>21}"
            line += "".join(f"  {' / '.join(f'{ms[(name, gpu)]:.2f}' for gpu in GPUS):>42}" for name in SETUPS)
            print(line)
            rows.append({"batch": batch, "context": context, "kv_gb": {f: round(v / gb, 3) for f, v in kv.items()},
                         "states_gb": {s: round(v / gb, 3) for s, v in st.items()},
                         "floor_ms": {f"{name} {gpu}": round(v, 3) for (name, gpu), v in ms.items()}})
    ratios = [r["floor_ms"]["NVFP4 + FP8 K/V H200"] / r["floor_ms"]["BF16 H200"] for r in rows]
    print(f"ratio: NVFP4 + FP8 K/V reads {min(ratios):.2f}-{max(ratios):.2f}x the bytes of BF16 over these batches and "
          "contexts (floor, not measured)")
    print(json.dumps({"bench": "decode_floor", "kind": "floor computed from bytes, not a measurement",
                      "bandwidth_tb_s": {g: b / 1e12 for g, b in GPUS.items()}, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
