"""Engine decode on a CUDA GPU with the real 9B config and random weights, BF16 and NVFP4.

    python bench/engine_gpu.py [--batches 1 8 32] [--new-tokens 64] [--prompt-tokens 128]

The model is MiniCPM-SALA's architecture at full size (sala.config.MINICPM_SALA_9B, the released
config.json) with random weights: throughput does not depend on the values. BF16 first; then
every decoder Linear is RTN-quantized to packed NVFP4 in place (the W4A16 Triton kernels,
split-K at small batch) and measured again. Greedy, fixed lengths (ignore_eos), time from
submission to the last token, decode steps replayed from the engine's CUDA graphs. Reference
in the same run: the same BF16 model's eager decode step (engine compile=False), so the ratio
is what graphs and kernels buy. Each decode step's time (a run of --new-tokens less a run of
one token, per step) is also printed as a fraction of its floor: bench/decode_floor.py's bytes
at this device's peak bandwidth.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decode_floor import floor_ms  # noqa: E402  (bench/ is this script's sys.path[0])
from nvfp4_gemm_gpu import peak_bandwidth_gbps, require_gpu  # noqa: E402


def word_tokenizer(vocab_size: int):
    """A real (word-level) tokenizer over the model's vocabulary: random weights emit any id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t2", pad_token="t2")


def random_model(config):
    from sala.model import SALAForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = SALAForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.eval()


def quantize_in_place(model) -> None:
    from sala.quant.layerwise import apply_quantized, layer_modules
    from sala.quant.nvfp4 import quantize_rtn

    for layer in model.model.layers:
        results = {name: quantize_rtn(layer.get_submodule(name).weight.detach().float(), "6") for name in layer_modules(layer)}
        apply_quantized(layer, results, packed=True)
    torch.cuda.empty_cache()


def decode_tok_s(engine, batches, prompt_tokens: int, new_tokens: int) -> tuple[dict[int, float], dict[int, float]]:
    """Per batch size: tokens/s from submission to the last token, and the decode step's ms (the
    time of new_tokens tokens less that of one, over new_tokens - 1 steps: prefill cancels out)."""
    from sala.engine import SamplingParams

    g = torch.Generator().manual_seed(1)
    tok_s, step_ms = {}, {}
    for b in batches:
        prompts = torch.randint(3, engine.model.config.vocab_size, (b, prompt_tokens), generator=g).tolist()
        seconds = {}
        for n in (new_tokens, 1):
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            engine.generate(prompts, params)  # warm-up (graph capture on the first call)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.generate(prompts, params)
            torch.cuda.synchronize()
            seconds[n] = time.perf_counter() - t0
        tok_s[b] = b * new_tokens / seconds[new_tokens]
        step_ms[b] = (seconds[new_tokens] - seconds[1]) / (new_tokens - 1) * 1e3
    return tok_s, step_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    args = ap.parse_args()
    require_gpu(__file__, "bench/engine_decode.py measures the engine on CPU")
    from sala.config import MINICPM_SALA_9B, SALAConfig
    from sala.engine import Engine

    config = SALAConfig(**MINICPM_SALA_9B)
    tok = word_tokenizer(config.vocab_size)
    model = random_model(config)
    settings = dict(max_seqs=max(args.batches), max_model_len=8192)
    rows, result = [], {"device": torch.cuda.get_device_name(), "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens}
    eager, _ = decode_tok_s(Engine(model, tok, compile=False, **settings), args.batches, args.prompt_tokens, args.new_tokens)
    context = args.prompt_tokens + args.new_tokens // 2  # the mean context of the decode steps
    bandwidth = peak_bandwidth_gbps() * 1e9
    for kind in ("bf16", "nvfp4"):
        if kind == "nvfp4":
            quantize_in_place(model)
        engine = Engine(model, tok, **settings)
        got, step_ms = decode_tok_s(engine, args.batches, args.prompt_tokens, args.new_tokens)
        for b in args.batches:
            # The engine's default plan: K/V in the model's dtype, fp32 states.
            floor = floor_ms(config, b, context, (kind, "bf16", "fp32"), bandwidth)
            rows.append((kind, b, got[b], got[b] / eager[b], step_ms[b], floor / step_ms[b]))
            result[f"{kind}_b{b}_tok_s"] = round(got[b], 1)
            result[f"{kind}_b{b}_vs_bf16_eager"] = round(got[b] / eager[b], 3)
            result[f"{kind}_b{b}_step_ms"] = round(step_ms[b], 3)
            result[f"{kind}_b{b}_floor_fraction"] = round(floor / step_ms[b], 3)
        result[f"{kind}_graph_capture_s"] = round(engine.compile_seconds or 0.0, 1)
        del engine
        torch.cuda.empty_cache()
    print(f"\n9B config, random weights, {torch.cuda.get_device_name()}: greedy decode, {args.prompt_tokens}-token prompts, "
          f"{args.new_tokens} new tokens")
    print(f"{'weights':<10} {'batch':>5} {'tokens/s':>10} {'vs BF16 eager':>14} {'step ms':>8} {'of floor':>9}  "
          "(floor: bench/decode_floor.py's bytes at this device's peak bandwidth)")
    for b in args.batches:
        print(f"{'bf16 eager':<10} {b:>5} {eager[b]:>10.1f} {1.0:>13.2f}x")
    for kind, b, tps, ratio, ms, fraction in rows:
        print(f"{kind:<10} {b:>5} {tps:>10.1f} {ratio:>13.2f}x {ms:>8.2f} {fraction:>8.0%}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
