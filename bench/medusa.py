"""Medusa on held-out tiny-sala text: accept length, acceptance per depth, verify-step cost and
decode tokens/s with and without Medusa at batch 1, 4 and 16, measured in the same run.

    python pipelines/train_medusa.py                 # once: trains heads, prints the checkpoint
    python bench/medusa.py [--model CKPT] [--uniform CKPT_TRAINED_WITH_--weighting_uniform]

The baseline is the engine's own plain decode (compiled with inductor on CPU, CUDA graphs on
GPU); Medusa's verify step runs eagerly. Greedy, ignore_eos, the same prompts for both. Mean
accepted tokens per step counts the bonus token (plain decoding scores 1.00), as Spec-Bench.
Step times are of steps with no prompt work in them. Last line: JSON.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def held_out_prompts(tok, model_dir: Path, n: int, length: int = 32) -> list[list[int]]:
    from sala.tiny import heldout_texts

    stream = tok("\n\n".join(heldout_texts(model_dir)), verbose=False)["input_ids"]
    step = (len(stream) - length) // n
    return [stream[:1] + stream[1 + i * step : 1 + i * step + length] for i in range(n)]


def timed_generate(engine, prompts, max_tokens: int) -> dict:
    from sala.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    decode_time, decode_steps = 0.0, 0
    start = time.perf_counter()
    while engine.has_work():
        pure = not engine.scheduler.waiting and all(not r.prefilling for r in engine.scheduler.running)
        t0 = time.perf_counter()
        engine.step()
        if pure:
            decode_time += time.perf_counter() - t0
            decode_steps += 1
    wall = time.perf_counter() - start
    tokens = sum(len(r.output_ids) for r in reqs)
    return {"tokens_per_s": tokens / wall, "step_ms": 1e3 * decode_time / max(decode_steps, 1),
            "outputs": [r.output_ids for r in reqs]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint with medusa/ (default: the one pipelines/train_medusa.py writes for tiny-sala)")
    ap.add_argument("--uniform", help="the same heads trained with --weighting uniform, to compare accept length")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args(argv)
    import torch

    from sala.checkpoint import load_model
    from sala.engine import Engine
    from sala.medusa.heads import has_medusa, load_heads
    from sala.tiny import ensure_tiny_sala, sala_home

    torch.set_num_threads(1)
    path = Path(args.model) if args.model else sala_home() / "models" / f"{ensure_tiny_sala(progress=False).name}-medusa"
    if not has_medusa(path):
        print(f"error: {path} has no medusa/ heads; run python pipelines/train_medusa.py first", file=sys.stderr)
        return 2
    engine_plain = Engine.from_pretrained(path, medusa=False, device="cpu" if not torch.cuda.is_available() else None)
    tok, base = engine_plain.tokenizer, engine_plain.model
    heads = load_heads(path, base.config)
    prompts = held_out_prompts(tok, ensure_tiny_sala(progress=False), args.prompts)
    results, lossless = {}, True
    for b in args.batch:
        plain = Engine(copy.deepcopy(load_model(path)), tok, max_seqs=b)
        plain.warmup()
        spec_engine = Engine(copy.deepcopy(load_model(path)), tok, max_seqs=b, medusa=copy.deepcopy(heads))
        ps = (prompts * -(-b // len(prompts)))[: max(b, len(prompts))]
        p = timed_generate(plain, ps, args.max_tokens)
        m = timed_generate(spec_engine, ps, args.max_tokens)
        lossless &= p["outputs"] == m["outputs"]
        st = spec_engine.spec
        results[b] = {"plain_tokens_per_s": p["tokens_per_s"], "medusa_tokens_per_s": m["tokens_per_s"],
                      "speedup": m["tokens_per_s"] / p["tokens_per_s"], "plain_step_ms": p["step_ms"],
                      "verify_step_ms": m["step_ms"], "verify_over_decode": m["step_ms"] / p["step_ms"],
                      "accept_length": st.accept_length,
                      "acceptance_per_depth": [a / st.verify_steps for a in st.accepted_per_depth]}
        r = results[b]
        print(f"batch {b:>2}: {r['medusa_tokens_per_s']:.0f} vs {r['plain_tokens_per_s']:.0f} tokens/s = {r['speedup']:.2f}x; "
              f"accept length {r['accept_length']:.2f}; verify step {r['verify_step_ms']:.1f} ms / decode step "
              f"{r['plain_step_ms']:.1f} ms = {r['verify_over_decode']:.2f}x; acceptance per depth "
              + " ".join(f"{a:.2f}" for a in r["acceptance_per_depth"]), flush=True)
    out = {"bench": "medusa", "model": str(path), "tree_nodes": heads.tree.num_nodes - 1, "prompts": len(prompts),
           "max_tokens": args.max_tokens, "greedy_identical": lossless, "by_batch": results}
    if args.uniform:
        from sala.medusa.train import accept_length

        lengths = {}
        for name, ckpt in (("matched", path), ("uniform", Path(args.uniform))):
            e = Engine(load_model(path), tok, medusa=load_heads(ckpt, base.config), compile=False)
            lengths[name] = accept_length(e, prompts, args.max_tokens)
        out["accept_length_matched"], out["accept_length_uniform"] = lengths["matched"], lengths["uniform"]
        print(f"validation-matched vs uniform training rows: accept length {lengths['matched']:.2f} vs "
              f"{lengths['uniform']:.2f} = {lengths['matched'] / lengths['uniform']:.2f}x")
    print(f"greedy outputs identical with and without Medusa: {lossless}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
