"""Command line: `python -m sala generate` and `python -m sala verify`.

    python -m sala generate "def fib(n):"                 # tiny-sala, greedy
    python -m sala generate --model DIR --chat "What is a list?"
    python -m sala verify DIR                             # manifest sha256 + tensor check
"""
from __future__ import annotations

import argparse
import sys

from sala.checkpoint import (
    MANIFEST,
    CheckpointError,
    check_state_dict,
    load_model,
    load_state_dict,
    load_tokenizer,
    read_config,
    verify_manifest,
)
from sala.config import ConfigError
from sala.process_exit import exit_now


def resolve_model(path: str | None):
    """A checkpoint directory, or tiny-sala (built on first use) when none is given."""
    if path:
        return path
    from sala.tiny import ensure_tiny_sala

    return ensure_tiny_sala()


def cmd_generate(args) -> int:
    import torch

    from sala.hf import MiniCPMSALAForCausalLM

    path = resolve_model(args.model)
    model = MiniCPMSALAForCausalLM.sharing(load_model(path))  # transformers' generate()
    tok = load_tokenizer(path)
    text = args.prompt
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=True)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0)
    if args.temperature > 0:
        torch.manual_seed(args.seed)
        gen["temperature"] = args.temperature
    out = model.generate(**ids, **gen)
    print(tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
    return 0


def cmd_verify(args) -> int:
    import torch

    from sala.model import SALAForCausalLM

    config = read_config(args.model)
    verified = verify_manifest(args.model)
    state = load_state_dict(args.model, verify=False)
    if not getattr(config, "quantization_config", None):
        with torch.device("meta"):
            check_state_dict(SALAForCausalLM(config), state, args.model)
    if not verified:
        raise CheckpointError(f"{args.model}: no {MANIFEST}, so its files cannot be verified "
                              f"(config and {len(state)} tensors read fine)")
    print(f"{args.model}: ok ({len(state)} tensors, manifest verified)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sala", description="MiniCPM-SALA tools")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text from a checkpoint (default: tiny-sala)")
    g.add_argument("prompt")
    g.add_argument("--model", help="checkpoint directory (default: tiny-sala, built on first use)")
    g.add_argument("--max-new-tokens", type=int, default=48)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.set_defaults(fn=cmd_generate)
    v = sub.add_parser("verify", help="check a checkpoint's manifest, config and tensors")
    v.add_argument("model")
    v.set_defaults(fn=cmd_verify)
    args = ap.parse_args(argv)
    if getattr(args, "max_new_tokens", 1) <= 0:
        ap.error("--max-new-tokens must be positive")
    if getattr(args, "temperature", 0.0) < 0:
        ap.error("--temperature must be >= 0")
    try:
        return args.fn(args)
    except (CheckpointError, ConfigError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    exit_now(main())
