"""Random-weight MiniCPM-SALA checkpoints at the released 9B model's widths, for measuring memory
and time at the real size without its weights.

The config is the released one (`sala.config.MINICPM_SALA_9B`: hidden 4096, FFN 16384, vocab
73,448, 32 heads, 2 KV heads in sparse layers) cut to its first N layers, so N=1 is one sparse
layer, N=2 sparse + lightning, and N=32 the whole 9B model (about 19 GB in BF16). Weights are
BF16: Linear and Embedding weights normal(0, INIT_STD), RMSNorm weights one. Each tensor is drawn
from sala.process_exit import exit_now
from its own generator, seeded from (seed, tensor name), so its values do not depend on the
order or sharding of the writing. Tensors are made one at a time in state_dict order and written
a shard at a time (`sala.checkpoint_files.save_state_dict`), so writing never holds more than a
shard (or one tensor larger than a shard) in memory.

The tokenizer has exactly the model's 73,448 ids, so every id the model can emit decodes: a
byte-level BPE without merges (text encodes a byte a token), MiniCPM's special tokens at their
ids (<unk> 0, <s> 1, </s> 2, <|im_end|> 73440, <|im_start|> 73441, <|tool_call|> 73442), the
256 bytes from id 3, and `<|reserved_ID|>` entries, which decode as that text, everywhere else.

    python -m sala.realwidth --layers 2                  # cached under $SALA_HOME/realwidth
    python -m sala.realwidth --layers 32 --output DIR    # the full 9B shape
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

from sala.config import MINICPM_SALA_9B, SALAConfig, default_generation_config
from sala.home import sala_home
from sala.process_exit import exit_now
from sala.tiny import CHAT_TEMPLATE, _file_lock

MAX_LAYERS = MINICPM_SALA_9B["num_hidden_layers"]
DTYPE = torch.bfloat16
# Measured on a forward of 2 x 64 random tokens through all 32 layers (streamed a layer at a time):
# with muP's scale_emb 12 the embedding output has RMS 0.24; every projection of a normalised
# input has RMS 0.02 x sqrt(4096) = 1.28, so the sigmoid gates stay unsaturated (|x| > 5 for 1 in
# 10^4); the residual stream grows as sqrt(depth), to RMS 3.8 after layer 32; logits are finite
# with RMS 0.08 (after muP's division by hidden / dim_model_base = 16): near-uniform, each of the 128
# positions with its own argmax. N=1 and N=2 (residual scale 1.4 / sqrt(N)) end at RMS 3.7 with the same logits.
INIT_STD = 0.02
MAX_SHARD_BYTES = 2 << 30
SPECIAL_TOKENS = {0: "<unk>", 1: "<s>", 2: "</s>", 73440: "<|im_end|>", 73441: "<|im_start|>", 73442: "<|tool_call|>"}
FIRST_BYTE_ID = 3

# Everything that decides what is written, beside the config: the hash of this and the config
# names the cached directory, so a change here writes a new one. `format` counts changes to the
# code that this dict does not show.
RECIPE = {
    "format": 1,
    "dtype": str(DTYPE).removeprefix("torch."),
    "init": {"linear_and_embedding": f"normal(0, {INIT_STD})", "rmsnorm": "ones",
             "generator": "torch.Generator per tensor, seeded by sha256('{seed}/{name}')[:8] little-endian"},
    "tokenizer": {"special_tokens": SPECIAL_TOKENS, "first_byte_id": FIRST_BYTE_ID, "reserved": "<|reserved_{id}|>",
                  "merges": 0, "bos_prepended": True, "chat_template": CHAT_TEMPLATE},
}


def realwidth_config(num_layers: int) -> SALAConfig:
    """The released config with its first `num_layers` layers. The remote-code map is left out:
    the directory holds no modeling code."""
    if not 1 <= num_layers <= MAX_LAYERS:
        raise ValueError(f"num_layers must be 1..{MAX_LAYERS} (the released model's layers), got {num_layers}")
    released = {k: v for k, v in MINICPM_SALA_9B.items() if k not in ("auto_map", "transformers_version", "model_type")}
    return SALAConfig(**{**released, "num_hidden_layers": num_layers, "mixer_types": released["mixer_types"][:num_layers]})


def parameter_specs(config: SALAConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, init) for every tensor of SALAForCausalLM(config), in state_dict order,
    read from the model built on the meta device (no storage). init is "normal" or "ones"."""
    from torch import nn

    from sala.model import RMSNorm, SALAForCausalLM

    with torch.device("meta"):
        model = SALAForCausalLM(config)
    init = {}
    for prefix, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            if isinstance(module, RMSNorm) and name == "weight":
                init[full] = "ones"
            elif isinstance(module, (nn.Linear, nn.Embedding)) and name == "weight":
                init[full] = "normal"
            else:
                raise TypeError(f"{full}: no initialisation rule for a {type(module).__name__}.{name}")
    return {name: (tuple(t.shape), init[name]) for name, t in model.state_dict().items()}


def tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little")


def make_tensor(name: str, shape: tuple[int, ...], init: str, seed: int) -> torch.Tensor:
    """One tensor's values: a function of (seed, name, shape, init) only."""
    if init == "ones":
        return torch.ones(shape, dtype=DTYPE)
    g = torch.Generator().manual_seed(tensor_seed(seed, name))
    return torch.empty(shape, dtype=DTYPE).normal_(0.0, INIT_STD, generator=g)


