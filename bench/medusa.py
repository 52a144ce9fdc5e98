"""Medusa on held-out tiny-sala text: tokens/s with the trees the engine chooses (the default,
medusa_nodes='auto') and with fixed trees, against plain decoding measured beside each run, at
batch 1, 4, 16 and 32, greedy and sampled; accept length and acceptance per depth.

    python pipelines/train_medusa.py                 # once: trains heads, prints the checkpoint
    python bench/medusa.py [--model CKPT] [--batch 1 4 16 32] [--trees 4 16 63] [--api-batch 1 4] [--uniform CKPT]

First the Python API as a new user meets it (`--api-batch`): fresh engines, no warmup(), a
plain one and a Medusa one stepped in turns, each timed from its first request to its last
(`python_api`): the Medusa engine with no step costs on disk (its first start), then a fresh
pair again (a second start, which reads the costs the first measured); tokens/s with the
compiling both do on first use left out (and with it), the step timing a first start does
included; from_pretrained's seconds are its start-up time; the median of `--repeats` rounds.

Then both engines warmed up: plain decode compiled with inductor on CPU (CUDA graphs on
GPU), Medusa's verify steps compiled the same way on CPU (one pair of graphs for every tree,
medusa_decoding.CompiledTreeVerify); both are warmed up before anything is timed, and the
Medusa engine's warmup times the steps its choice is made by (printed). Prompts: windows of the
model's held-out text, which the heads never saw; ignore_eos, lengths spread from half of
`--max-tokens` to one and a half times it (`request_params`), `batch` requests in flight (one
that finishes is replaced at once, as in a server). Sampled: temperature 0.7, a seed a request.
Each run of Medusa (the engine's choice, a fixed tree verified at every step, or with `--trees 0`
plain steps of the Medusa engine: what a Medusa engine's plain step costs) is timed
against plain decoding of the same prompts, the two engines stepped in turns of 50 ms while
both have `batch` requests in flight (`interleaved`), and its speedup is its tokens/s over
plain's; the variants take turns within each of `--repeats` rounds, and the figure printed is
the median over the rounds (this machine's speed drifts by up to 2x over a minute). Accept
length counts the bonus token (plain decoding scores 1.00), as Spec-Bench; acceptance per depth
is the share of verify steps that accepted a draft at that depth; "trees used" is the share of
decode steps that verified each tree size (0: plain). Greedy outputs must equal plain greedy's
(checked). `--uniform`: accept length of the given heads against heads trained with
`--weighting uniform`, on the validation windows the weighting matches, with each checkpoint's
own tree and with Medusa's mc_sim_7b_63. Last line: JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
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


def request_params(n: int, max_tokens: int, greedy: bool) -> list:
    """Request i's sampling: its own length, from max_tokens / 2 on (a mean of about max_tokens),
    so that requests end apart, as a server's do. Requests of one length under plain decoding end
    together, and their prompts prefill in one step, where Medusa's drift apart and each prompt
    joins an eager decode step of its own (measured at batch 4, greedy, the 4-node tree: 0.86x plain
    decoding with every request 128 tokens long, 1.06x with their lengths spread). Sampled: seed i."""
    from sala.engine import SamplingParams

    return [SamplingParams(max_tokens=max_tokens // 2 + i * 37 % max_tokens, ignore_eos=True,
                           **({"temperature": 0} if greedy else {"temperature": 0.7, "seed": i})) for i in range(n)]


# Each engine's turn in `interleaved`: long enough that switching engines (each step's code and
# data displace the other's) is a small share of it, short enough that the machine's speed is
# the same for both over a few turns.
TURN_S = 0.05


class InFlight:
    """`prompts` (each with its params) on `engine`, `batch` of them in flight, one that finishes
    replaced at once, as in a server; stepped for a while at a time (`run`)."""

    def __init__(self, engine, prompts: list[list[int]], params: list, batch: int):
        self.engine, self.pending, self.reqs = engine, list(zip(prompts, params)), []
        self.batch = min(batch, len(prompts))

    def top_up(self) -> bool:
        """Start pending prompts while fewer than `batch` are in flight; whether `batch` are."""
        active = sum(not r.finish_reason for r in self.reqs)
        while self.pending and active < self.batch:
            self.reqs.append(self.engine.add_request(*self.pending.pop(0)))
            active += 1
        return active == self.batch

    def generated(self) -> int:
        return sum(len(r.output_ids) for r in self.reqs)

    def run(self, seconds: float = math.inf, full: bool = False) -> float:
        """Step for `seconds` (only while `batch` requests are in flight, if `full`), or until every
        prompt is done: the time it took."""
        start = now = time.perf_counter()
        while now - start < seconds and (self.top_up() or not full and self.engine.has_work()):
            self.engine.step()
            now = time.perf_counter()
        return now - start


def in_turns(runs: list[InFlight], full: bool) -> list[list]:
    """Step the runs in turns of TURN_S seconds, the one going first alternating (this machine's
    speed drifts: each run's time is taken over stretches the other's alternate with): while each
    has its `batch` requests in flight (`full`), else until every prompt is done. [tokens,
    seconds] of each run's turns."""
    timed, turn = [[0, 0.0] for _ in runs], 0
    while all(r.top_up() for r in runs) if full else any(r.top_up() or r.engine.has_work() for r in runs):
        for i in (0, 1) if turn % 2 == 0 else (1, 0):
            before = runs[i].generated()
            timed[i][1] += runs[i].run(TURN_S, full=full)
            timed[i][0] += runs[i].generated() - before
        turn += 1
    return timed


