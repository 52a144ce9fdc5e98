"""Decode throughput: the engine vs transformers' generate() on the same tiny-sala weights.

Greedy, batch 1 and 8, prompts of equal length (so generate() needs no padding) and a fixed
number of new tokens for both (min_new_tokens / ignore_eos), measured in the same run; the
time covers prefill and decode, as a client sees it. The engine is timed in its default
batch-invariant mode and without it (the cost of determinism). Also checks that both produce
the same tokens.

    python bench/engine_decode.py [--new-tokens 64] [--prompt-tokens 32] [--threads 1]
"""
import argparse
import json
import time

import torch

from sala.checkpoint import load_model
from sala.engine import Engine, SamplingParams
from sala.tiny import ensure_tiny_sala, heldout_texts


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (tiny-sala's matmuls are too small for more)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = ensure_tiny_sala()
    model = load_model(path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    texts = [t for t in heldout_texts(path) if len(tok(t)["input_ids"]) >= args.prompt_tokens]
    prompts = [tok(t)["input_ids"][: args.prompt_tokens] for t in texts[: max(args.batches)]]
    n = args.new_tokens
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    rows, result = [], {"new_tokens": n, "prompt_tokens": args.prompt_tokens, "threads": args.threads}
    for b in args.batches:
        ids = torch.tensor(prompts[:b])

        def hf():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=model.config.pad_token_id)

        engines = {"engine": Engine(model, tok), "engine (batch_invariant=False)": Engine(model, tok, batch_invariant=False)}
        hf_tokens = hf()[:, args.prompt_tokens:].tolist()  # also the warm-up
        t_hf = best_of(hf, args.repeat)
        rows.append((b, "transformers generate()", b * n / t_hf, 1.0, ""))
        for name, engine in engines.items():
            out = engine.generate(prompts[:b], params)  # warm-up
            same = sum(o.token_ids == h for o, h in zip(out, hf_tokens))
            t = best_of(lambda: engine.generate(prompts[:b], params), args.repeat)
            rows.append((b, name, b * n / t, t_hf / t, f"{same}/{b} sequences identical to generate()"))
            key = "engine" if name == "engine" else "engine_not_invariant"
            result[f"b{b}_{key}_tok_s"] = round(b * n / t, 1)
            result[f"b{b}_{key}_ratio"] = round(t_hf / t, 3)
        result[f"b{b}_hf_tok_s"] = round(b * n / t_hf, 1)

    print(f"\ntiny-sala greedy decode, {args.prompt_tokens}-token prompts, {n} new tokens, {args.threads} thread(s)")
    print(f"{'batch':>5}  {'implementation':<32} {'tokens/s':>10} {'vs generate()':>14}  check")
    for b, name, tps, ratio, note in rows:
        print(f"{b:>5}  {name:<32} {tps:>10.1f} {ratio:>13.2f}x  {note}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
