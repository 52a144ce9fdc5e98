"""Prefix reuse: ten questions over one long document, time to first token with and without it.

tiny-sala on CPU; the document is as long as the model's context allows (4096 positions, so
about 3.9K tokens, not 16K) less the questions and answers. Each engine answers the ten
questions one after another (as a user asking in turn would); the first question finds the
cache cold in both runs, the other nine can resume from the document's last snapshot
(prefix_snapshot_interval tokens apart) and compute only the rest of the document and the
question. Greedy answers are checked equal between the two runs.

With --replicas N, across Serve replicas instead: N tiny-sala replicas on a local Ray, each
caching about `--cache-docs` documents, are asked `--questions` questions over each of `--docs`
documents (more than one replica can hold), the documents taken in turn, over HTTP (/generate,
one token: its latency is the time to first token). Once behind the prefix-aware router
(serve/router.py), once behind Serve's default power of two choices: the prefix-cache hit rate
(cached / prompt tokens) and the time to first token of each.

    python bench/prefix_reuse.py [--doc-tokens 3800] [--threads 2] [--interval 512]
    python bench/prefix_reuse.py --replicas 2 [--docs 6] [--doc-tokens 1024] [--questions 4] [--cache-docs 3.5]
"""
import argparse
import json
import statistics
import time
from collections import Counter

import torch

from sala.checkpoint import load_model
from sala.engine import Engine, SamplingParams
from sala.tiny import ensure_tiny_sala, heldout_texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc-tokens", type=int, help="document length (default: 3800; 1024 with --replicas)")
    ap.add_argument("--questions", type=int, help="questions per document (default: 10; 4 with --replicas)")
    ap.add_argument("--interval", type=int, default=512, help="prefix_snapshot_interval")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--replicas", type=int, help="compare routers across this many Serve replicas")
    ap.add_argument("--docs", type=int, default=6, help="documents, with --replicas")
    ap.add_argument("--cache-docs", type=float, default=3.5, help="documents one replica's cache holds, with --replicas")
    args = ap.parse_args()
    if args.replicas:
        args.doc_tokens, args.questions = args.doc_tokens or 1024, args.questions or 4
        return across_replicas(args)
    args.doc_tokens, args.questions = args.doc_tokens or 3800, args.questions or 10
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


def across_replicas(args) -> None:
    import httpx
    import ray
    from http_load import free_port  # bench/ is this script's sys.path[0]
    from ray import serve

    from sala.checkpoint import read_config
    from sala.engine.memory import kv_bytes_per_token, state_bytes_per_seq
    from sala.kv.plan import default_plan
    from serve.build import build_app

    path = ensure_tiny_sala()
    from transformers import AutoTokenizer

    stream = AutoTokenizer.from_pretrained(path)("\n\n".join(heldout_texts(path)))["input_ids"]
    n, q_len = args.doc_tokens, 24
    docs = [stream[i * n : (i + 1) * n] for i in range(args.docs)]
    tail = stream[args.docs * n :]
    # question j of every document: its own tokens; the documents in turn, so each returns after all others
    order = [(d, j) for j in range(args.questions) for d in range(args.docs)]
    prompts = [docs[d] + tail[(d * args.questions + j) * q_len : (d * args.questions + j + 1) * q_len] for d, j in order]
    config = read_config(path)
    plan = default_plan(config, torch.float32)  # tiny-sala's weights and cache are fp32
    max_len = n + q_len + 1
    engine = dict(max_model_len=max_len, max_seqs=4, compile=False, prefix_snapshot_interval=args.interval,
                  memory_bytes=int(args.cache_docs * max_len * kv_bytes_per_token(config, plan)) + 4 * state_bytes_per_seq(config, plan),
                  prefix_snapshot_bytes=int(args.cache_docs * (n // args.interval + 1)) * state_bytes_per_seq(config, plan))
    ray.init(address="local", num_cpus=args.replicas, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    runs = {}
    for routing in (False, True):
        serve.run(build_app(str(path), num_replicas=args.replicas, num_cpus=1, num_threads=1, prefix_routing=routing,
                            max_tokens_limit=1, **engine), name="bench", route_prefix="/")
        ttft, cached, prompt_tokens, served = [], 0, 0, []
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
            for ids in prompts:
                t0 = time.perf_counter()
                r = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
                ttft.append(time.perf_counter() - t0)
                r.raise_for_status()
                meta = r.json()["meta_info"]
                cached, prompt_tokens = cached + meta["cached_tokens"], prompt_tokens + meta["prompt_tokens"]
                served.append(r.headers.get("x-sala-replica"))
        serve.delete("bench")
        name = "prefix-aware" if routing else "power of two"
        runs[name] = {"hit_rate": cached / prompt_tokens, "ttft_mean_ms": statistics.mean(ttft) * 1e3,
                      "ttft_later_mean_ms": statistics.mean(ttft[args.docs :]) * 1e3, "cached_tokens": cached,
                      "prompt_tokens": prompt_tokens}
        spread = f"; requests per replica {sorted(Counter(served).values())}" if routing else ""
        print(f"{name} router: prefix-cache hit rate {runs[name]['hit_rate']:.1%}, time to first token mean "
              f"{runs[name]['ttft_mean_ms']:.0f} ms (questions after each document's first "
              f"{runs[name]['ttft_later_mean_ms']:.0f} ms){spread}", flush=True)
    serve.shutdown()
    ray.shutdown()
    aware, pow2 = runs["prefix-aware"], runs["power of two"]
    ratio = pow2["ttft_later_mean_ms"] / aware["ttft_later_mean_ms"]
    print(f"ratio: time to first token of repeated documents, power of two / prefix-aware router = {ratio:.1f}x "
          f"(hit rate {aware['hit_rate']:.1%} vs {pow2['hit_rate']:.1%}; {args.replicas} replicas, {args.docs} documents "
          f"of {n} tokens, each cache ~{args.cache_docs} documents)")
    print(json.dumps({"bench": "prefix_routing", "replicas": args.replicas, "docs": args.docs, "doc_tokens": n,
                      "questions": args.questions, "cache_docs": args.cache_docs, "interval": args.interval,
                      "ttft_ratio": ratio, "runs": runs}))


if __name__ == "__main__":
    main()
