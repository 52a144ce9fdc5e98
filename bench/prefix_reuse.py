"""Prefix reuse: ten questions over one long document, time to first token with and without it.

tiny-sala on CPU; the document is as long as the model's context allows (4096 positions, so
about 3.9K tokens, not 16K) less the questions and answers. Each engine answers the ten
questions one after another (as a user asking in turn would); the first question finds the
cache cold in both runs, the other nine can resume from the document's last snapshot
(prefix_snapshot_interval tokens apart) and compute only the rest of the document and the
question. Greedy answers are checked equal between the two runs.

    python bench/prefix_reuse.py [--doc-tokens 3800] [--threads 2] [--interval 512]
"""
import argparse
import json
import statistics
import time

import torch

from sala.checkpoint import load_model
from sala.engine import Engine, SamplingParams
from sala.tiny import ensure_tiny_sala, heldout_texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc-tokens", type=int, default=3800)
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--interval", type=int, default=512, help="prefix_snapshot_interval")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = ensure_tiny_sala()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    stream = tokenizer("\n\n".join(heldout_texts(path)))["input_ids"]
    doc = stream[: args.doc_tokens]
    questions = [stream[args.doc_tokens + 500 + 60 * i : args.doc_tokens + 500 + 60 * i + 20 + i] for i in range(args.questions)]
    prompts = [doc + q for q in questions]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    results = {}
    for reuse in (False, True):
        extra = {"prefix_snapshot_interval": args.interval} if reuse else {}
        engine = Engine(load_model(path), tokenizer, prefix_cache=reuse, **extra)
        engine.warmup()
        t0 = time.perf_counter()
        done = [engine.generate([p], params)[0] for p in prompts]
        wall = time.perf_counter() - t0
        ttft = [c.time_to_first_token_s for c in done]
        results[reuse] = (done, ttft, wall)
        cached = [c.num_cached_tokens for c in done]
        print(f"prefix_cache={reuse}: TTFT first {ttft[0] * 1e3:.0f} ms, later questions mean "
              f"{statistics.mean(ttft[1:]) * 1e3:.0f} ms; cached tokens {cached}; all ten {wall:.1f} s", flush=True)
    (off, ttft_off, wall_off), (on, ttft_on, wall_on) = results[False], results[True]
    assert [c.token_ids for c in on] == [c.token_ids for c in off], "answers differ with prefix reuse"
    later_off, later_on = statistics.mean(ttft_off[1:]), statistics.mean(ttft_on[1:])
    ratio = later_off / later_on
    print(f"ratio: time to first token of questions 2-{len(prompts)} without / with prefix reuse = {ratio:.1f}x "
          f"({later_off * 1e3:.0f} ms vs {later_on * 1e3:.0f} ms, document {len(doc)} tokens); "
          f"all questions {wall_off / wall_on:.1f}x")
    print(json.dumps({"bench": "prefix_reuse", "doc_tokens": len(doc), "questions": len(prompts), "interval": args.interval,
                      "threads": args.threads, "ttft_first_ms": {"off": ttft_off[0] * 1e3, "on": ttft_on[0] * 1e3},
                      "ttft_later_mean_ms": {"off": later_off * 1e3, "on": later_on * 1e3}, "ttft_ratio": ratio,
                      "wall_s": {"off": wall_off, "on": wall_on},
                      "cached_tokens": [c.num_cached_tokens for c in on], "answers_equal": True}))


if __name__ == "__main__":
    main()
