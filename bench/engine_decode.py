"""Decode throughput: the engine vs transformers' generate() on the same tiny-sala weights.

Four measurements, all in this run:

1. Greedy decode at batch 1 and 8: prompts of equal length (generate() needs no padding), a
   fixed number of new tokens for both (min_new_tokens / ignore_eos); time covers prefill and
   decode, as a client sees it. The engine runs eager, compiled (the default) and in the
   evaluation mode (batch_invariant=True: the cost of determinism). Tokens are checked equal.
2. A serving-shaped workload: 64 requests with prompt lengths 8..256 and max_tokens 8..128
   drawn from a fixed seed, all submitted at once to the engine, vs generate() over
   left-padded batches of 8 in the same order (each batch runs to its longest max_tokens;
   only the tokens requested count). Tokens are compared with generate()'s per request.
3. Ops per decode step (profiler events): generate()'s model call, the engine's eager step,
   the compiled step.
4. Host time per decode step outside the model's forward (scheduling, building the step
   context, sampling, emitting) at batch 1, 8 and 64: a compiled engine's step time less the
   time in its compiled forward, median over 16 steps. On a GPU the forward is the device's
   work; this is what must stay well under it (a 9B NVFP4 step reads ~6 GB: ~1.3 ms on an H200).

    python bench/engine_decode.py [--new-tokens 64] [--prompt-tokens 32] [--threads 2] [--only host]
"""
import argparse
import json
import random
import time

import torch

from sala.checkpoint import load_model
from sala.engine import Engine, SamplingParams
from sala.hf import MiniCPMSALAForCausalLM
from sala.tiny import ensure_tiny_sala, heldout_texts


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def hf_generate(model, batch: list[list[int]], n: int) -> list[list[int]]:
    """Left-padded greedy generate(); each row's first n new tokens."""
    width = max(map(len, batch))
    pad = model.config.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad)
    return out[:, width:].tolist()


def count_ops(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def engine_decode_step_ops(engine, prompt: list[int], batch: int) -> tuple[int, int]:
    """aten ops of one decode step of `batch` requests: eager forward, then through the compiled step."""
    reqs = [engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)) for _ in range(batch)]
    engine.step()
    engine.step()  # one decode step, so the compiled graph exists
    with torch.inference_mode():
        ids, ctx = engine.decoding.inputs(list(engine.scheduler.running))
        eager = count_ops(lambda: engine.runner.forward(ids, ctx))
        compiled = count_ops(lambda: engine.decoding.fast_decode(ids, ctx))
    for r in reqs:
        engine.cancel(r)
    engine.step()
    return eager, compiled


