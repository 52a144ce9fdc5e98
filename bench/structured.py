"""Structured outputs on tiny-sala: tokens/s with a 10-field JSON schema against unconstrained
decoding in the same run, at batch 1 and 8, greedy and at temperature 1.0, and with tool calls
(tool_choice "auto" in tiny-sala's minicpm format); the schema's compile time, cold and cached;
Medusa's accept length with and without the schema.

    python bench/structured.py [--batch 1 8] [--max-tokens 192] [--repeats 3] [--medusa-model CKPT]

One engine (compiled decode step, the default; warmed up before anything is timed) runs both:
held-out windows of tiny-sala's text as prompts, `batch` requests in flight (one that finishes
is replaced at once, as in a server). A constrained request ends where its JSON does; its
unconstrained twin (same prompt, same seed) generates exactly as many tokens (max_tokens set to
that length, ignore_eos), so both runs decode the same batches and only the cost of constraining
differs (runs of unequal lengths would differ in how full their batches stay, which outweighed
the masks: 0.76x then against 0.9x now at batch 8). The two take turns within each of `--repeats`
rounds and the ratio printed is the median of the rounds' ratios (this machine's speed drifts
over minutes). Every constrained output that did not run out of tokens is checked against the
schema with `jsonschema` (and some must end). Temperature 1.0 draws with a seed a request.

Auto tools: chat prompts (the held-out windows as user turns) with two tools in tiny-sala's
template, held to tool_choice "auto"'s structural tag (free text, and calls held to their
tool's schema from the <|tool_call|> token on), at temperature 1.0 with that token favoured
(logit bias TOOL_BIAS: tiny-sala, untrained for tools, seldom calls on its own); the twins carry
the same bias. Every call that ends must validate against its tool's schema, and calls must be made.

Compile time: cold is a fresh Grammars (the engine's compiler over this vocabulary, its cache
empty) compiling the schema, median of 3, the vocabulary's one-off preprocessing reported apart;
cached is the engine's Grammars handing the compiled schema back.

Medusa (when the checkpoint has `medusa/` heads: `python pipelines/train_medusa.py` writes them):
greedy at batch 1 and 8, a fixed tree verified at every step (`--medusa-nodes`, one of the heads'
tree's candidates), with and without the schema; accept length counts the bonus token (plain
decoding scores 1.00). And the constrained requests through a Medusa engine as it comes (its own
choice of tree, warmed up) against the plain engine, in turns, median of `--repeats` rounds.
Constrained greedy outputs must equal constrained plain greedy's (checked).
Last line: JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.medusa import held_out_prompts, keep_in_flight  # noqa: E402

# Ten fields of every kind a schema bounds: short strings, bounded integers and numbers,
# booleans, enums, a bounded array. Bounded so that tiny-sala's outputs end within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": {"type": "string", "maxLength": 8},
        "city": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "active": {"type": "boolean"},
        "verified": {"type": "boolean"},
        "level": {"enum": ["low", "mid", "high"]},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["id", "name", "city", "age", "score", "active", "verified", "level", "color", "tags"],
    "additionalProperties": False,
}


# Two tools of the shapes agents send (bounded strings, an enum, a bounded integer).
TOOLS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]},
                                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                    "required": ["city", "unit"], "additionalProperties": False},
    "get_time": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 6}}, "required": ["tz"],
                 "additionalProperties": False},
}
TOOL_BIAS = 6.0


def tool_prompts(engine, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's text as a user turn of a chat offering TOOLS, through the chat template."""
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in TOOLS.items()]
    texts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": engine.tokenizer.decode(p[1:])}],
                                                  tools=tools, tokenize=False, add_generation_prompt=True) for p in prompts]
    return [engine.encode(t) for t in texts]


