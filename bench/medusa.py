"""Medusa on held-out tiny-sala text: accept length, acceptance per depth, verify-step cost and
decode tokens/s with and without Medusa at batch 1, 4 and 16, measured in the same run.

    python pipelines/train_medusa.py                 # once: trains heads, prints the checkpoint
    python bench/medusa.py [--model CKPT] [--tree-nodes 63 15] [--uniform CKPT_TRAINED_WITH_--weighting_uniform]

Both engines are the fast ones: plain decode compiled with inductor on CPU (CUDA graphs on
GPU), Medusa's verify step compiled the same way on CPU (medusa_decoding.CompiledTreeVerify); both are
warmed up before anything is timed. Greedy, ignore_eos, the same prompts for both, run in
waves of `batch` requests (each wave decoded to its end before the next starts). Mean accepted
tokens per step counts the bonus token (plain decoding scores 1.00), as Spec-Bench; acceptance
per depth is the share of verify steps that accepted a draft at that depth. Step times are of
steps with no prompt work in them. Each tree runs twice: verifying at every batch size, and with
medusa_max_batch='auto' (sala/engine/medusa_decoding.py: warmup times plain and verify steps at
batch 1, 2, 4, 8, 16 and a step verifies where accept length x plain step >= verify step; the
share of its decode steps that verified is printed). `--tree-nodes` adds trees grown for other node budgets from
the per-rank accuracy the training pipeline measured (a 63-node tree is 64 rows per request:
on a CPU that is compute-bound, so a smaller tree can be faster). `--uniform`: accept length of
the given heads against heads trained with `--weighting uniform`, on the validation windows the
weighting matches, with each checkpoint's own tree and with Medusa's mc_sim_7b_63. Last line: JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def held_out_prompts(tok, model_dir: Path, n: int, length: int = 32) -> list[list[int]]:
    """n windows of `length` tokens spread evenly over the model's held-out text, BOS first."""
    from sala.tiny import heldout_texts

    stream = tok("\n\n".join(heldout_texts(model_dir)), verbose=False)["input_ids"]
    step = (len(stream) - length) // n
    return [stream[:1] + stream[1 + i * step : 1 + i * step + length] for i in range(n)]


