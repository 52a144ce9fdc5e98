"""Medusa on held-out tiny-sala text: tokens/s with the trees the engine chooses (the default,
medusa_nodes='auto') and with fixed trees, against plain decoding measured beside each run, at
batch 1, 4, 16 and 32, greedy and sampled; accept length and acceptance per depth.

    python pipelines/train_medusa.py                 # once: trains heads, prints the checkpoint
    python bench/medusa.py [--model CKPT] [--batch 1 4 16 32] [--trees 4 16 63] [--uniform CKPT]

Both engines are the fast ones: plain decode compiled with inductor on CPU (CUDA graphs on
GPU), Medusa's verify steps compiled the same way on CPU (one pair of graphs for every tree,
medusa_decoding.CompiledTreeVerify); both are warmed up before anything is timed, and the
Medusa engine's warmup times the steps its choice is made by (printed). Prompts: windows of
the model's held-out text, which the heads never saw; ignore_eos, `batch` requests in flight
(one that finishes is replaced at once, as in a server). Sampled: temperature 0.7, a seed a
request. Each run of Medusa (the engine's choice, or a fixed tree verified at every step) is
timed against plain decoding of the same prompts, the two engines taking turns every `batch`
prompts (`alternating`), and its speedup is its tokens/s over plain's; the variants take turns
within each of `--repeats` rounds, and the figure printed is the median over the rounds (this
machine's speed drifts by up to 2x over a minute). Accept length counts the bonus token (plain
decoding scores 1.00), as Spec-Bench; acceptance per depth is the share of verify steps that
accepted a draft at that depth; "trees used" is the share of decode steps that verified each
tree size (0: plain). Greedy outputs must equal plain greedy's (checked). `--uniform`: accept
length of the given heads against heads trained with `--weighting uniform`, on the validation
windows the weighting matches, with each checkpoint's own tree and with Medusa's mc_sim_7b_63.
Last line: JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
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


def keep_in_flight(engine, prompts: list[list[int]], params: list, batch: int) -> tuple[list, float]:
    """Run `prompts` (each with its params) keeping `batch` of them in flight, one that finishes
    replaced at once, as in a server: the requests and the wall time."""
    pending, reqs = list(zip(prompts, params)), []
    start = time.perf_counter()
    while pending or engine.has_work():
        while pending and sum(not r.finish_reason for r in reqs) < batch:
            reqs.append(engine.add_request(*pending.pop(0)))
        engine.step()
    return reqs, time.perf_counter() - start


def run_at_batch(engine, prompts: list[list[int]], batch: int, max_tokens: int, greedy: bool, first_seed: int = 0) -> dict:
    """Decode `prompts` keeping `batch` of them in flight (a finished one is replaced at once, as
    a server's continuous batching does): the tokens, the wall time, the outputs, and the
    Medusa counters of this run alone (verify steps, drafts accepted in all and per depth, the
    tree each decode step verified). Sampled request i is seeded first_seed + i."""
    from collections import Counter

    from sala.engine import SamplingParams

    medusa = engine.decoding if engine.decoding.totals is not None else None
    used: Counter = Counter()
    if medusa is not None:  # count what the choice gives each decode step
        for_step = medusa.for_step
        medusa.for_step = lambda reqs: (s := for_step(reqs), used.update([s.rows - 1] if reqs else []))[0]
        spec0 = medusa.totals.copy()
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                             **({"temperature": 0} if greedy else {"temperature": 0.7, "seed": first_seed + i}))
              for i in range(len(prompts))]
    reqs, wall = keep_in_flight(engine, prompts, params, batch)
    outputs = [r.output_ids for r in reqs]
    out = {"tokens": sum(map(len, outputs)), "wall": wall, "outputs": outputs, "used": used}
    if medusa is not None:
        del medusa.for_step
        s = medusa.totals
        out["verify_steps"] = s.verify_steps - spec0.verify_steps
        out["accepted"] = s.accepted_tokens - spec0.accepted_tokens
        out["per_depth"] = [a - b for a, b in zip(s.accepted_per_depth, spec0.accepted_per_depth
                                                  + [0] * len(s.accepted_per_depth))]
    return out


def summary(runs: list[dict]) -> dict:
    """Runs of one engine as one: tokens/s over their summed wall time, outputs in order, and
    with Medusa accept length (bonus included), acceptance per depth and the share of decode
    steps that verified each tree size (0: plain)."""
    from collections import Counter

    from sala.engine.request import accept_length

    out = {"tokens_per_s": sum(r["tokens"] for r in runs) / sum(r["wall"] for r in runs),
           "outputs": [o for r in runs for o in r["outputs"]]}
    if "verify_steps" in runs[0]:
        steps = sum(r["verify_steps"] for r in runs)
        depth = max(len(r["per_depth"]) for r in runs)
        used = sum((r["used"] for r in runs), Counter())
        out["accept_length"] = accept_length(steps, sum(r["accepted"] for r in runs)) if steps else None
        out["acceptance_per_depth"] = [sum(r["per_depth"][d] for r in runs if d < len(r["per_depth"])) / max(steps, 1)
                                       for d in range(depth)]
        out["trees_used"] = {k: n / sum(used.values()) for k, n in sorted(used.items())}
    return out


def alternating(plain, medusa, prompts: list[list[int]], batch: int, max_tokens: int, greedy: bool,
                nodes: int | None) -> tuple[dict, dict]:
    """Plain decoding and Medusa (the engine's choice, or the `nodes` tree at every step) over
    the same prompts, taking turns every `batch` prompts, the one going first alternating too:
    this machine's speed drifts (by up to 2x over a minute, measured on the 2-core VM), so
    each engine's tokens/s is taken over the same stretches of time."""
    runs: dict[str, list] = {"plain": [], "medusa": []}
    for i, start in enumerate(range(0, len(prompts), batch)):
        chunk = prompts[start : start + batch]
        turns = [("plain", plain), ("medusa", medusa)]
        for name, engine in turns if i % 2 == 0 else turns[::-1]:
            forcing = medusa.decoding.choice.forcing(nodes) if name == "medusa" and nodes else contextlib.nullcontext()
            with forcing:
                runs[name].append(run_at_batch(engine, chunk, batch, max_tokens, greedy, first_seed=start))
    return summary(runs["plain"]), summary(runs["medusa"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint with medusa/ (default: the one pipelines/train_medusa.py writes for tiny-sala)")
    ap.add_argument("--trees", type=int, nargs="*", default=[4, 16, 63],
                    help="fixed trees (node counts of the heads' tree's candidates) to run beside the engine's choice")
    ap.add_argument("--uniform", help="the same heads trained with --weighting uniform, to compare accept length")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--sampling", nargs="+", choices=["greedy", "sampled"], default=["greedy", "sampled"])
    ap.add_argument("--repeats", type=int, default=3, help="pairs (plain, Medusa) of each; speedups are their median")
    args = ap.parse_args(argv)
    import torch

    from sala.checkpoint import load_model
    from sala.engine import Engine
    from sala.medusa.heads import has_medusa, load_heads
    from sala.medusa.tree import MC_SIM_7B_63
    from sala.tiny import ensure_tiny_sala, sala_home

    torch.set_num_threads(1)
    path = Path(args.model) if args.model else sala_home() / "models" / f"{ensure_tiny_sala(progress=False).name}-medusa"
    if not has_medusa(path):
        print(f"error: {path} has no medusa/ heads; run python pipelines/train_medusa.py first", file=sys.stderr)
        return 2
    device = None if torch.cuda.is_available() else "cpu"
    max_seqs = max(args.batch)
    plain = Engine.from_pretrained(path, medusa=False, device=device, max_seqs=max_seqs)
    medusa = Engine.from_pretrained(path, device=device, max_seqs=max_seqs)
    unknown = sorted(set(args.trees) - set(medusa.decoding.verifies))
    if unknown:
        print(f"error: --trees {unknown}: not candidates of {path}'s tree ({sorted(medusa.decoding.verifies)})",
              file=sys.stderr)
        return 2
    tok = plain.tokenizer
    prompts = held_out_prompts(tok, ensure_tiny_sala(progress=False), args.prompts)
    t0 = time.perf_counter()
    plain.warmup()
    medusa.warmup()
    choice = medusa.decoding.choice
    print(f"warmed up (compiled, and timed the steps the choice is made by) in {time.perf_counter() - t0:.0f} s", flush=True)
    print(medusa.decoding.describe(), flush=True)
    results, lossless = {}, True

    def median(xs):
        return sorted(xs)[len(xs) // 2]

    for b in args.batch:
        for mode in args.sampling:
            greedy = mode == "greedy"
            row = results.setdefault(str(b), {})[mode] = {}
            variants = [("chosen", None)] + [(f"{n} nodes", n) for n in args.trees]
            pairs = {name: [] for name, _ in variants}
            for _ in range(args.repeats):  # the variants in turn within a repeat: drift spreads over all of them
                for name, nodes in variants:
                    p, m = alternating(plain, medusa, prompts, b, args.max_tokens, greedy, nodes)
                    lossless &= not greedy or p["outputs"] == m["outputs"]
                    pairs[name].append((p, m))
            for name, runs in pairs.items():
                speedups = [m["tokens_per_s"] / p["tokens_per_s"] for p, m in runs]
                p, m = runs[speedups.index(median(speedups))]
                r = row[name] = {"speedup": median(speedups), "speedup_runs": speedups,
                                 "tokens_per_s": m["tokens_per_s"], "plain_tokens_per_s": p["tokens_per_s"],
                                 "accept_length": m["accept_length"], "acceptance_per_depth": m["acceptance_per_depth"],
                                 "trees_used": m["trees_used"]}
                used = ", ".join(f"{k or 'plain'}: {100 * v:.0f}%" for k, v in r["trees_used"].items())
                print(f"batch {b:>2} {mode:>7}, {name:>9}: {r['speedup']:.2f}x plain ({r['tokens_per_s']:.0f} vs "
                      f"{r['plain_tokens_per_s']:.0f} tokens/s; runs " + " ".join(f"{x:.2f}" for x in speedups)
                      + ("); no verify step" if r["accept_length"] is None else
                         f"); accept length {r['accept_length']:.2f}, per depth "
                         + " ".join(f"{x:.2f}" for x in r["acceptance_per_depth"])) + f"; trees used {used}", flush=True)
    chosen = [dataclasses.asdict(t) for t in medusa.stats().speculation.trees]
    out = {"bench": "medusa", "model": str(path), "prompts": len(prompts), "max_tokens": args.max_tokens,
           "greedy_identical": lossless, "choice": medusa.decoding.describe(), "chosen_trees": chosen,
           "step_ms": choice.named_times(),
           "by_batch": results}
    if args.uniform:
        from sala.medusa.train import accept_length

        val = validation_prompts(tok, ensure_tiny_sala(progress=False), 32)
        compared = {}
        for name, ckpt in (("matched", path), ("uniform", Path(args.uniform))):
            for tree_name, tree in (("own tree", None), ("mc_sim_7b_63", MC_SIM_7B_63)):
                heads = load_heads(ckpt, plain.model.config, tree=tree)
                e = Engine(load_model(path), tok, medusa=heads, medusa_nodes=heads.tree.num_nodes - 1, compile=False)
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