def realwidth_tokenizer(vocab_size: int = MINICPM_SALA_9B["vocab_size"], model_max_length: int = MINICPM_SALA_9B["max_position_embeddings"]):
    """A PreTrainedTokenizerFast with exactly `vocab_size` ids (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [f"<|reserved_{i}|>" for i in range(vocab_size)]
    for i, t in SPECIAL_TOKENS.items():
        tokens[i] = t
    for byte, char in bytes_to_unicode().items():  # the ByteLevel alphabet, in byte order
        tokens[FIRST_BYTE_ID + byte] = char
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[], unk_token=SPECIAL_TOKENS[0]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # BOS is prepended, as MiniCPM's tokenizer does (add_bos_token true).
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[1],
        eos_token=SPECIAL_TOKENS[2],
        unk_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[2],
        additional_special_tokens=[SPECIAL_TOKENS[i] for i in (73440, 73441, 73442)],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )


def write_realwidth(target: str | Path, num_layers: int, *, seed: int = 0, max_shard_bytes: int = MAX_SHARD_BYTES,
                    overwrite: bool = False, progress: bool = False) -> Path:
    """Write the `num_layers`-layer checkpoint into `target` atomically (config, generation
    config, weights, tokenizer, manifest); a tqdm bar over the weight bytes on stderr if `progress`."""
    from sala.checkpoint_files import write_checkpoint

    config = realwidth_config(num_layers)
    specs = parameter_specs(config)
    producer = {"name": "sala.realwidth", "num_layers": num_layers, "seed": seed, "recipe_hash": recipe_hash(num_layers)}
    return write_checkpoint(target, config, _tensors(specs, seed, progress), default_generation_config(config),
                            realwidth_tokenizer(config.vocab_size, config.max_position_embeddings),
                            overwrite=overwrite, producer=producer, max_shard_bytes=max_shard_bytes)


def _tensors(specs: dict[str, tuple[tuple[int, ...], str]], seed: int, progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from tqdm import tqdm

    total = sum(_nbytes(shape) for shape, _ in specs.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="random weights", disable=not progress, file=sys.stderr) as bar:
        for name, (shape, init) in specs.items():
            yield name, make_tensor(name, shape, init, seed)
            bar.update(_nbytes(shape))
    if progress:
        print(f"last shard, tokenizer, then the manifest's sha256 of {total / 1e9:.1f} GB", file=sys.stderr, flush=True)


def _nbytes(shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPE.itemsize


def recipe_hash(num_layers: int) -> str:
    config = realwidth_config(num_layers).to_dict()
    config.pop("transformers_version")
    key = {"recipe": RECIPE, "config": config, "torch": torch.__version__.split("+")[0]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def realwidth_path(num_layers: int, seed: int = 0) -> Path:
    return sala_home() / "realwidth" / f"minicpm-sala-{num_layers}L-s{seed}-{recipe_hash(num_layers)}"


def ensure_realwidth(num_layers: int, seed: int = 0, progress: bool = True) -> Path:
    """Path of the cached checkpoint, writing it first if needed (one writer at a time)."""
    target = realwidth_path(num_layers, seed)
    if (target / "manifest.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    waiting = f"another process is writing {target.name}; waiting for it" if progress else None
    with _file_lock(target.parent / f".{target.name}.lock", waiting):
        if not (target / "manifest.json").exists():
            if progress:
                gb = sum(_nbytes(shape) for shape, _ in parameter_specs(realwidth_config(num_layers)).values()) / 1e9
                print(f"writing a random-weight {num_layers}-layer MiniCPM-SALA ({gb:.1f} GB) into {target}",
                      file=sys.stderr, flush=True)
            write_realwidth(target, num_layers, seed=seed, overwrite=True, progress=progress)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sala.realwidth", description=__doc__.split("\n\n")[0],
                                 epilog="Prints the path, then one JSON line: path, layers, parameters, bytes (of the "
                                        "weights), shards, seconds.")
    ap.add_argument("--layers", type=int, required=True, help=f"decoder layers, 1..{MAX_LAYERS} ({MAX_LAYERS}: the whole 9B model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", type=Path, help="write here instead of the cache under $SALA_HOME/realwidth")
    ap.add_argument("--shard-gb", type=float, help=f"largest shard in GiB (with --output; default {MAX_SHARD_BYTES / (1 << 30):g})")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    args = ap.parse_args(argv)
    problem = None
    if not 1 <= args.layers <= MAX_LAYERS:
        problem = f"--layers must be 1..{MAX_LAYERS}, got {args.layers}"
    elif args.shard_gb is not None and (args.output is None or args.shard_gb <= 0):
        problem = "--shard-gb needs --output and a positive size"
    elif args.output is not None and args.output.exists() and not args.overwrite:
        problem = f"{args.output} exists (pass --overwrite to replace it)"
    if problem:
        print(f"{ap.prog}: error: {problem}", file=sys.stderr)
        return 2

    from sala.checkpoint_files import weight_files

    t0 = time.perf_counter()
    if args.output is None:
        path = ensure_realwidth(args.layers, args.seed)
    else:
        shard = int(args.shard_gb * (1 << 30)) if args.shard_gb else MAX_SHARD_BYTES
        path = write_realwidth(args.output, args.layers, seed=args.seed, max_shard_bytes=shard, overwrite=args.overwrite,
                               progress=True)
    parameters = sum(math.prod(shape) for shape, _ in parameter_specs(realwidth_config(args.layers)).values())
    print(path)
    print(json.dumps({"path": str(path), "layers": args.layers, "parameters": parameters, "bytes": parameters * DTYPE.itemsize,
                      "shards": len(weight_files(path)), "seconds": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    exit_now(main())
