"""Accuracy jitter: how much a request's logprobs move with what else the engine is doing.

    python bench/jitter.py [--dtype bfloat16] [--compile] [--new-tokens 16]

A logprob score is only a quality gate if it does not move between runs. Each case below runs
tiny-sala's engine on held-out text and compares every request's logprobs (teacher-forced
prompt logprobs from position 1, then the greedy tokens' logprobs up to the first token where
the two runs decode differently) with the same request's in a reference run:

- repeat: the same requests sent twice to one engine (the second time its prefix cache holds
  them), and to a fresh engine;
- batch 8 / batch 32: 32 prompts sent 1 at a time (the reference), then in batches of 8 and 32;
- interleaved: 32 requests joining an engine while 8 others decode (continuous batching);
- preempted: the 32 requests at once in a pool of 12 pages of 16 tokens, so requests are
  preempted and recompute their prompt and the tokens they had generated;
- chunk cuts: prompts of 230-530 tokens prefilled whole (the reference) and with token budgets
  of 512, 256 and 128 per step (cut into chunks at other positions, sharing steps).

Each case runs in the fast mode (batch_invariant=False; eager unless --compile) and in the
evaluation mode (batch_invariant=True). The evaluation mode must give exactly 0 everywhere; the
fast mode's figure is its measured jitter. Ratio line: evaluation / fast max |delta logprob| (0
is the target) and the evaluation mode's time relative to the fast mode's. Last line: JSON.
"""
import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sala.checkpoint import load_model  # noqa: E402
from sala.engine import Engine, SamplingParams  # noqa: E402
from sala.tiny import ensure_tiny_sala, heldout_texts  # noqa: E402

CHUNK_BUDGETS = (512, 256, 128)
SMALL_POOL_PAGES, PAGE = 12, 16


def small_pool_bytes(model, max_seqs: int) -> int:
    """A memory budget of SMALL_POOL_PAGES pages and max_seqs states: too few pages for everyone."""
    from sala.engine.memory import kv_bytes_per_token, state_bytes_per_seq
    from sala.kv import default_plan

    plan = default_plan(model.config, next(model.parameters()).dtype)
    return SMALL_POOL_PAGES * PAGE * kv_bytes_per_token(model.config, plan) + max_seqs * state_bytes_per_seq(model.config, plan)


def logprob_trace(c) -> tuple[list[float], list[int]]:
    """A completion's prompt logprobs, then its generated tokens' logprobs; and its tokens."""
    return [e.logprob for e in c.prompt_logprobs] + [e.logprob for e in c.logprobs], list(c.token_ids)


def max_delta(ref: list, got: list) -> tuple[float, int]:
    """Max |delta logprob| over requests, compared up to where their greedy tokens part; and how
    many requests decoded differently."""
    worst, parted = 0.0, 0
    for (lp_a, tok_a), (lp_b, tok_b) in zip(ref, got):
        same = next((i for i, (x, y) in enumerate(zip(tok_a, tok_b)) if x != y), min(len(tok_a), len(tok_b)))
        parted += same < max(len(tok_a), len(tok_b))
        n = len(lp_a) - len(tok_a) + same  # past that the two runs score different tokens
        worst = max(worst, max((abs(x - y) for x, y in zip(lp_a[:n], lp_b[:n])), default=0.0))
    return worst, parted


def interleaved(engine: Engine, first: list, joiners: list, params) -> list:
    """`first` start decoding; `joiners` arrive a few steps later, while they still run."""
    reqs = [engine.add_request(p, params) for p in first]
    for _ in range(3):
        engine.step()
    reqs += [engine.add_request(p, params) for p in joiners]
    while engine.has_work():
        engine.step()
    return [r.completion() for r in reqs]


