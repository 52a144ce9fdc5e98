"""Single-process NVFP4 quantization: a SALA checkpoint in, a compressed-tensors checkpoint out.

    python -m sala.quant --output DIR                  # tiny-sala, GPTQ + FourOverSix
    python -m sala.quant --model DIR --output DIR --method rtn --scale-rule 6
    python -m sala.quant --model DIR --output DIR --calibration data.jsonl --num-samples 256

Layer by layer (each layer's Hessians come from inputs that already went through the quantized
layers before it), in this process, with the same functions the Ray pipeline
(pipelines/quantize.py) distributes. Prints a per-module table, writes the checkpoint
atomically, then evaluates what was written against the unquantized model on held-out text
(perplexity of both, mean KL, top-1 agreement).
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import torch

from sala.checkpoint import CheckpointError, ShardedTensors, load_model, read_config
from sala.eval import calibration as cal
from sala.eval.compare import compare_models, window_sequences
from sala.footprint import MemoryShortfall, gib, host_memory
from sala.model import SALAForCausalLM
from sala.process_exit import exit_now
from sala.quant.export import export_checkpoint
from sala.quant.layerwise import ModuleStats, quantize_model, quantized_module_names
from sala.quant.nvfp4 import GROUP_SIZE
from sala.tiny import ensure_tiny_sala, split_corpus, token_stream


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m sala.quant", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", help="SALA checkpoint directory (default: tiny-sala, built on first use)")
    ap.add_argument("--output", required=True, help="checkpoint directory to write")
    ap.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    ap.add_argument("--method", choices=["gptq", "rtn"], default="gptq")
    ap.add_argument("--scale-rule", choices=["6", "4over6"], default="4over6",
                    help="4over6: FourOverSix (each 16-block scaled to 4 or 6); 6: plain NVFP4")
    ap.add_argument("--act-order", action="store_true", help="GPTQ columns by descending Hessian diagonal")
    ap.add_argument("--damp", type=float, default=0.01, help="GPTQ dampening, fraction of the mean Hessian diagonal")
    ap.add_argument("--calibration", help="jsonl / parquet / a datasets.save_to_disk directory / a dataset name in the "
                    "local datasets cache (default: tiny-sala's training corpus plus generated code, Q&A and list rows)")
    ap.add_argument("--split", help="split of a DatasetDict given to --calibration (default: its only split)")
    ap.add_argument("--text-column", help="column holding the text (default: text, prompt, messages or content)")
    ap.add_argument("--num-samples", type=int, default=128, help="calibration rows")
    ap.add_argument("--seq-len", type=int, default=256, help="calibration and evaluation sequence length (tokens)")
    ap.add_argument("--eval-sequences", type=int, default=32, help="held-out sequences for perplexity and KL")
    args = ap.parse_args(argv)
    for name in ("num_samples", "seq_len", "eval_sequences"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if not args.damp > 0:
        ap.error("--damp must be positive")
    return args


def check_model(model_dir: Path) -> None:
    """Refuse, before loading any weight, what cannot be quantized: an already quantized
    checkpoint, or a Linear whose in-features do not split into NVFP4 groups."""
    config = read_config(model_dir)
    if getattr(config, "quantization_config", None):
        raise CheckpointError(f"{model_dir}: already quantized (config.json has a quantization_config); "
                              "quantize the unquantized checkpoint")
    with torch.device("meta"):
        model = SALAForCausalLM(config)
    for name in quantized_module_names(model):
        k = model.get_submodule(name).in_features
        if k % GROUP_SIZE:
            raise CheckpointError(f"{model_dir}: {name} has in-features {k}, not a multiple of the NVFP4 group size {GROUP_SIZE}")


def load_tokenizer(model_dir: Path):
    from sala import checkpoint

    try:
        return checkpoint.load_tokenizer(model_dir)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{model_dir}: no usable tokenizer ({e})") from e


def print_table(rows: list[ModuleStats]) -> None:
    print(f"{'layer':>5}  {'module':<20}{'M=4 share':>10}{'weight err':>12}{'output err':>12}{'seconds':>9}")
    for r in rows:
        print(f"{r.layer:>5}  {r.module:<20}{r.m4_share:>10.1%}{r.weight_error:>12.2e}{r.output_error:>12.2e}{r.seconds:>9.2f}")
    n = len(rows)
    print(f"{'mean':>5}  {'':<20}{sum(r.m4_share for r in rows) / n:>10.1%}"
          f"{sum(r.weight_error for r in rows) / n:>12.2e}{sum(r.output_error for r in rows) / n:>12.2e}")


def run(args) -> int:
    # Everything cheap that can fail is checked before the model is loaded.
    model_dir = Path(args.model) if args.model else ensure_tiny_sala()
    check_model(model_dir)
    output = Path(args.output).absolute()
    if output.exists() and not args.overwrite:
        raise FileExistsError(f"{output} exists; pass --overwrite to replace it")
    tokenizer = load_tokenizer(model_dir)
    seqs = cal.calibration_sequences(tokenizer, args.num_samples, args.seq_len, args.calibration, args.text_column,
                                     split=args.split)
    print(f"model       {model_dir}\noutput      {output}")
    print(f"method      {args.method}, scale rule {args.scale_rule}{', act-order' if args.act_order else ''}")
    print(f"calibration {len(seqs)} sequences x {args.seq_len} tokens "
          f"({args.calibration or 'default set'}, {args.num_samples} rows)\n")

    # In one process the model is held twice in fp32 (quantized in place, and the reference the
    # export reads): fine for tiny-sala, too much for the 9B, which pipelines/quantize.py streams.
    tensors = ShardedTensors(model_dir, verify=False)
    need = 2 * 4 * sum(math.prod(tensors.shape(name)) for name in tensors.names())
    if need > host_memory():
        raise MemoryShortfall(f"{model_dir}: this command holds the model twice in fp32, {gib(need)}, and this host has "
                              f"{gib(host_memory())} available; pipelines/quantize.py quantizes it one layer at a time")
    print(f"memory      {gib(need)}: the model twice in fp32\n")
    model = load_model(model_dir, dtype=torch.float32)
    reference = copy.deepcopy(model)
    t0 = time.time()
    quantized, rows = quantize_model(model, seqs, args.method, args.scale_rule, act_order=args.act_order,
                                     damp=args.damp)
    quantize_seconds = time.time() - t0
    print_table(rows)
    m4_share = sum(r.m4_share for r in rows) / len(rows)

    export_checkpoint(reference, quantized, output, tokenizer, scale_rule=args.scale_rule, method=args.method,
                      act_order=args.act_order, overwrite=args.overwrite,
                      producer={"name": "sala.quant", "args": dict(vars(args))},
                      metrics={"m4_share": m4_share, "quantize_seconds": quantize_seconds})

    # What was written, against the unquantized tensors as the checkpoint stores them (BF16),
    # so the comparison sees NVFP4 and nothing else.
    candidate = load_model(output, dtype=torch.float32)
    reference = reference.to(torch.bfloat16).float()
    _, heldout = split_corpus(10)
    windows = window_sequences(token_stream(tokenizer, heldout), args.seq_len, args.eval_sequences)
    q = compare_models(reference, candidate, windows)
    print(f"\nheld-out: {q['tokens']} tokens{'':<6}{'BF16':>10}{'NVFP4':>10}")
    print(f"{'perplexity':<28}{q['ppl_reference']:>10.3f}{q['ppl']:>10.3f}")
    print(f"mean KL(BF16 || NVFP4) {q['kl_mean']:.5f}   top-1 agreement {q['top1_agreement']:.2%}")
    print(f"checkpoint {output}   ({quantize_seconds:.1f} s quantizing)")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileExistsError, MemoryShortfall) as e:  # CheckpointError, DatasetError, degenerate Hessians
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    exit_now(main())
