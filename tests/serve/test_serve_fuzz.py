"""Property-based fuzzing of the live HTTP API (hypothesis): generated bodies, headers, raw
bytes, paths and methods against every route of the Serve app on 127.0.0.1.

Properties, for every request: no 5xx; every error is JSON `{"error": {...}}` with a message,
and an error about a field names it (`param` is a field of the body, or the one it lacks); a
streamed 200 carries only JSON events and `[DONE]`, never an in-band server error. Afterwards
the server is alive, answers a known request exactly as before, and its replica's RSS is flat.

Bodies are drawn from the request models themselves (every field with values of its type,
edge values and wrong types mixed in) plus unknown fields, so a route or field added later is
fuzzed without editing this file. The server runs with max_tokens_limit=4: generation stays
short. Requests go one at a time, so the queue (256) never fills: a 503 would be a failure.
"""
import functools
import json
import re
import types
import typing
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from tests.conftest import serve_tiny_sala

API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
FUZZ = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
# Measured on tiny-sala (2 cores): RSS after ~2100 fuzzed requests +0.5% over the warmed-up value; 7-15% of
# the bodies test_fuzzed_bodies sends a route are served (200), the rest refused (STATUSES counts those
# bodies only: raw bytes sent to a random route are almost never served).
RSS_GROWTH_LIMIT = 0.05


@pytest.fixture(scope="module")
def server(tiny_sala_dir):
    yield from serve_tiny_sala(tiny_sala_dir, "sala-fuzz", api_key=API_KEY, batch_invariant=True,
                               max_body_bytes=16 << 10, max_tokens_limit=4, max_seqs=4)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=60) as c:
        yield c


KNOWN = {"prompt": "The json module", "max_tokens": 3, "temperature": 0}
STATUSES: Counter = Counter()  # (route, status) of every fuzzed body, to show the fuzzing reached the engine


def replica_rss(http) -> float:
    text = http.get("/metrics").text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "process_resident_memory_bytes")


@pytest.fixture(scope="module")
def baseline(http):
    """The answer to a known request, and the replica's RSS after a warm-up of varied valid requests."""
    known = http.post("/v1/completions", json=KNOWN, headers=AUTH).json()["choices"][0]["text"]
    for i in range(60):
        body = [{"prompt": "x " * (i % 17 + 1), "max_tokens": 1 + i % 4, "n": 1 + i % 2, "temperature": i % 3 / 2,
                 "stream": i % 2 == 0, "seed": i},
                {"messages": [{"role": "user", "content": "Hi " * (i % 9 + 1)}], "max_tokens": 2, "logprobs": True,
                 "top_logprobs": i % 3}][i % 2]
        http.post("/v1/completions" if "prompt" in body else "/v1/chat/completions", json=body, headers=AUTH)
    return known, replica_rss(http)


# ---------------------------------------------------------------- strategies
def routes() -> list[tuple[str, str]]:
    """Every (path, method) the app serves, from its OpenAPI schema (so routes added later are fuzzed too);
    the app as a replica builds it, over the server class rather than a replica (the schema calls no route)."""
    from serve.http import build_api
    from serve.server import SalaServer

    api = build_api(SalaServer.func_or_class, api_key=None, max_body_bytes=0)
    return sorted((path, method.upper()) for path, ops in api.openapi()["paths"].items() for method in ops)


def body_models() -> dict[str, type[BaseModel]]:
    """Route -> its request model (a POST route not listed gets bodies built from every model's fields)."""
    from serve import protocol

    return {"/v1/completions": protocol.CompletionRequest, "/v1/chat/completions": protocol.ChatCompletionRequest,
            "/generate": protocol.GenerateRequest, "/abort_request": protocol.AbortRequest,
            **{p: protocol.TokenizeRequest for p in ("/tokenize", "/v1/tokenize")},
            **{p: protocol.DetokenizeRequest for p in ("/detokenize", "/v1/detokenize")}}


PLAIN_WORDS = st.sampled_from(["The json module", "def fib(n):", "Hi", "a list", " x"])
EDGE_WORDS = st.sampled_from(["", " ", "héllo 東京 🙂", "\x00", "a" * 300, "<|im_end|>", "\ud800", "null"])
WORDS = st.one_of(PLAIN_WORDS, PLAIN_WORDS, EDGE_WORDS)
# Mostly values the server takes (so requests reach the engine), edges and overflows mixed in.
INTS = st.one_of(st.integers(0, 4), st.integers(0, 4), st.integers(-3, 20),
                 st.sampled_from([16, 17, 255, 256, 257, 2**31, 2**63, 2**64, -2**63, 10**30]))
