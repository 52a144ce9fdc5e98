"""HTTP load: concurrent streaming clients against the Serve app on 127.0.0.1, then the same
requests one at a time, in the same run.

Phase 1: --clients clients (default 32) each send streaming /v1/completions requests back to
back for --duration seconds (default 60), while a prober sends bad requests (malformed JSON,
bad parameters, a wrong API key, an oversize body) through the middle third and checks each
gets its 4xx. Phase 2: one client sends the same requests sequentially for --duration / 3
seconds. Reports requests/s, generated tokens/s, p50/p99 time to first token and inter-token
latency, errors, the replica's RSS before and after phase 1, and the throughput ratio.

    python bench/http_load.py [--duration 60] [--clients 32] [--max-tokens 48] [--url http://127.0.0.1:8000]
"""
import argparse
import asyncio
import contextlib
import itertools
import json
import os
import socket
import time

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from sala.tiny import ensure_tiny_sala, heldout_texts

API_KEY = "bench-key"
MODEL = "tiny-sala"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(url: str | None, model_dir, **app_kwargs):
    """The server to load: `url` when given, else tiny-sala's Serve app started here on local Ray
    (one replica on one CPU and thread, beside the load generator) and stopped afterwards."""
    if url is not None:
        yield url
        return
    import ray
    from ray import serve

    from serve.build import build_app

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, object_store_memory=200 * 2**20, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(str(model_dir), num_cpus=1, num_threads=1, **app_kwargs), name="sala", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


class Stats:
    def __init__(self):
        self.ttft, self.itl, self.requests, self.tokens, self.errors, self.samples = [], [], 0, 0, 0, []

    def summary(self, seconds: float) -> dict:
        def pct(xs, q):
            return round(float(np.percentile(xs, q)) * 1e3, 2) if xs else None

        return {"requests": self.requests, "errors": self.errors, "requests_per_s": round(self.requests / seconds, 2),
                "tokens_per_s": round(self.tokens / seconds, 1), "ttft_p50_ms": pct(self.ttft, 50),
                "ttft_p99_ms": pct(self.ttft, 99), "itl_p50_ms": pct(self.itl, 50), "itl_p99_ms": pct(self.itl, 99)}


async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int, seed: int, stats: Stats) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last, done, tokens = None, False, 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                stats.errors += 1
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    break
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                    continue
                now = time.perf_counter()
                if last is None:
                    stats.ttft.append(now - start)
                else:
                    stats.itl.append(now - last)
                last = now
    except (httpx.HTTPError, json.JSONDecodeError):
        pass
    if done and tokens:
        stats.requests += 1
        stats.tokens += tokens
    else:
        stats.errors += 1


async def client_loop(client, requests, max_tokens: int, deadline: float, stats: Stats) -> None:
    while time.perf_counter() < deadline:
        i, prompt = next(requests)
        await one_request(client, prompt, max_tokens, i, stats)


BAD = [  # (body bytes, headers, expected status)
    (b'{"model": "tiny-sala", "prompt": ', {}, 400),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}).encode(), {}, 400),
    (json.dumps({"model": MODEL, "prompt": "x", "temperature": -1}).encode(), {}, 400),
    (json.dumps({"model": MODEL, "prompt": "x", "top_p": 2}).encode(), {}, 400),
    (json.dumps({"model": "other", "prompt": "x"}).encode(), {}, 404),
    (json.dumps({"model": MODEL}).encode(), {}, 422),
    (json.dumps({"model": MODEL, "prompt": "x"}).encode(), {"Authorization": "Bearer wrong"}, 401),
    (json.dumps({"model": MODEL, "prompt": "x" * (2 << 20)}).encode(), {}, 413),
]


async def prober(client, start: float, end: float, result: dict) -> None:
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    for body, headers, status in itertools.cycle(BAD):
        if time.perf_counter() >= end:
            return
        try:
            r = await client.post("/v1/completions", content=body, headers={"Content-Type": "application/json", **headers})
            ok = r.status_code == status and "error" in r.json()
        except (httpx.HTTPError, ValueError):
            ok = False
        result["sent"] += 1
        result["wrong"] += not ok
        await asyncio.sleep(0.2)


def replica_rss(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "process_resident_memory_bytes":
                return s.value / 2**20
    return float("nan")


async def run(url: str, args, prompts: list[str]) -> dict:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120, limits=limits) as client:
        await one_request(client, prompts[0], args.max_tokens, 0, Stats())  # warm-up
        rss_start = replica_rss(url)
        concurrent, probe = Stats(), {"sent": 0, "wrong": 0}
        requests = itertools.cycle(enumerate(prompts))
        t0 = time.perf_counter()
        deadline = t0 + args.duration
        third = args.duration / 3
        await asyncio.gather(prober(client, t0 + third, t0 + 2 * third, probe),
                             *(client_loop(client, requests, args.max_tokens, deadline, concurrent) for _ in range(args.clients)))
        t_concurrent = time.perf_counter() - t0
        rss_end = replica_rss(url)
        sequential = Stats()
        requests = itertools.cycle(enumerate(prompts))
        t0 = time.perf_counter()
        await client_loop(client, requests, args.max_tokens, t0 + args.duration / 3, sequential)
        t_sequential = time.perf_counter() - t0
    c, s = concurrent.summary(t_concurrent), sequential.summary(t_sequential)
    return {"concurrent": c, "sequential": s, "bad_requests_sent": probe["sent"], "bad_requests_wrong_status": probe["wrong"],
            "rss_start_mib": round(rss_start, 1), "rss_end_mib": round(rss_end, 1),
            "throughput_ratio": round(c["tokens_per_s"] / s["tokens_per_s"], 2) if s["tokens_per_s"] else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of concurrent load")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--url", help="an already running server (started with SALA_API_KEY=bench-key); default: start one")
    args = ap.parse_args()
    model_dir = ensure_tiny_sala()
    prompts = [t[:200] for t in heldout_texts(model_dir) if len(t) > 50][:64]
    with served(args.url, model_dir, served_model_name=MODEL, api_key=API_KEY) as url:
        result = asyncio.run(run(url, args, prompts))
    c, s = result["concurrent"], result["sequential"]
    print(f"\nHTTP load on {url}: {args.clients} streaming clients for {args.duration:.0f}s, then sequential; "
          f"max_tokens={args.max_tokens}")
    print(f"{'':<12}{'req/s':>8}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'errors':>8}")
    for name, r in (("concurrent", c), ("sequential", s)):
        print(f"{name:<12}{r['requests_per_s']:>8}{r['tokens_per_s']:>9}{r['ttft_p50_ms']:>9}ms{r['ttft_p99_ms']:>8}ms"
              f"{r['itl_p50_ms']:>7}ms{r['itl_p99_ms']:>7}ms{r['errors']:>8}")
    print(f"throughput ratio concurrent/sequential: {result['throughput_ratio']}x; bad requests: {result['bad_requests_sent']} "
          f"sent, {result['bad_requests_wrong_status']} with the wrong answer; replica RSS {result['rss_start_mib']} -> "
          f"{result['rss_end_mib']} MiB")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