def run_mode(model, tokenizer, prompts, long_prompts, params, invariant: bool, compile_: bool) -> tuple[dict, float]:
    def engine(**kw):
        return Engine(copy.deepcopy(model), tokenizer, batch_invariant=invariant, compile=compile_ and not invariant,
                      max_seqs=32, **kw)

    def traces(completions):
        return [logprob_trace(c) for c in completions]

    t0 = time.perf_counter()
    e = engine()
    alone = traces([e.generate([p], params)[0] for p in prompts])
    out = {}
    out["repeat (same engine)"] = max_delta(alone, traces([e.generate([p], params)[0] for p in prompts]))
    out["repeat (fresh engine)"] = max_delta(alone, traces([engine().generate([p], params)[0] for p in prompts]))
    out["batch 8"] = max_delta(alone, traces(sum((engine().generate(prompts[i:i + 8], params) for i in range(0, 32, 8)), [])))
    out["batch 32"] = max_delta(alone, traces(engine().generate(prompts, params)))
    others = [p[::-1] for p in prompts[:8]]  # different requests sharing the steps
    out["interleaved"] = max_delta(alone, traces(interleaved(engine(), others, prompts, params)[8:]))
    small = engine(page_size=PAGE, max_model_len=128, memory_bytes=small_pool_bytes(model, 32))
    out["preempted"] = max_delta(alone, traces(small.generate(prompts, params)))
    assert small.num_preemptions > 0, "the small pool preempted no request"
    print(f"{'evaluation' if invariant else 'fast'} mode: {small.num_preemptions} preemptions in the small pool",
          file=sys.stderr, flush=True)
    whole = traces(engine(max_batch_tokens=1024).generate(long_prompts, params))
    for budget in CHUNK_BUDGETS:
        out[f"chunk cuts ({budget}/step)"] = max_delta(whole, traces(engine(max_batch_tokens=budget).generate(long_prompts,
                                                                                                              params)))
    return out, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights and activations")
    ap.add_argument("--compile", action="store_true", help="the fast mode's decode step compiled (the engine's default)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = ensure_tiny_sala(progress=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_model(model_dir, dtype=getattr(torch, args.dtype))
    stream = tokenizer("\n\n".join(heldout_texts(model_dir)))["input_ids"]
    prompts = [stream[:1] + stream[1 + 101 * i: 24 + 101 * i + (13 * i) % 80] for i in range(32)]  # 24-103 tokens
    long_prompts = [stream[:1] + stream[4000 + 700 * i: 4000 + 700 * i + n] for i, n in enumerate((300, 530, 230, 420))]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True, logprobs=5, prompt_logprobs_start=1)
    results, seconds = {}, {}
    for name, invariant in (("fast", False), ("evaluation", True)):
        results[name], seconds[name] = run_mode(model, tokenizer, prompts, long_prompts, params, invariant, args.compile)
        print(f"{name} mode done in {seconds[name]:.1f} s", file=sys.stderr, flush=True)
    fast_label = "fast (compiled)" if args.compile else "fast (eager)"
    print(f"tiny-sala {args.dtype}, {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{len(long_prompts)} long prompts of {min(map(len, long_prompts))}-{max(map(len, long_prompts))}, "
          f"{args.new_tokens} greedy tokens each; max |delta logprob| vs the reference run (requests that decoded "
          "differently)")
    print(f"{'case':<24}{fast_label:>24}{'evaluation':>20}")
    for case in results["fast"]:
        (f, fp), (v, vp) = results["fast"][case], results["evaluation"][case]
        print(f"{case:<24}{f:>17.2e} ({fp:>2}){v:>13.2e} ({vp:>2})")
    fast_max = max(d for d, _ in results["fast"].values())
    eval_max = max(d for d, _ in results["evaluation"].values())
    ratio = eval_max / fast_max if fast_max else float("nan")
    print(f"ratio: evaluation / fast max |delta logprob| = {eval_max:.2e} / {fast_max:.2e} = {ratio:.3g} (target 0); "
          f"evaluation mode time {seconds['evaluation']:.1f} s vs fast {seconds['fast']:.1f} s = "
          f"{seconds['evaluation'] / seconds['fast']:.2f}x")
    print(json.dumps({"bench": "jitter", "dtype": args.dtype, "fast_compiled": args.compile,
                      "max_delta": {m: {c: d for c, (d, _) in r.items()} for m, r in results.items()},
                      "diverged": {m: {c: p for c, (_, p) in r.items()} for m, r in results.items()},
                      "eval_over_fast": ratio, "eval_bitwise_stable": eval_max == 0.0,
                      "seconds": {m: round(s, 2) for m, s in seconds.items()}}))
    return 0 if eval_max == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