def keep_in_flight(engine, prompts: list[list[int]], params: list, batch: int) -> tuple[list, float]:
    """Run `prompts` (each with its params) keeping `batch` of them in flight: the requests and the wall time."""
    run = InFlight(engine, prompts, params, batch)
    wall = run.run()
    return run.reqs, wall


@contextlib.contextmanager
def medusa_counts(engine):
    """Yields a dict that holds, once the block is done, what the Medusa engine's decode steps in
    it did: verify steps, drafts accepted in all and per depth, and the tree each decode step
    verified (0: plain)."""
    from collections import Counter

    medusa, used, out = engine.decoding, Counter(), {}
    for_step, before = medusa.for_step, medusa.totals.copy()
    medusa.for_step = lambda reqs, *told: (s := for_step(reqs, *told), used.update([s.rows - 1] if reqs else []))[0]
    try:
        yield out
    finally:
        del medusa.for_step
        s = medusa.totals
        out.update(verify_steps=s.verify_steps - before.verify_steps, accepted=s.accepted_tokens - before.accepted_tokens,
                   per_depth=[a - b for a, b in zip(s.accepted_per_depth, before.accepted_per_depth
                                                    + [0] * len(s.accepted_per_depth))], used=used)


def interleaved(plain, medusa, prompts: list[list[int]], batch: int, max_tokens: int, greedy: bool,
                nodes: int | None) -> tuple[dict, dict]:
    """Plain decoding and Medusa (the engine's choice, or the `nodes` tree at every step) over
    the same prompts, `batch` requests in flight in each, stepped in turns of TURN_S seconds,
    the one going first alternating: this machine's speed drifts (by up to 2x over a minute,
    measured on the 2-core VM), so each engine's tokens/s is taken over its turns while both
    have `batch` requests in flight, the same stretches of time at every batch size. What is
    left then runs untimed, for the outputs. Medusa's counters (accept length, acceptance per
    depth, the trees each decode step used) are over its whole run. Requests: `request_params`."""
    from sala.medusa.accept import accept_length

    params = request_params(len(prompts), max_tokens, greedy)
    runs = [InFlight(plain, prompts, params, batch), InFlight(medusa, prompts, params, batch)]
    forcing = medusa.decoding.choice.forcing(nodes) if nodes is not None else contextlib.nullcontext()
    with forcing, medusa_counts(medusa) as counts:
        timed = in_turns(runs, full=True)
        for r in runs:
            r.run()
    results = [{"tokens_per_s": tokens / seconds, "outputs": [r.output_ids for r in run.reqs]}
               for (tokens, seconds), run in zip(timed, runs)]
    steps, used = counts["verify_steps"], counts["used"]
    results[1].update(accept_length=accept_length(steps, counts["accepted"]) if steps else None,
                      acceptance_per_depth=[a / max(steps, 1) for a in counts["per_depth"]],
                      trees_used={k: n / sum(used.values()) for k, n in sorted(used.items())})
    return results[0], results[1]


def fresh_pair(path, prompts: list[list[int]], params: list, batch: int, max_seqs: int, device) -> list[dict]:
    """A fresh plain engine and a fresh Medusa engine as the Python API makes them, without
    warmup(): each one's start-up time (from_pretrained), then both run every prompt, `batch`
    requests in flight, stepped in turns of TURN_S seconds from their first request to their last
    (the machine's drift falls on both): tokens/s over each one's turns with its compiling
    (inductor's graphs, on first use) and without, any step timing included either way."""
    from sala.engine import Engine

    engines, startup = [], []
    for medusa in (False, True):
        t0 = time.perf_counter()
        engines.append(Engine.from_pretrained(path, medusa=None if medusa else False, device=device, max_seqs=max_seqs))
        startup.append(time.perf_counter() - t0)
    runs = [InFlight(e, prompts, params, batch) for e in engines]
    out = []
    for engine, run, (tokens, wall), start in zip(engines, runs, in_turns(runs, full=False), startup):
        compiling = engine.compile_seconds or 0.0
        out.append({"engine": engine, "startup_s": start, "tokens_per_s": tokens / wall, "compile_s": compiling,
                    "decode_tokens_per_s": tokens / (wall - compiling), "outputs": [r.output_ids for r in run.reqs]})
    return out