def host_ms_outside_forward(engine, prompt: list[int], batch: int, steps: int = 16) -> float:
    """Median ms of a pure decode step of `batch` requests spent outside the compiled forward."""
    fast = engine.decoding.fast_decode
    inner, spent = fast.launch, []

    def timed(graph, leaves):
        t0 = time.perf_counter()
        out = inner(graph, leaves)
        spent.append(time.perf_counter() - t0)
        return out

    fast.launch = timed
    reqs = [engine.add_request(prompt, SamplingParams(max_tokens=2 * steps + 8, temperature=0, ignore_eos=True))
            for _ in range(batch)]
    outside = []
    try:
        while len(outside) < steps and engine.has_work():
            spent.clear()
            t0 = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t0
            if len(spent) == 1:  # a pure decode step: one compiled forward
                outside.append(total - spent[0])
    finally:
        del fast.launch  # the class's again
        for r in reqs:
            engine.cancel(r)
        while engine.has_work():
            engine.step()
    return 1e3 * sorted(outside)[len(outside) // 2]


@torch.inference_mode()
def hf_decode_step_ops(model, prompt: list[int], batch: int) -> int:
    ids = torch.tensor([prompt] * batch)
    out = model(ids, use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    return count_ops(lambda: model(nxt, past_key_values=out.past_key_values, use_cache=True))


def serving_workload(rng: random.Random, stream: list[int], n: int = 64):
    reqs = []
    for _ in range(n):
        length, start = rng.randint(8, 256), rng.randint(1, len(stream) - 257)
        reqs.append((stream[:1] + stream[start : start + length - 1], rng.randint(8, 128)))
    return reqs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64, help="requests in the serving-shaped workload")
    ap.add_argument("--only", choices=["host"], help="host: only measurement 4, the host time outside the forward")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = ensure_tiny_sala()
    model = MiniCPMSALAForCausalLM.sharing(load_model(path))  # transformers' generate(), the reference
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    stream = tok("\n\n".join(heldout_texts(path)))["input_ids"]
    prompts = [stream[:1] + stream[1 + 50 * i : args.prompt_tokens + 50 * i] for i in range(max(args.batches))]
    if args.only == "host":
        return host_times(path, tok, prompts[0], {"prompt_tokens": args.prompt_tokens, "threads": args.threads})
    n = args.new_tokens
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    engines = {"engine, eager": Engine(load_model(path), tok, compile=False),
               "engine, compiled": Engine(load_model(path), tok),
               "engine, evaluation mode": Engine(load_model(path), tok, batch_invariant=True)}
    keys = {"engine, eager": "eager", "engine, compiled": "compiled", "engine, evaluation mode": "invariant"}

    rows, result = [], {"new_tokens": n, "prompt_tokens": args.prompt_tokens, "threads": args.threads}
    for b in args.batches:
        batch = prompts[:b]
        hf_tokens = hf_generate(model, batch, n)  # also the warm-up
        t_hf = best_of(lambda: hf_generate(model, batch, n), args.repeat)
        rows.append((b, "transformers generate()", b * n / t_hf, 1.0, ""))
        result[f"b{b}_hf_tok_s"] = round(b * n / t_hf, 1)
        for name, engine in engines.items():
            out = engine.generate(batch, params)  # warm-up (and, the first time, the compile)
            same = sum(o.token_ids == h for o, h in zip(out, hf_tokens))
            t = best_of(lambda: engine.generate(batch, params), args.repeat)
            rows.append((b, name, b * n / t, t_hf / t, f"{same}/{b} sequences identical to generate()"))
            result[f"b{b}_{keys[name]}_tok_s"] = round(b * n / t, 1)
            result[f"b{b}_{keys[name]}_ratio"] = round(t_hf / t, 3)
    compiled = engines["engine, compiled"]
    result["compile_s"] = round(compiled.compile_seconds or 0.0, 1)

    print(f"\ntiny-sala greedy decode, {args.prompt_tokens}-token prompts, {n} new tokens, {args.threads} thread(s); "
          f"decode step compiled in {result['compile_s']} s")
    print(f"{'batch':>5}  {'implementation':<26} {'tokens/s':>10} {'vs generate()':>14}  check")
    for b, name, tps, ratio, note in rows:
        print(f"{b:>5}  {name:<26} {tps:>10.1f} {ratio:>13.2f}x  {note}")

    # A serving-shaped workload.
    work = serving_workload(random.Random(0), stream, args.requests)
    useful = sum(m for _, m in work)
    t0 = time.perf_counter()
    hf_out = []
    for i in range(0, len(work), 8):
        chunk = work[i : i + 8]
        hf_out += [row[:m] for row, (_, m) in zip(hf_generate(model, [p for p, _ in chunk], max(m for _, m in chunk)), chunk)]
    t_hf = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = compiled.generate([p for p, _ in work], [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in work])
    t_engine = time.perf_counter() - t0
    same = sum(c.token_ids == h for c, h in zip(got, hf_out))
    print(f"\nserving-shaped workload: {len(work)} requests, prompts 8-256, max_tokens 8-128 ({useful} tokens requested)")
    print(f"  generate(), left-padded batches of 8: {t_hf:7.2f} s  {useful / t_hf:8.1f} tok/s")
    print(f"  engine, all submitted at once:        {t_engine:7.2f} s  {useful / t_engine:8.1f} tok/s  "
          f"{t_hf / t_engine:.2f}x   {same}/{len(work)} identical to generate()")
    result |= {"serving_hf_tok_s": round(useful / t_hf, 1), "serving_engine_tok_s": round(useful / t_engine, 1),
               "serving_ratio": round(t_hf / t_engine, 3), "serving_identical": same}

    # Ops per decode step.
    ops = {"generate() model call": hf_decode_step_ops(model, prompts[0], 8)}
    ops["engine eager step"], ops["engine compiled step"] = engine_decode_step_ops(compiled, prompts[0], 8)
    print("\naten ops per decode step at batch 8 (profiler events; the compiled step counts only the ops left outside its C++ kernels)")
    for name, count in ops.items():
        print(f"  {name:<24} {count:>5}")
    result |= {"ops_hf": ops["generate() model call"], "ops_engine_eager": ops["engine eager step"],
               "ops_engine_compiled": ops["engine compiled step"]}

    host_times(path, tok, prompts[0], result)


def host_times(path, tok, prompt: list[int], result: dict) -> None:
    """Measurement 4: host time outside the forward."""
    wide = Engine(load_model(path), tok, max_seqs=64)
    wide.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # compile
    print("\nhost time per decode step outside the compiled forward (scheduling, step context, sampling, emitting)")
    for b in (1, 8, 64):
        ms = host_ms_outside_forward(wide, prompt, b)
        print(f"  batch {b:>2}: {ms:6.3f} ms")
        result[f"host_ms_b{b}"] = round(ms, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
