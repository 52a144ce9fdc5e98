"""Weight MSE of four NVFP4 variants on every quantized Linear of tiny-sala, and the share of
16-blocks FourOverSix scales to 4, per module type.

    python bench/quant_mse.py [--num-samples 128] [--seq-len 256]

Variants: RTN and GPTQ, each with plain NVFP4 (every block's max scaled to 6, "M6") and with
FourOverSix ("4/6"), quantized layer by layer exactly as `python -m sala.quant` does. MSE is
on the weights themselves; GPTQ trades weight error for output error on the calibration
inputs, so the relative output error is shown beside it. lm_head and the embeddings stay BF16
and are not listed.
"""
import argparse
import copy
import json

import torch
from transformers import AutoTokenizer

from sala.checkpoint import load_model
from sala.eval.calibration import calibration_sequences
from sala.quant.layerwise import quantize_model
from sala.tiny import ensure_tiny_sala

VARIANTS = {"RTN-M6": ("rtn", "6"), "RTN-4/6": ("rtn", "4over6"), "GPTQ-M6": ("gptq", "6"), "GPTQ-4/6": ("gptq", "4over6")}
BASE = "RTN-M6"
TYPES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "z_proj": "z", "o_gate": "o_gate",
         "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
MLP_TYPES = {"gate", "up", "down"}


def module_type(name: str) -> str:
    return TYPES[name.rsplit(".", 1)[1]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-samples", type=int, default=128, help="calibration rows (the CLI's default)")
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()

    model_dir = ensure_tiny_sala()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    seqs = calibration_sequences(tokenizer, args.num_samples, args.seq_len)
    reference = load_model(model_dir, dtype=torch.float32)
    weights = {n: m.weight.detach() for n, m in reference.named_modules() if isinstance(m, torch.nn.Linear)}

    # module -> variant -> sum of squared weight errors / relative output error / M=4 blocks
    sq_err: dict[str, dict[str, float]] = {}
    out_err: dict[str, dict[str, float]] = {}
    m4_blocks: dict[str, dict[str, int]] = {}
    for variant, (method, rule) in VARIANTS.items():
        quantized, stats = quantize_model(copy.deepcopy(reference), seqs, method, rule)
        for s in stats:
            out_err.setdefault(f"model.layers.{s.layer}.{s.module}", {})[variant] = s.output_error
        for name, q in quantized.items():
            sq_err.setdefault(name, {})[variant] = (q.dequantize() - weights[name]).square().sum().item()
            m4_blocks.setdefault(name, {})[variant] = int(q.m4_mask.sum())
    names = list(sq_err)
    numel = {n: weights[n].numel() for n in names}
    # The 4-or-6 choice is fixed from the original weight before GPTQ runs: identical for RTN.
    assert all(m4_blocks[n]["GPTQ-4/6"] == m4_blocks[n]["RTN-4/6"] for n in names)
    blocks = {n: numel[n] // 16 for n in names}

    print(f"NVFP4 weight MSE on tiny-sala's {len(names)} quantized Linears; calibration "
          f"{len(seqs)} x {args.seq_len} tokens, {torch.get_num_threads()} CPU threads")
    print(f"\n{'module':<34}{'MSE ' + BASE:>13}" + "".join(f"{v + ' x':>12}" for v in VARIANTS if v != BASE)
          + f"{'M=4 share':>11}")
    for n in names:
        base = sq_err[n][BASE]
        print(f"{n:<34}{base / numel[n]:>13.3e}" + "".join(f"{sq_err[n][v] / base:>12.3f}" for v in VARIANTS if v != BASE)
              + f"{m4_blocks[n]['RTN-4/6'] / blocks[n]:>11.1%}")

    def summary(label, members):
        total = sum(numel[n] for n in members)
        mse = {v: sum(sq_err[n][v] for n in members) / total for v in VARIANTS}
        out = {v: sum(out_err[n][v] for n in members) / len(members) for v in VARIANTS}
        share = sum(m4_blocks[n]["RTN-4/6"] for n in members) / sum(blocks[n] for n in members)
        return {"type": label, "modules": len(members), "mse": mse, "mse_ratio": {v: mse[v] / mse[BASE] for v in VARIANTS},
                "output_error": out, "output_error_ratio": {v: out[v] / out[BASE] for v in VARIANTS}, "m4_share": share}

    kinds = sorted({module_type(n) for n in names}, key=list(TYPES.values()).index)
    rows = [summary(t, [n for n in names if module_type(n) == t]) for t in kinds]
    rows += [summary("attention", [n for n in names if module_type(n) not in MLP_TYPES]),
             summary("mlp", [n for n in names if module_type(n) in MLP_TYPES]),
             summary("all", names)]
    others = [v for v in VARIANTS if v != BASE]
    print(f"\nper module type: weight MSE (x {BASE}), mean relative output error on the calibration inputs (x {BASE})")
    print(f"{'type':<10}{'n':>4}{'MSE ' + BASE:>13}" + "".join(f"{v + ' x':>12}" for v in others)
          + f"{'out ' + BASE:>12}" + "".join(f"{'out ' + v + ' x':>15}" for v in others) + f"{'M=4 share':>11}")
    for r in rows:
        print(f"{r['type']:<10}{r['modules']:>4}{r['mse'][BASE]:>13.3e}" + "".join(f"{r['mse_ratio'][v]:>12.3f}" for v in others)
              + f"{r['output_error'][BASE]:>12.3e}" + "".join(f"{r['output_error_ratio'][v]:>15.3f}" for v in others)
              + f"{r['m4_share']:>11.1%}")
    print(json.dumps({
        "bench": "quant_mse", "model": model_dir.name, "calibration_sequences": len(seqs), "seq_len": args.seq_len,
        "linears": len(names), "base": BASE,
        "by_type": [{"type": r["type"], "modules": r["modules"], "m4_share": round(r["m4_share"], 4),
                     "mse": {v: float(f"{x:.4e}") for v, x in r["mse"].items()},
                     "mse_ratio": {v: round(x, 4) for v, x in r["mse_ratio"].items()},
                     "output_error_ratio": {v: round(x, 4) for v, x in r["output_error_ratio"].items()}}
                    for r in rows],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