def tool_sampling(engine, n: int, max_tokens: int, constrained: bool) -> list:
    """Requests at temperature 1.0 with the trigger favoured; `constrained`: held to tool_choice "auto"."""
    from sala.engine import SamplingParams, StructuredOutputs
    from sala.structured import structural_tag
    from sala.tools import FORMATS, Function, special_texts

    fmt = FORMATS["minicpm"]
    functions = [Function(name, schema) for name, schema in TOOLS.items()]
    tag = structural_tag(fmt.tool_format(functions, "auto", True, special_texts(engine.tokenizer, engine.eos_ids)))
    trigger = engine.tokenizer.convert_tokens_to_ids(fmt.trigger)
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=i, logit_bias={trigger: TOOL_BIAS},
                           skip_special_tokens=False, structured_outputs=StructuredOutputs(structural_tag=tag) if constrained
                           else None) for i in range(n)]


def valid_calls(run: dict) -> tuple[int, int]:
    """(calls that ended and validate against their tool's schema, calls that ended)."""
    import jsonschema

    from sala.tools import FORMATS, Function

    functions = [Function(name, schema) for name, schema in TOOLS.items()]
    ended = [c for text in run["texts"] for c in FORMATS["minicpm"].parse(text, functions, True).calls if c.ended]
    ok = 0
    for call in ended:
        try:
            jsonschema.validate(json.loads(call.arguments), TOOLS[call.name])
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok, len(ended)


def run_at_batch(engine, prompts: list[list[int]], batch: int, params: list) -> dict:
    """Decode `prompts` (each with its params) keeping `batch` in flight: tokens/s over the whole
    run, the outputs, their finish reasons and the Medusa counters of these requests."""
    reqs, wall = keep_in_flight(engine, prompts, params, batch)
    done = [r.completion() for r in reqs]
    verify = sum(c.spec.verify_steps for c in done if c.spec)
    accepted = sum(c.spec.accepted_tokens for c in done if c.spec)
    return {"tokens_per_s": sum(len(c.token_ids) for c in done) / wall, "tokens": [c.token_ids for c in done],
            "texts": [c.text for c in done], "finish": [c.finish_reason for c in done],
            "accept_length": 1 + accepted / verify if verify else None}


def sampling(n: int, max_tokens: int, greedy: bool, constraint) -> list:
    from sala.engine import SamplingParams

    # ignore_eos: unconstrained requests run to max_tokens; a constrained one still ends with its grammar.
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, structured_outputs=constraint,
                           **({"temperature": 0} if greedy else {"temperature": 1.0, "seed": i})) for i in range(n)]


