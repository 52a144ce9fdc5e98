"""Soak: many streaming clients against the Serve app for a long while, with clients that leave
mid-stream, requests aborted by rid and bad requests mixed in.

First every prompt's greedy answer is fetched non-streamed, one request at a time, from each
of /v1/completions (text and the logprobs' token list), /v1/chat/completions and /generate.
Then --clients clients (default 32) stream greedy requests for --duration seconds (default
600): each finished stream's text (and, for completions, its token list) must equal the
non-streamed answer, so a token lost or sent twice is caught. One request in --leave-every
is left after a few events, one /generate stream in --abort-every is aborted through
/abort_request (it must end with finish_reason abort), and a prober sends bad requests (each
must get its 4xx, as JSON). The replica's RSS is sampled from /metrics every few seconds.

Pass: zero 5xx (statuses and in-band stream errors), zero mismatches, zero bad requests with
the wrong answer, and RSS at the end within --rss-tolerance (5%) of its value at minute 1
(at half the duration when shorter than 2 minutes). The server runs in the evaluation mode
(--batch-invariant, default on): greedy tokens must not depend on what else shares the batch
for "equal to the non-streamed answer" to be exact.

    python bench/soak.py [--duration 600] [--clients 32] [--max-tokens 32] [--url http://127.0.0.1:8000]
"""
import argparse
import asyncio
import itertools
import json
import random
import time
from collections import Counter

import httpx
from http_load import replica_rss, served  # bench/ is this script's sys.path[0]

from sala.tiny import ensure_tiny_sala, heldout_texts

API_KEY = "soak-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}

BAD = [  # (path, body bytes, headers, expected status)
    ("/v1/completions", b'{"prompt": ', {}, 400),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 0}).encode(), {}, 400),
    ("/v1/completions", json.dumps({"prompt": "x", "frobnicate": 1}).encode(), {}, 400),
    ("/v1/completions", json.dumps({"prompt": "x", "logit_bias": {"3": 500}}).encode(), {}, 400),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                         "response_format": {"type": "json_object"}}).encode(), {}, 400),
    ("/v1/chat/completions", json.dumps({"messages": []}).encode(), {}, 422),
    ("/generate", json.dumps({"text": "x", "sampling_params": {"regex": "a+"}}).encode(), {}, 400),
    ("/generate", json.dumps({"input_ids": [10**9]}).encode(), {}, 400),
    ("/v1/completions", json.dumps({"prompt": "x"}).encode(), {"Authorization": "Bearer clé".encode()}, 401),
    ("/v1/completions", json.dumps({"prompt": "x" * (2 << 20)}).encode(), {}, 413),
    ("/nowhere", b"{}", {}, 404),
]


class Tally:
    def __init__(self):
        self.statuses: Counter = Counter()
        self.server_errors = 0  # 5xx statuses and in-band stream errors
        self.compared = self.mismatches = 0
        self.left = self.aborted = self.abort_wrong = 0
        self.tokens = 0
        self.bad_sent = self.bad_wrong = 0
        self.examples: list[str] = []

    def mismatch(self, what: str) -> None:
        self.mismatches += 1
        if len(self.examples) < 5:
            self.examples.append(what)


def bodies(prompt: str, max_tokens: int) -> dict[str, dict]:
    greedy = {"max_tokens": max_tokens, "temperature": 0}
    return {"/v1/completions": {"prompt": prompt, "logprobs": 0, **greedy},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": prompt}], **greedy},
            "/generate": {"text": prompt, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}}}


def answer(path: str, body: dict) -> tuple[str, list[str] | None]:
    """(text, completion tokens) of a non-streamed response."""
    if path == "/v1/completions":
        c = body["choices"][0]
        return c["text"], c["logprobs"]["tokens"]
    if path == "/v1/chat/completions":
        return body["choices"][0]["message"]["content"], None
    return body["text"], None


async def references(client, prompts: list[str], max_tokens: int) -> dict:
    refs = {}
    for i, p in enumerate(prompts):
        for path, body in bodies(p, max_tokens).items():
            r = await client.post(path, json=body)
            r.raise_for_status()
            refs[i, path] = answer(path, r.json())
    return refs


