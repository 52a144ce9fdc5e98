"""Prefix-aware routing across Serve replicas (serve/router.py).

The block map and prompt extraction against hand-worked cases; then two tiny-sala replicas on a
real local Ray behind the routing ingress, over real HTTP: the repeats of a long prefix all land
on the replica that served it first and find it cached (which, with two replicas and random
routing, would happen only by luck), a second document goes to the other replica, and what comes
back through the relay (streamed or not, errors included) is what the replica answers.
"""
import asyncio
import json
import threading
import time

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from ray.exceptions import ActorDiedError

from serve.replica_routing import ServedPrompts
from serve.router import PrefixMap, RelayedResponse, RoutingOptions, block_hashes, prompt_key
from tests.conftest import free_port, serve_tiny_sala


def test_prefix_map_matches_whole_leading_blocks_per_replica():
    m = PrefixMap(block_chars=4, max_blocks=100)
    m.insert("abcdefghij", "r1")  # blocks abcd, efgh; "ij" is not a whole block
    m.insert("abcdXXXX", "r2")
    assert m.match("abcdefghZZZZ", ["r1", "r2", "r3"]) == {"r1": 8, "r2": 4, "r3": 0}
    assert m.match("efghabcd", ["r1", "r2"]) == {"r1": 0, "r2": 0}  # a block counts only after its own prefix
    assert m.num_held == {"r1": 2, "r2": 2}
    m.remove("r1")
    assert m.match("abcdefgh", ["r1", "r2"]) == {"r1": 0, "r2": 4} and "r1" not in m.num_held


def test_prefix_map_evicts_least_recent_leaves_first():
    m = PrefixMap(block_chars=2, max_blocks=3)
    m.insert("aabbcc", "r")  # 3 blocks
    m.insert("ddee", "s")  # 2 more: the oldest leaves go, deepest first
    assert m.match("aabbcc", ["r"]) == {"r": 2}  # "aa" kept (touched last within its chain), "bb", "cc" gone
    assert m.match("ddee", ["s"]) == {"s": 4}
    assert len(m.holders) == 3 and sum(m.num_held.values()) == 3


def test_prefix_map_forgets_what_a_replica_no_longer_holds():
    m = PrefixMap(block_chars=4, max_blocks=100)
    m.insert("abcdefgh", "r1", now=1.0)
    m.insert("abcdefgh", "r2", now=1.0)
    m.insert("abcdWXYZ", "r1", now=3.0)  # routed after the question below was asked
    held = set(block_hashes("abcdefg", 4))  # r1 reports holding only "abcd"
    assert m.forget_unheld("r1", held, asked_at=2.0) == 1  # "efgh"; "WXYZ" was sent since: kept
    assert m.match("abcdefgh", ["r1", "r2"]) == {"r1": 4, "r2": 8}
    assert m.match("abcdWXYZ", ["r1"]) == {"r1": 8}
    assert m.num_held == {"r1": 2, "r2": 2}


def test_served_prompts_report_the_blocks_still_cached():
    doc, running = "x" * 40 + "A", "running " * 4  # 41 and 32 characters
    sp = ServedPrompts()
    sp.add(doc, list(range(10)))
    sp.begin(running)  # in flight, its tokens not yet recorded: all of it is about to be held
    # 5 of doc's 10 tokens resumable: its first 20 characters, 5 blocks of 4
    assert sp.held_blocks({doc: 5}, 0, 4) == block_hashes(doc, 4)[:5] + block_hashes(running, 4)
    assert sp.to_look_up(dict(sp.tokens), 0) == {}  # nothing evicted since: no new look-up
    assert list(sp.to_look_up(dict(sp.tokens), 3)) == [doc]
    sp.end(running)
    assert sp.held_blocks({doc: 0}, 3, 4) == [] and not sp.tokens  # evicted, and forgotten