def valid_share(run: dict) -> tuple[int, int]:
    """(outputs that ended and validate against SCHEMA, outputs that ended): every one must validate."""
    import jsonschema

    ended = [t for t, f in zip(run["texts"], run["finish"]) if f != "length"]
    ok = 0
    for text in ended:
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok, len(ended)


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=192,
                    help="tokens a request may generate; the schema's outputs take ~120-140 on tiny-sala")
    ap.add_argument("--prompts", type=int, default=16, help="requests a run (at each batch size)")
    ap.add_argument("--repeats", type=int, default=3, help="pairs (unconstrained, constrained); ratios are their median")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--medusa-model", help="checkpoint with medusa/ heads (default: the one pipelines/train_medusa.py "
                                           "writes for tiny-sala)")
    ap.add_argument("--medusa-nodes", type=int, default=16, help="the fixed tree Medusa verifies at every step")
    ap.add_argument("--modes", nargs="*", choices=["greedy", "t=1.0", "auto tools"], default=["greedy", "t=1.0", "auto tools"],
                    help="the constrained against unconstrained rows to run")
    args = ap.parse_args(argv)
    import torch

    from sala.engine import Engine, StructuredOutputs
    from sala.medusa.heads import has_medusa
    from sala.structured import Grammars
    from sala.tiny import ensure_tiny_sala, sala_home

    torch.set_num_threads(args.threads)
    path = ensure_tiny_sala(progress=False)
    engine = Engine.from_pretrained(path, device="cpu", max_seqs=max(args.batch))
    t0 = time.perf_counter()
    engine.warmup()
    print(f"warmed up (compiled the decode step) in {time.perf_counter() - t0:.0f} s", flush=True)
    prompts = held_out_prompts(engine.tokenizer, path, args.prompts)
    schema = StructuredOutputs(json=SCHEMA)
    out = {"bench": "structured", "model": str(path), "threads": args.threads, "prompts": args.prompts,
           "max_tokens": args.max_tokens, "fields": len(SCHEMA["properties"])}

    # Compile time: cold (a fresh compiler, nothing cached), then cached (the engine's, once compiled).
    colds, setups = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        fresh = Grammars(engine.tokenizer, engine.model.config.vocab_size, engine.eos_ids)
        t1 = time.perf_counter()
        fresh.compiled(schema)
        colds.append(time.perf_counter() - t1)
        setups.append(t1 - t0)
    engine.grammars.compiled(schema)
    cached = []
    for _ in range(100):
        t0 = time.perf_counter()
        engine.grammars.compiling(schema).result()
        cached.append(time.perf_counter() - t0)
    out["compile_cold_ms"], out["compile_cached_ms"] = 1e3 * median(colds), 1e3 * median(cached)
    out["vocabulary_setup_ms"] = 1e3 * median(setups)

    rows, all_valid = {}, True
    chats = tool_prompts(engine, prompts)
    for b in args.batch:
        for mode in args.modes:
            if mode == "auto tools":
                runs_on, held = chats, tool_sampling(engine, len(prompts), args.max_tokens, True)
                free = tool_sampling(engine, len(prompts), args.max_tokens, False)
            else:
                runs_on = prompts
                free, held = (sampling(len(prompts), args.max_tokens, mode == "greedy", c) for c in (None, schema))
            lengths = [len(t) for t in run_at_batch(engine, runs_on, b, held)["tokens"]]  # also warms the prefix cache
            free = [dataclasses.replace(p, max_tokens=n) for p, n in zip(free, lengths)]
            run_at_batch(engine, runs_on, b, free)
            pairs = []
            for _ in range(args.repeats):
                pairs.append((run_at_batch(engine, runs_on, b, free), run_at_batch(engine, runs_on, b, held)))
            ratios = [h["tokens_per_s"] / f["tokens_per_s"] for f, h in pairs]
            f, h = pairs[ratios.index(median(ratios))]
            ok, ended = valid_calls(h) if mode == "auto tools" else valid_share(h)
            all_valid &= ok == ended > 0
            key = {"greedy": "greedy", "t=1.0": "t1", "auto tools": "tools"}[mode]
            rows[f"b{b}_{key}"] = r = {
                "batch": b, "mode": mode, "ratio": median(ratios), "ratio_runs": ratios,
                "tokens_per_s": h["tokens_per_s"], "unconstrained_tokens_per_s": f["tokens_per_s"],
                "mean_tokens": sum(map(len, h["tokens"])) / len(prompts), "valid": ok, "ended": ended,
                "prompt_tokens": sum(map(len, runs_on)) / len(runs_on)}
            what = (f"{ok}/{ended} calls valid, prompts of {r['prompt_tokens']:.0f} tokens" if mode == "auto tools" else
                    f"{ok}/{ended} ended outputs valid, {len(prompts) - ended} ran out of tokens")
            print(f"batch {b} {mode:>10}: constrained {r['tokens_per_s']:.0f} tokens/s vs unconstrained "
                  f"{r['unconstrained_tokens_per_s']:.0f} = {r['ratio']:.2f}x (runs "
                  + " ".join(f"{x:.2f}" for x in ratios) + f"); {what}", flush=True)
    out["runs"], out["all_valid"] = rows, all_valid

    medusa_path = Path(args.medusa_model) if args.medusa_model else sala_home() / "models" / f"{path.name}-medusa"
    medusa = None
    if has_medusa(medusa_path):
        medusa = {}
        spec = Engine.from_pretrained(medusa_path, device="cpu", max_seqs=max(args.batch), medusa_nodes=args.medusa_nodes)
        spec.warmup()
        auto = Engine.from_pretrained(medusa_path, device="cpu", max_seqs=max(args.batch))
        auto.warmup()
        lossless = True
        for b in args.batch:
            free, held = (sampling(len(prompts), args.max_tokens, True, c) for c in (None, schema))
            plain_held = run_at_batch(engine, prompts, b, held)
            m_free, m_held = run_at_batch(spec, prompts, b, free), run_at_batch(spec, prompts, b, held)
            lossless &= m_held["tokens"] == plain_held["tokens"]
            pairs = [(run_at_batch(engine, prompts, b, held), run_at_batch(auto, prompts, b, held)) for _ in range(args.repeats)]
            lossless &= all(m["tokens"] == plain_held["tokens"] for _, m in pairs)
            ratios = [m["tokens_per_s"] / p["tokens_per_s"] for p, m in pairs]
            p, m = pairs[ratios.index(median(ratios))]
            medusa[f"b{b}"] = r = {"accept_length": m_free["accept_length"],
                                   "accept_length_constrained": m_held["accept_length"],
                                   "tokens_per_s": m_free["tokens_per_s"],
                                   "constrained_tokens_per_s": m_held["tokens_per_s"],
                                   "auto_constrained_ratio": median(ratios), "auto_constrained_ratio_runs": ratios,
                                   "auto_constrained_tokens_per_s": m["tokens_per_s"],
                                   "plain_constrained_tokens_per_s": p["tokens_per_s"]}
            print(f"Medusa ({args.medusa_nodes}-node tree) batch {b} greedy: accept length {r['accept_length']:.2f} "
                  f"unconstrained, {r['accept_length_constrained']:.2f} with the schema", flush=True)
            print(f"Medusa engine (its own choice) batch {b} greedy with the schema: {m['tokens_per_s']:.0f} tokens/s "
                  f"against the plain engine's {p['tokens_per_s']:.0f} = {median(ratios):.2f}x (runs "
                  + " ".join(f"{x:.2f}" for x in ratios) + ")", flush=True)
        medusa["lossless"] = lossless
        out["medusa"] = medusa
    else:
        print(f"Medusa: skipped, {medusa_path} has no medusa/ heads (python pipelines/train_medusa.py writes them; "
              "or pass --medusa-model)", flush=True)
        out["medusa"] = None

    print(f"\ntiny-sala, {args.threads} thread(s), a {out['fields']}-field JSON schema, {args.prompts} requests a run, "
          f"max_tokens {args.max_tokens}; median of {args.repeats} rounds")
    print(f"{'batch':>5} {'sampling':>10} {'unconstrained tok/s':>20} {'constrained tok/s':>18} {'ratio':>6} "
          f"{'tokens/output':>14} {'valid':>7}")
    for r in rows.values():
        print(f"{r['batch']:>5} {r['mode']:>10} {r['unconstrained_tokens_per_s']:>20.0f} {r['tokens_per_s']:>18.0f} "
              f"{r['ratio']:>5.2f}x {r['mean_tokens']:>14.1f} {r['valid']:>3}/{r['ended']:<3}")
    print(f"compile: cold {out['compile_cold_ms']:.1f} ms (plus {out['vocabulary_setup_ms']:.0f} ms once per "
          f"vocabulary), cached {1e3 * out['compile_cached_ms']:.1f} us")
    if medusa:
        for b in args.batch:
            r = medusa[f"b{b}"]
            print(f"Medusa batch {b}: accept length {r['accept_length']:.2f} -> {r['accept_length_constrained']:.2f} "
                  f"with the schema; {r['tokens_per_s']:.0f} -> {r['constrained_tokens_per_s']:.0f} tokens/s; "
                  f"the engine's own choice with the schema: {r['auto_constrained_ratio']:.2f}x the plain engine")
        print(f"constrained Medusa greedy identical to constrained plain greedy: {medusa['lossless']}")
    print(json.dumps(out))
    return 0 if all_valid and (medusa is None or medusa["lossless"]) else 1


if __name__ == "__main__":
    sys.exit(main())