def validation_prompts(tok, model_dir: Path, n: int) -> list[list[int]]:
    """n of the validation windows' prompts train_medusa.py weights against (heldout.txt rows, 2
    windows each), spread evenly."""
    from sala.eval.calibration import Row, guess_task
    from sala.medusa import train
    from sala.tiny import heldout_texts

    rows = [Row(t, guess_task(t)) for t in heldout_texts(model_dir)]
    _, prompts = train.windows(rows, tok, 32, 128, 2)
    return prompts[:: max(1, len(prompts) // n)][:n]


def run_waves(engine, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
    """Decode `prompts` greedily in waves of `batch`; tokens/s over the whole run, the mean time
    of steps with no prompt work, the outputs, and the Medusa counters of this run alone."""
    from sala.engine import SamplingParams
    from sala.engine.request import accept_length

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    totals = (lambda: engine.decoding.totals) if engine.decoding.totals is not None else None  # replaced by warmup: read each time
    spec0 = totals().copy() if totals else None
    decode_time, decode_steps, verified_steps, wall, outputs = 0.0, 0, 0, 0.0, []
    for i in range(0, len(prompts), batch):
        reqs = [engine.add_request(p, params) for p in prompts[i : i + batch]]
        start = time.perf_counter()
        while engine.has_work():
            pure = not engine.scheduler.waiting and all(not r.prefilling for r in engine.scheduler.running)
            v0 = totals().verify_steps if totals else 0
            t0 = time.perf_counter()
            engine.step()
            if pure:
                decode_time += time.perf_counter() - t0
                decode_steps += 1
                verified_steps += totals is not None and totals().verify_steps > v0
        wall += time.perf_counter() - start
        outputs += [r.output_ids for r in reqs]
    out = {"tokens_per_s": sum(map(len, outputs)) / wall, "step_ms": 1e3 * decode_time / max(decode_steps, 1),
           "outputs": outputs, "verified_share": verified_steps / max(decode_steps, 1)}
    if spec0 is not None:
        s = totals()
        steps = s.verify_steps - spec0.verify_steps
        out["accept_length"] = accept_length(steps, s.accepted_tokens - spec0.accepted_tokens)
        out["acceptance_per_depth"] = [(a - b) / max(steps, 1) for a, b in
                                       zip(s.accepted_per_depth, spec0.accepted_per_depth + [0] * len(s.accepted_per_depth))]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint with medusa/ (default: the one pipelines/train_medusa.py writes for tiny-sala)")
    ap.add_argument("--tree-nodes", type=int, nargs="*", default=[],
                    help="also trees of these node budgets, grown from the checkpoint's measured per-rank accuracy")
    ap.add_argument("--uniform", help="the same heads trained with --weighting uniform, to compare accept length")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each (plain, Medusa, Medusa auto) back to back; ratios are the median over runs, "
                         "each run's Medusa against the plain run beside it (this machine's speed drifts over minutes)")
    args = ap.parse_args(argv)
    import torch

    from sala.checkpoint import load_model
    from sala.engine import Engine
    from sala.medusa.heads import has_medusa, load_heads
    from sala.medusa.tree import MC_SIM_7B_63, greedy_tree
    from sala.tiny import ensure_tiny_sala, sala_home

    torch.set_num_threads(1)
    path = Path(args.model) if args.model else sala_home() / "models" / f"{ensure_tiny_sala(progress=False).name}-medusa"
    if not has_medusa(path):
        print(f"error: {path} has no medusa/ heads; run python pipelines/train_medusa.py first", file=sys.stderr)
        return 2
    device = None if torch.cuda.is_available() else "cpu"
    plain = Engine.from_pretrained(path, medusa=False, device=device, max_seqs=max(args.batch))
    tok, config = plain.tokenizer, plain.model.config
    heads = load_heads(path, config)
    trees = {f"{heads.tree.num_nodes - 1} nodes (checkpoint's)": heads}
    for n in args.tree_nodes:
        if not heads.config.rank_accuracy:
            print(f"error: {path} records no per-rank accuracy to grow a {n}-node tree from (retrain with "
                  "pipelines/train_medusa.py)", file=sys.stderr)
            return 2
        trees[f"{n} nodes"] = load_heads(path, config, tree=greedy_tree(torch.tensor(heads.config.rank_accuracy), n))
    prompts = held_out_prompts(tok, ensure_tiny_sala(progress=False), args.prompts)
    t0 = time.perf_counter()
    plain.warmup()
    engines = {}
    for name, h in trees.items():
        engines[name] = Engine(load_model(path, device=device), tok, max_seqs=max(args.batch), medusa=h,
                               medusa_max_batch="auto")
        engines[name].warmup()
        print(f"tree {name}: {engines[name].decoding.describe()}", flush=True)
    print(f"compiled the plain decode and {len(engines)} tree-verify step(s) in {time.perf_counter() - t0:.0f} s", flush=True)
    results, lossless = {}, True

    def median(xs):
        return sorted(xs)[len(xs) // 2]

    for b in args.batch:
        results[b] = {"trees": {}}
        for name, engine in engines.items():
            runs = []
            for _ in range(args.repeats):
                p = run_waves(plain, prompts, b, args.max_tokens)
                engine.decoding.policy.max_batch = None  # verify at every batch size
                m = run_waves(engine, prompts, b, args.max_tokens)
                engine.decoding.policy.max_batch = "auto"
                a = run_waves(engine, prompts, b, args.max_tokens)
                lossless &= p["outputs"] == m["outputs"] == a["outputs"]
                runs.append((p, m, a))
            p, m, a = runs[len(runs) // 2]  # absolute figures of one run; ratios over all of them
            results[b]["plain_tokens_per_s"], results[b]["plain_step_ms"] = p["tokens_per_s"], p["step_ms"]
            r = results[b]["trees"][name] = {
                "medusa_tokens_per_s": m["tokens_per_s"],
                "speedup": median([m["tokens_per_s"] / p["tokens_per_s"] for p, m, _ in runs]),
                "verify_step_ms": m["step_ms"], "verify_over_decode": median([m["step_ms"] / p["step_ms"] for p, m, _ in runs]),
                "accept_length": m["accept_length"], "acceptance_per_depth": m["acceptance_per_depth"],
                "auto_speedup": median([a["tokens_per_s"] / p["tokens_per_s"] for p, _, a in runs]),
                "auto_verified_share": median([a["verified_share"] for _, _, a in runs]),
                "speedup_runs": [m["tokens_per_s"] / p["tokens_per_s"] for p, m, _ in runs]}
            print(f"batch {b:>2}, tree {name}: {r['medusa_tokens_per_s']:.0f} vs {p['tokens_per_s']:.0f} tokens/s = "
                  f"{r['speedup']:.2f}x; accept length {r['accept_length']:.2f}; verify step {r['verify_step_ms']:.1f} ms "
                  f"/ decode step {p['step_ms']:.1f} ms = {r['verify_over_decode']:.2f}x; acceptance per depth "
                  + " ".join(f"{x:.2f}" for x in r["acceptance_per_depth"])
                  + f"; auto: {r['auto_speedup']:.2f}x, {100 * r['auto_verified_share']:.0f}% of steps verified; "
                  f"speedup over {args.repeats} runs " + " ".join(f"{x:.2f}" for x in r["speedup_runs"]), flush=True)
    out = {"bench": "medusa", "model": str(path), "prompts": len(prompts), "max_tokens": args.max_tokens,
           "greedy_identical": lossless, "by_batch": results}
    if args.uniform:
        from sala.medusa.train import accept_length

        val = validation_prompts(tok, ensure_tiny_sala(progress=False), 32)
        compared = {}
        for name, ckpt in (("matched", path), ("uniform", Path(args.uniform))):
            for tree_name, tree in (("own tree", None), ("mc_sim_7b_63", MC_SIM_7B_63)):
                e = Engine(load_model(path), tok, medusa=load_heads(ckpt, config, tree=tree), compile=False)
                compared[f"{name}, {tree_name}"] = accept_length(e, val, args.max_tokens)
        out["validation_accept_length"] = compared
        for tree_name in ("own tree", "mc_sim_7b_63"):
            a, u = compared[f"matched, {tree_name}"], compared[f"uniform, {tree_name}"]
            print(f"validation-matched vs uniform training rows ({tree_name}, {len(val)} validation windows): "
                  f"accept length {a:.2f} vs {u:.2f} = {a / u:.2f}x", flush=True)
    print(f"greedy outputs identical with and without Medusa: {lossless}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