def test_prompt_key_per_endpoint():
    assert prompt_key("/v1/completions", b'{"prompt": "doc q"}') == "doc q"
    assert prompt_key("/v1/completions", b'{"prompt": ["first", "second"]}') == "first"
    assert prompt_key("/generate", b'{"input_ids": [104, 105]}') == "hi"
    assert prompt_key("/generate", b'{"text": "t", "input_ids": null}') == "t"
    chat = prompt_key("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "doc"}]}).encode())
    assert chat.startswith('[{"content": "doc"')  # a shared leading message is a shared prefix
    assert prompt_key("/v1/completions", b"not json") is None
    assert prompt_key("/tokenize", b'{"prompt": "x"}') is None


def test_routing_options_refuse_bad_values():
    for bad in ({"block_chars": 0}, {"imbalanced_threshold": -1}, {"min_match_rate": 2}, {"refresh_interval_s": -1}):
        with pytest.raises(ValueError):
            RoutingOptions(**bad)
    with pytest.raises(TypeError, match="nonsense"):
        RoutingOptions(nonsense=1)
    from serve.build import build_app

    for bad, match in (({"num_replicas": 0}, "num_replicas"), ({"prefix_routing_options": {"block_chars": 0}}, "block_chars"),
                       ({"prefix_routing": False, "prefix_routing_options": {"block_chars": 64}}, "prefix_routing off")):
        with pytest.raises(ValueError, match=match):
            build_app(**bad)


@pytest.fixture(scope="module")
def routed_server(tiny_sala_dir):
    yield from serve_tiny_sala(tiny_sala_dir, "routed", num_replicas=2, prefix_routing=True, compile=False,
                               prefix_snapshot_interval=128, max_tokens_limit=256,
                               prefix_routing_options={"refresh_interval_s": 0.2})


def documents(model_dir, tokenizer, n: int, tokens: int) -> list[str]:
    from sala.tiny import heldout_texts

    ids = tokenizer("\n\n".join(heldout_texts(model_dir)))["input_ids"]
    return [tokenizer.decode(ids[i * tokens : (i + 1) * tokens]) for i in range(n)]


def test_repeated_prefix_lands_on_the_replica_holding_it(routed_server, tiny_sala_dir, tokenizer):
    doc_a, doc_b = documents(tiny_sala_dir, tokenizer, 2, 400)
    served: dict[str, list[str]] = {"a": [], "b": []}
    cached: dict[str, list[int]] = {"a": [], "b": []}
    with httpx.Client(base_url=routed_server, timeout=120) as http:
        for i in range(3):
            r = http.post("/v1/completions", json={"prompt": doc_a + f"\nQuestion {i}: what is it?", "max_tokens": 2})
            assert r.status_code == 200, r.text
            served["a"].append(r.headers["x-sala-replica"])
            cached["a"].append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            r = http.post("/generate", json={"text": doc_b + f"\nAsked {i}", "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200, r.text
            served["b"].append(r.headers["x-sala-replica"])
            cached["b"].append(r.json()["meta_info"]["cached_tokens"])
    assert len(set(served["a"])) == 1 and len(set(served["b"])) == 1, served
    assert served["a"][0] != served["b"][0], "the second document should go to the replica holding nothing"
    for doc in "ab":
        assert cached[doc][0] == 0 and all(c >= 128 for c in cached[doc][1:]), cached


def test_relay_passes_streams_and_errors_through(routed_server):
    with httpx.Client(base_url=routed_server, timeout=120) as http:
        body = {"prompt": "The json module", "max_tokens": 6, "temperature": 0}
        whole = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == whole
        bad = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
        assert http.get("/health").json() == {"status": "ok"}
        assert http.get("/no/such/path").status_code == 404


class LostAfter:
    """What a Serve handle's streaming call gives the relay (a DeploymentResponseGenerator): these
    ASGI messages, then, once `lose` is set, ActorDiedError, as when the replica dies after its
    last message but before the stream's end has reached the caller."""

    def __init__(self, messages: list[dict], lose: asyncio.Event | None = None):
        self.messages, self.lose = messages, lose

    def cancel(self) -> None:
        """The relay's call when its client leaves: no replica runs this one to stop."""

    async def __aiter__(self):
        for m in self.messages:
            yield m
        if self.lose is not None:
            await self.lose.wait()
            raise ActorDiedError()


def test_a_replica_lost_after_a_streams_done_ends_the_response_there():
    """A stream's `[DONE]` is a body of its own and the empty last body follows (StreamingResponse):
    a replica lost between the two has sent the whole stream. The response ends as it would have,
    nothing after `[DONE]` (an error event there would be an event past the stream's end)."""
    stream = [{"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]},
              {"type": "http.response.body", "body": b"data: x\n\n", "more_body": True},
              {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True}]
    sent = []

    async def relay():
        async def send(message):
            sent.append(message)

        lose = asyncio.Event()
        lose.set()
        await RelayedResponse(lambda: LostAfter(stream, lose=lose))({"type": "http"}, None, send)

    asyncio.run(relay())
    assert sent[:3] == stream
    assert sent[3:] == [{"type": "http.response.body", "body": b"", "more_body": False}]


def test_a_replica_lost_after_the_last_body_costs_the_connection_nothing():
    """One keep-alive connection: a stream arrives whole, its client sends the next request on the
    same connection, and only then does the first call's replica die. Nothing may follow a
    response's last body (ASGI; uvicorn closes the connection on it, which drops the request now
    on it), so the second answer arrives and the first is the replica's alone."""
    stream = [{"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]},
              {"type": "http.response.body", "body": b"data: x\n\n", "more_body": True},
              {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}]
    second_in = asyncio.Event()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/first":
            await RelayedResponse(lambda: LostAfter(stream, lose=second_in))(scope, receive, send)
        else:
            second_in.set()
            await asyncio.sleep(0.2)  # the first call's loss lands while this request is on the connection
            await RelayedResponse(lambda: LostAfter([{"type": "http.response.start", "status": 200, "headers": []},
                                                     {"type": "http.response.body", "body": b"ok"}]))(scope, receive, send)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "uvicorn stopped before it started serving"
            time.sleep(0.01)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                          limits=httpx.Limits(max_connections=1)) as http:
            first = http.post("/first")
            assert first.status_code == 200 and first.text == "data: x\n\ndata: [DONE]\n\n"
            second = http.post("/second")
            assert second.status_code == 200 and second.text == "ok"
    finally:
        server.should_exit = True
        thread.join(10)


def replica_metrics(http: httpx.Client) -> dict[str, dict]:
    """/metrics through the ingress: every replica's series, told apart by their `replica` label
    (the same ids as the responses' x-sala-replica), by replica."""
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    seen: dict[str, dict] = {}
    for f in text_string_to_metric_families(r.text):
        for s in f.samples:
            labels = dict(s.labels)
            seen.setdefault(labels.pop("replica"), {})[(s.name, tuple(sorted(labels.items())))] = s.value
    return seen


def test_metrics_and_aborts_reach_every_replica(routed_server, tiny_sala_dir, tokenizer):
    """One scrape holds both replicas' series; /abort_request aborts a request on whichever replica
    holds it (the two streams are on different replicas: two distinct prompts spread)."""
    doc_a, doc_b = documents(tiny_sala_dir, tokenizer, 2, 400)
    gen = {"stream": True, "sampling_params": {"max_new_tokens": 250, "ignore_eos": True}}
    with httpx.Client(base_url=routed_server, timeout=120) as http:
        before = replica_metrics(http)
        assert len(before) == 2, list(before)
        with http.stream("POST", "/generate", json=gen | {"text": doc_a + "\nAbort me", "rid": "abort-a"}) as ra, \
                http.stream("POST", "/generate", json=gen | {"text": doc_b + "\nAbort me too", "rid": "abort-b"}) as rb:
            replicas = {"abort-a": ra.headers["x-sala-replica"], "abort-b": rb.headers["x-sala-replica"]}
            assert set(replicas.values()) == set(before), replicas
            lines = {rid: r.iter_lines() for rid, r in (("abort-a", ra), ("abort-b", rb))}
            for it in lines.values():
                assert next(line for line in it if line.startswith("data: "))  # both are generating
            assert http.post("/abort_request", json={"rid": "abort-b"}).json() == {"aborted": ["abort-b"]}
            assert http.post("/abort_request", json={"abort_all": True}).json() == {"aborted": ["abort-a"]}
            for rid, it in lines.items():
                events = [json.loads(line[6:]) for line in it if line.startswith("data: ") and line != "data: [DONE]"]
                assert events[-1]["meta_info"]["finish_reason"] == {"type": "abort"}, rid
                assert events[-1]["meta_info"]["completion_tokens"] < 250, rid
        bad = http.post("/abort_request", json={})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "rid"
        after = replica_metrics(http)
    cancelled = ("sala_finished_requests_total", (("reason", "cancelled"),))
    for rid, replica in replicas.items():
        assert after[replica][cancelled] == before[replica][cancelled] + 1, rid
    generated = ("sala_generation_tokens_total", ())
    assert all(after[r][generated] > before[r][generated] for r in before)


def test_a_client_leaving_cancels_its_request_through_the_relay(routed_server):
    body = {"prompt": "The for statement", "max_tokens": 250, "temperature": 0, "ignore_eos": True, "stream": True}
    cancelled = ("sala_finished_requests_total", (("reason", "cancelled"),))
    running = ("sala_running_requests", ())
    with httpx.Client(base_url=routed_server, timeout=120) as http:
        before = replica_metrics(http)
        with http.stream("POST", "/v1/completions", json=body) as r:
            replica = r.headers["x-sala-replica"]
            assert any(line.startswith("data: ") for _, line in zip(range(4), r.iter_lines()))
        for _ in range(50):
            after = replica_metrics(http)
            if all(m[running] == 0 for m in after.values()):
                break
            time.sleep(0.1)
        assert after[replica][running] == 0
        assert after[replica][cancelled] == before[replica][cancelled] + 1, "the request ran on after its client left"


def test_the_router_forgets_what_replicas_evict(routed_server, tiny_sala_dir, tokenizer):
    """Replicas report what they hold: a served document stays in the router's view across
    refreshes, and once the replicas flush their caches it leaves it."""
    view = ("sala_router_prefix_blocks", ())
    pages = ("sala_prefix_cache_pages", ())
    (doc,) = documents(tiny_sala_dir, tokenizer, 1, 400)
    with httpx.Client(base_url=routed_server, timeout=120) as http:
        r = http.post("/v1/completions", json={"prompt": doc + "\nOnce more?", "max_tokens": 1})
        assert r.status_code == 200, r.text
        time.sleep(0.6)  # a few refreshes
        replica = r.headers["x-sala-replica"]
        assert replica_metrics(http)[replica][view] >= len(doc) // 256 - 1, "the replica still holds the document"
        assert http.post("/flush_cache").json()["flushed_pages"] > 0
        for _ in range(50):
            after = replica_metrics(http)
            if all(m[view] == 0 for m in after.values()):
                break
            time.sleep(0.1)
    assert all(m[pages] == 0 for m in after.values())
    assert {r: m[view] for r, m in after.items()} == dict.fromkeys(after, 0)