async def stream_once(client, tally: Tally, refs: dict, i: int, path: str, body: dict, leave_after: int | None,
                      abort_rid: str | None) -> None:
    body = {**body, "stream": True}
    if abort_rid:
        body["rid"] = abort_rid
    text, tokens, events, finish = "", [], 0, None
    try:
        async with client.stream("POST", path, json=body) as r:
            tally.statuses[r.status_code] += 1
            if r.status_code >= 500:
                tally.server_errors += 1
                return
            if r.status_code != 200:
                tally.mismatch(f"{path} stream answered {r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    tally.server_errors += 1
                    return
                events += 1
                if leave_after is not None and events >= leave_after:
                    tally.left += 1
                    return  # the client goes away mid-stream
                if abort_rid and events == 2:
                    a = await client.post("/abort_request", json={"rid": abort_rid})
                    tally.statuses[a.status_code] += 1
                if path == "/generate":
                    text, finish = event["text"], event["meta_info"]["finish_reason"]
                elif event.get("choices"):
                    c = event["choices"][0]
                    if path == "/v1/completions":
                        text += c["text"]
                        tokens += (c.get("logprobs") or {}).get("tokens", [])
                    else:
                        text += c["delta"].get("content") or ""
    except httpx.HTTPError as e:
        tally.mismatch(f"{path}: transport error {type(e).__name__}: {e}")
        return
    if abort_rid:
        tally.aborted += 1
        tally.abort_wrong += finish is None or finish.get("type") not in ("abort", "length", "stop")
        return
    want_text, want_tokens = refs[i, path]
    tally.compared += 1
    tally.tokens += len(tokens) if want_tokens is not None else 0
    if text != want_text or (want_tokens is not None and tokens != want_tokens):
        tally.mismatch(f"{path} prompt {i}: streamed {text!r:.80} vs {want_text!r:.80}")


async def client_loop(client, tally, refs, prompts, max_tokens, deadline, rng: random.Random, args, ids) -> None:
    while time.perf_counter() < deadline:
        i = rng.randrange(len(prompts))
        path = rng.choice(["/v1/completions", "/v1/completions", "/v1/chat/completions", "/generate"])
        n = next(ids)
        leave = rng.randint(1, 4) if n % args.leave_every == 0 else None
        rid = f"soak-{n}" if path == "/generate" and leave is None and n % args.abort_every == 1 else None
        await stream_once(client, tally, refs, i, path, bodies(prompts[i], max_tokens)[path], leave, rid)


async def prober(client, tally: Tally, deadline: float) -> None:
    for path, body, headers, status in itertools.cycle(BAD):
        if time.perf_counter() >= deadline:
            return
        try:
            r = await client.post(path, content=body, headers={"Content-Type": "application/json", **headers})
            tally.statuses[r.status_code] += 1
            tally.server_errors += r.status_code >= 500
            ok = r.status_code == status and isinstance(r.json().get("error"), dict)
        except (httpx.HTTPError, ValueError):
            ok = False
        tally.bad_sent += 1
        tally.bad_wrong += not ok
        await asyncio.sleep(0.25)


async def memory_sampler(url: str, start: float, deadline: float, samples: list) -> None:
    while time.perf_counter() < deadline:
        samples.append((time.perf_counter() - start, await asyncio.to_thread(replica_rss, url)))
        await asyncio.sleep(5)


async def run(url: str, args, prompts: list[str]) -> dict:
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=300, limits=limits) as client:
        t = time.perf_counter()
        refs = await references(client, prompts, args.max_tokens)
        print(f"{len(refs)} non-streamed reference answers in {time.perf_counter() - t:.1f} s", flush=True)
        tally, samples = Tally(), []
        rng, ids = random.Random(0), itertools.count()
        start = time.perf_counter()
        deadline = start + args.duration

        async def progress():
            while time.perf_counter() < deadline:
                await asyncio.sleep(30)
                print(f"  {time.perf_counter() - start:5.0f} s: {tally.compared} streams compared, {tally.mismatches} "
                      f"mismatches, {tally.server_errors} 5xx, RSS {samples[-1][1]:.1f} MiB", flush=True)

        await asyncio.gather(memory_sampler(url, start, deadline, samples), prober(client, tally, deadline), progress(),
                             *(client_loop(client, tally, refs, prompts, args.max_tokens, deadline,
                                           random.Random(rng.random()), args, ids) for _ in range(args.clients)))
        elapsed = time.perf_counter() - start
        samples.append((elapsed, replica_rss(url)))
        idle = (await client.get("/get_server_info")).json()
    mark = 60.0 if args.duration >= 120 else args.duration / 2
    rss_mark = min(samples, key=lambda s: abs(s[0] - mark))[1]
    rss_end = samples[-1][1]
    ratio = rss_end / rss_mark
    ok = (tally.server_errors == 0 and tally.mismatches == 0 and tally.bad_wrong == 0 and tally.abort_wrong == 0
          and abs(ratio - 1) <= args.rss_tolerance and tally.compared > 0)
    return {"duration_s": round(elapsed, 1), "clients": args.clients, "max_tokens": args.max_tokens,
            "streams_compared": tally.compared, "mismatches": tally.mismatches, "server_errors": tally.server_errors,
            "left_mid_stream": tally.left, "aborted": tally.aborted, "abort_wrong": tally.abort_wrong,
            "bad_requests_sent": tally.bad_sent, "bad_requests_wrong": tally.bad_wrong,
            "completion_tokens_compared": tally.tokens, "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
            "rss_mark_s": round(mark), "rss_mark_mib": round(rss_mark, 1), "rss_end_mib": round(rss_end, 1),
            "rss_ratio": round(ratio, 4), "running_after": idle["running_requests"], "queued_after": idle["queued_requests"],
            "examples": tally.examples, "verdict": "PASS" if ok else "FAIL"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load (default: %(default)s)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=24, help="distinct prompts (each with references on three endpoints)")
    ap.add_argument("--leave-every", type=int, default=8, help="one request in this many leaves mid-stream")
    ap.add_argument("--abort-every", type=int, default=10, help="one request in this many is a /generate aborted by rid")
    ap.add_argument("--rss-tolerance", type=float, default=0.05)
    ap.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                    help="serve in the fast mode (greedy may then differ at near-ties, counted as mismatches)")
    ap.add_argument("--url", help=f"an already running server (SALA_API_KEY={API_KEY}); default: start one")
    args = ap.parse_args()
    model_dir = ensure_tiny_sala()
    prompts = [t[:160] for t in heldout_texts(model_dir) if len(t) > 50][: args.prompts]
    with served(args.url, model_dir, api_key=API_KEY, batch_invariant=args.batch_invariant) as url:
        result = asyncio.run(run(url, args, prompts))
    r = result
    print(f"\nsoak on {url}: {args.clients} streaming clients for {r['duration_s']:.0f} s, max_tokens={args.max_tokens}")
    print(f"  streams compared with their non-streamed answer: {r['streams_compared']}, mismatches: {r['mismatches']} "
          f"({r['completion_tokens_compared']} completion tokens compared one by one)")
    print(f"  5xx (statuses and in-band): {r['server_errors']}; left mid-stream: {r['left_mid_stream']}; aborted by rid: "
          f"{r['aborted']} ({r['abort_wrong']} wrong); bad requests: {r['bad_requests_sent']} ({r['bad_requests_wrong']} wrong)")
    print(f"  statuses: {r['statuses']}; after: {r['running_after']} running, {r['queued_after']} queued")
    for e in r["examples"]:
        print(f"  e.g. {e}")
    print(f"replica RSS end / at {r['rss_mark_s']} s: {r['rss_end_mib']} / {r['rss_mark_mib']} MiB = {r['rss_ratio']:.4f}x "
          f"(tolerance {args.rss_tolerance:.0%}); verdict: {r['verdict']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