def python_api(path, prompts: list[list[int]], batch: int, max_tokens: int, greedy: bool, max_seqs: int, device,
               repeats: int) -> dict:
    """The Python API without warmup(), `repeats` rounds of two fresh pairs (`fresh_pair`): the
    Medusa engine with no step costs on disk (its first start: the cache file removed), then again
    (a second start, which reads the costs the first one measured). A start's figures are the
    round's whose speedup is the median."""
    from sala.engine import Engine

    params = request_params(len(prompts), max_tokens, greedy)
    runs, lossless = {"first start": [], "second start": []}, True
    for _ in range(repeats):
        for name, starts in runs.items():
            if name == "first start":  # the costs a start before measured go, so that this one measures them
                engine = Engine.from_pretrained(path, device=device, max_seqs=max_seqs)
                if (costs := getattr(engine.decoding, "costs", None)) is not None:
                    costs.path.unlink(missing_ok=True)
            plain, m = fresh_pair(path, prompts, params, batch, max_seqs, device)
            lossless &= not greedy or m["outputs"] == plain["outputs"]
            starts.append({"speedup": m["decode_tokens_per_s"] / plain["decode_tokens_per_s"],
                           "speedup_with_compiling": m["tokens_per_s"] / plain["tokens_per_s"],
                           "tokens_per_s": m["decode_tokens_per_s"], "plain_tokens_per_s": plain["decode_tokens_per_s"],
                           "compile_s": m["compile_s"], "plain_compile_s": plain["compile_s"],
                           "startup_s": m["startup_s"], "plain_startup_s": plain["startup_s"],
                           "choice": m["engine"].decoding.describe()})
    out = {}
    for name, starts in runs.items():
        speedups = [x["speedup"] for x in starts]
        out[name] = starts[speedups.index(median(speedups))] | {"speedup_runs": speedups}
    out["greedy_identical"] = lossless
    return out


def median(xs: list[float]) -> float:
    """The middle value (of an odd count; the upper middle of an even one): one of the runs."""
    return sorted(xs)[len(xs) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint with medusa/ (default: the one pipelines/train_medusa.py writes for tiny-sala)")
    ap.add_argument("--trees", type=int, nargs="*", default=[4, 16, 63],
                    help="fixed trees (node counts of the heads' tree's candidates) to run beside the engine's choice; 0: "
                         "the Medusa engine decoding plainly at every step, what its plain step costs against a plain engine's")
    ap.add_argument("--uniform", help="the same heads trained with --weighting uniform, to compare accept length")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128, help="a request's mean length (request_params)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--sampling", nargs="+", choices=["greedy", "sampled"], default=["greedy", "sampled"])
    ap.add_argument("--repeats", type=int, default=3,
                    help="pairs (plain, Medusa) of each, and rounds of the Python API rows; speedups are their median")
    ap.add_argument("--api-batch", type=int, nargs="*", default=[1, 4],
                    help="batch sizes of the Python API rows (fresh engines, no warmup())")
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
    unknown = sorted(set(args.trees) - set(medusa.decoding.verifies) - {0})
    if unknown:
        print(f"error: --trees {unknown}: not candidates of {path}'s tree ({sorted(medusa.decoding.verifies)})",
              file=sys.stderr)
        return 2
    tok = plain.tokenizer
    prompts = held_out_prompts(tok, ensure_tiny_sala(progress=False), args.prompts)
    api, lossless = {}, True
    for b in args.api_batch:  # first: before this run's warmup() leaves its costs on disk
        for mode in args.sampling:
            r = api.setdefault(str(b), {})[mode] = python_api(path, prompts, b, args.max_tokens, mode == "greedy",
                                                             max_seqs, device, args.repeats)
            lossless &= r["greedy_identical"]
            for name in ("first start", "second start"):
                x = r[name]
                print(f"python API, no warmup(), batch {b:>2} {mode:>7}, {name}: {x['speedup']:.2f}x plain (runs "
                      + " ".join(f"{v:.2f}" for v in x["speedup_runs"])
                      + f"; {x['tokens_per_s']:.0f} vs {x['plain_tokens_per_s']:.0f} tokens/s, step timing included, "
                      f"compiling not: {x['compile_s']:.1f} s against {x['plain_compile_s']:.1f}; with it "
                      f"{x['speedup_with_compiling']:.2f}x); from_pretrained {x['startup_s']:.1f} s (plain "
                      f"{x['plain_startup_s']:.1f} s); then {x['choice']}", flush=True)
    t0 = time.perf_counter()
    plain.warmup()
    medusa.warmup()
    warmup_s = time.perf_counter() - t0
    print(f"warmed up (compiled, and timed the steps the choice is made by) in {warmup_s:.0f} s", flush=True)
    print(medusa.decoding.describe(), flush=True)
    results = {}
    for b in args.batch:
        for mode in args.sampling:
            greedy = mode == "greedy"
            row = results.setdefault(str(b), {})[mode] = {}
            variants = [("chosen", None)] + [(f"{n} nodes" if n else "plain", n) for n in args.trees]
            pairs = {name: [] for name, _ in variants}
            for _ in range(args.repeats):  # the variants in turn within a repeat: drift spreads over all of them
                for name, nodes in variants:
                    p, m = interleaved(plain, medusa, prompts, b, args.max_tokens, greedy, nodes)
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
           "warmup_s": warmup_s, "python_api": api, "by_batch": results}
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