FLOATS = st.one_of(st.floats(0, 1), st.floats(0, 1), st.floats(-3, 3),
                   st.sampled_from([1e-9, 100.0, 101.0, -101.0, 1e308, float("inf"), float("-inf"), float("nan")]))
JSON = st.recursive(st.none() | st.booleans() | INTS | FLOATS | WORDS,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(WORDS | st.text(max_size=6), inner, max_size=4),
                    max_leaves=12)
UNKNOWN = st.sampled_from(["frobnicate", "response_format", "tools", "tool_choice", "extra", "regex", "json_schema"])
# A body each route serves; fuzzed bodies change a few of its fields.
VALID = {"/v1/completions": {"prompt": "The json module", "max_tokens": 2},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
         "/generate": {"text": "def fib(n):", "sampling_params": {"max_new_tokens": 2}},
         "/abort_request": {"rid": "nothing-by-this-id"},
         **{p: {"prompt": "The json module"} for p in ("/tokenize", "/v1/tokenize")},
         **{p: {"tokens": [5, 6, 7]} for p in ("/detokenize", "/v1/detokenize")}}


def of_type(tp, depth: int = 0) -> st.SearchStrategy:
    """Values of a field's annotation, biased to what the server must take or refuse with care."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(of_type(a, depth) for a in args))
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is list:
        return st.lists(of_type(args[0], depth + 1), max_size=5 if depth else 3)
    if origin is dict:
        keys = st.one_of(st.integers(-2, 300).map(str), WORDS) if args[0] is str else of_type(args[0], depth + 1)
        return st.dictionaries(keys, of_type(args[1], depth + 1), max_size=3)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return changed(tp, {}, depth + 1)
    return {bool: st.booleans(), int: INTS, float: FLOATS, str: WORDS, type(None): st.none()}.get(tp, JSON)


def field_values(model: type[BaseModel], depth: int) -> dict[str, st.SearchStrategy]:
    """Per field: a value of its type nine times in ten, any JSON the tenth (deep down: any JSON)."""
    return {name: st.one_of(*[of_type(f.annotation, depth)] * 9, JSON) if depth < 3 else JSON
            for name, f in model.model_fields.items()}


def changed(model: type[BaseModel], base: dict, depth: int = 0) -> st.SearchStrategy:
    """`base` with up to three fields set to drawn values (nested objects merged into base's),
    sometimes a field dropped, sometimes an unknown field added."""
    fields = field_values(model, depth)

    def apply(t):
        changes, drop, unknown = t
        body = dict(base)
        for k, v in changes.items():
            body[k] = {**body[k], **v} if isinstance(body.get(k), dict) and isinstance(v, dict) else v
        for k in drop:
            body.pop(k, None)
        return {**body, **unknown}

    changes = st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=3).flatmap(
        lambda names: st.fixed_dictionaries({n: fields[n] for n in names})) if fields else st.just({})  # /flush_cache has none
    rarely = st.one_of(*[st.just([])] * 9, st.lists(st.sampled_from(sorted(base) or [""]), max_size=1))
    unknown = st.one_of(*[st.just({})] * 9, st.dictionaries(UNKNOWN, JSON, max_size=1))
    return st.tuples(changes, rarely, unknown).map(apply)


def model_bodies(model: type[BaseModel], path: str | None = None) -> st.SearchStrategy:
    """Mostly a valid body with a few fields changed; now and then every field drawn at once."""
    every = st.fixed_dictionaries({}, optional=field_values(model, 0))
    return st.one_of(*[changed(model, VALID.get(path, {}))] * 4, every)


def all_fields_model() -> st.SearchStrategy:
    """For a route with no model in body_models: bodies built from every model's fields."""
    from serve import protocol

    models = [m for m in vars(protocol).values() if isinstance(m, type) and issubclass(m, BaseModel) and m is not BaseModel]
    return st.one_of(*(model_bodies(m) for m in models))


def request_fields(path: str) -> set[str]:
    model = body_models().get(path)
    return set(model.model_fields) if model else set()


# ---------------------------------------------------------------- checks
def check(r: httpx.Response, body, path: str) -> None:
    assert r.status_code < 500, f"{r.status_code} for {path} {body!r:.300}: {r.text[:500]}"
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err, dict) and err["message"], r.text
        about_a_field = isinstance(body, dict) and path in body_models() and r.status_code in (400, 404) \
            and err.get("code") not in ("invalid_json", "request_too_large")
        if about_a_field:
            param = err["param"]
            assert param, f"an error about {body!r:.200} names no field: {err}"
            field = re.split(r"[.\[]", param)[0]  # OpenAI's names: tools[0].function.name
            assert field in set(body) | request_fields(path), f"{param!r} is not a field of {body!r:.200}"


def read(r: httpx.Response, disconnect: bool) -> None:
    """A streamed 200: only JSON events and [DONE], no in-band server error (or leave early)."""
    for i, line in enumerate(r.iter_lines()):
        if disconnect and i >= 1:
            return
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[6:]
        if data != "[DONE]":
            event = json.loads(data)
            assert "error" not in event, event


def send(http, method: str, path: str, *, body=None, content: bytes | None = None, headers=None, disconnect=False) -> None:
    headers = {**AUTH, **(headers or {})}
    if content is None and body is not None:
        content = json.dumps(body).encode()
    with http.stream(method, path, content=content, headers=headers) as r:
        if body is not None:
            STATUSES[path, r.status_code] += 1
        if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
            read(r, disconnect)
            return
        r.read()
        check(r, body, path)


POSTS = [p for p, m in routes() if m == "POST"]


@functools.cache
def bodies(path: str) -> st.SearchStrategy:
    """A route's bodies, built once: building the strategies costs four times what drawing from
    them does (the same strategies draw the same bodies, built once or per draw)."""
    model = body_models().get(path)
    return model_bodies(model, path) if model else all_fields_model()


@st.composite
def route_and_body(draw):
    path = draw(st.sampled_from(POSTS))
    return path, draw(bodies(path))


@settings(max_examples=1200, **FUZZ)
@given(route_and_body(), st.booleans())
def test_fuzzed_bodies(http, baseline, case, disconnect):
    path, body = case
    send(http, "POST", path, body=body, disconnect=disconnect)


@settings(max_examples=400, **FUZZ)
@given(st.sampled_from(POSTS), st.one_of(st.binary(max_size=300), route_and_body().map(lambda c: json.dumps(c[1]).encode()),
                                         st.tuples(route_and_body(), st.integers(0, 200)).map(
                                             lambda t: json.dumps(t[0][1]).encode()[: t[1]])))
def test_fuzzed_bytes(http, baseline, path, content):
    send(http, "POST", path, content=content, headers={"Content-Type": "application/json"})


HEADER_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=40).map(str.strip)


@settings(max_examples=300, **FUZZ)
@given(st.sampled_from(routes()), st.one_of(st.just(AUTH["Authorization"]), HEADER_TEXT, HEADER_TEXT.map(lambda t: f"Bearer {t}".strip())),
       HEADER_TEXT, st.dictionaries(st.text("abcdefxyz-", min_size=1, max_size=8).map("x-".__add__), HEADER_TEXT, max_size=2))
def test_fuzzed_headers(http, baseline, route, auth, content_type, extra):
    path, method = route
    headers = {"Authorization": auth.encode("latin-1"), "Content-Type": content_type.encode("latin-1"),
               **{k: v.encode("latin-1") for k, v in extra.items()}}
    with http.stream(method, path, content=json.dumps(KNOWN).encode(), headers=headers) as r:
        r.read()
        assert r.status_code < 500, r.text
        if r.status_code >= 400:
            assert r.json()["error"]["message"]


@settings(max_examples=200, **FUZZ)
@given(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
       st.one_of(st.sampled_from([p for p, _ in routes()]), st.text("abcz/._-~%?=&0123456789", max_size=30).map("/".__add__)))
def test_fuzzed_paths_and_methods(http, baseline, method, path):
    with http.stream(method, path, content=b"{}", headers=AUTH) as r:
        r.read()
        assert r.status_code < 500, f"{method} {path}: {r.status_code} {r.text[:300]}"
        if r.status_code >= 400:
            assert r.json()["error"]["message"]


def test_alive_same_answer_and_flat_memory_afterwards(http, baseline):
    print("fuzzed bodies by route and status:", dict(sorted(STATUSES.items())))
    for path in body_models():
        ok, total = STATUSES[path, 200], sum(n for (p, _), n in STATUSES.items() if p == path)
        assert ok >= 0.03 * total, f"only {ok} of {total} fuzzed {path} bodies were served: the fuzz hardly reaches the engine"
    known, rss_before = baseline
    assert http.get("/health").json() == {"status": "ok"}
    r = http.post("/v1/completions", json=KNOWN, headers=AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == known
    samples = {s.name: s.value for f in text_string_to_metric_families(http.get("/metrics").text) for s in f.samples}
    assert samples["sala_running_requests"] == 0 and samples["sala_queue_depth"] == 0
    rss_after = replica_rss(http)
    print(f"replica RSS: {rss_before / 2**20:.1f} MiB after warm-up, {rss_after / 2**20:.1f} MiB after fuzzing "
          f"({rss_after / rss_before - 1:+.2%})")
    assert rss_after <= rss_before * (1 + RSS_GROWTH_LIMIT)
