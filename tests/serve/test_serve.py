"""The Serve app on a real local Ray, over real HTTP on 127.0.0.1, with the official openai client.

Expected outputs come from the engine run in this process on the same weights (the engine is
itself checked against the model's full forward in test_engine.py) and, for logprobs, from the
full forward directly. The serving commands of docs/serving.md run as written, in a shell,
against `python -m serve.app` started from a registry URI.
"""
import ast
import asyncio
import json
import os
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from sala.engine import SamplingParams
from tests.conftest import ROOT, free_port, serve_tiny_sala, write_untrained_medusa

API_KEY = "test-key"
MODEL = "tiny-sala"
ALIAS = "sala-alias"


@pytest.fixture(scope="module")
def server(tiny_sala_dir):
    # batch_invariant: outputs are compared bitwise with an engine in this process (batch-invariant by default)
    # No tool-call parser: tool calls as JSON (tests/serve/test_tools.py serves tiny-sala's own format).
    yield from serve_tiny_sala(tiny_sala_dir, "sala", served_model_name=[MODEL, ALIAS], api_key=API_KEY,
                               batch_invariant=True, max_body_bytes=64 << 10, max_tokens_limit=256, max_seqs=4,
                               max_waiting=4, tool_call_parser="none")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


PROMPT = "The json module"


def greedy_text(local_engine, prompt, n):
    return local_engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0))[0]


def test_models_and_health(http, server):
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL, ALIAS]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_any_served_name_or_none(http):
    """As vLLM's --served-model-name: every alias is accepted and echoed; no model means the first."""
    for asked, answered in ((ALIAS, ALIAS), (None, MODEL)):
        body = {"prompt": PROMPT, "max_tokens": 2} | ({"model": asked} if asked else {})
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == answered, r.text


def test_completion_matches_the_engine(client, local_engine):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    want = greedy_text(local_engine, PROMPT, 12)
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == {"length": "length", "stop": "stop"}[want.finish_reason]
    assert r.usage.prompt_tokens == len(want.prompt_ids) and r.usage.completion_tokens == len(want.token_ids)


def test_chat_matches_the_engine_on_the_chat_template(client, local_engine):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is a list?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    text = local_engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r.choices[0].message.content == greedy_text(local_engine, text, 10).text
    assert r.choices[0].message.role == "assistant"


def test_streaming_completion_and_chat(client, local_engine):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert len(chunks) > 3
    assert "".join(c.choices[0].text for c in chunks if c.choices) == greedy_text(local_engine, PROMPT, 12).text
    assert chunks[-1].usage.completion_tokens == 12
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
                                            temperature=0, stream=True)
    deltas = [c.choices[0].delta.content or "" for c in stream]
    text = local_engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True)
    assert "".join(deltas) == greedy_text(local_engine, text, 8).text


def test_logprobs_equal_full_forward_log_softmax(client, local_engine):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=5)
    lp = r.choices[0].logprobs
    ids = local_engine.encode(PROMPT)
    want = greedy_text(local_engine, PROMPT, 6).token_ids
    with torch.no_grad():
        ref = torch.log_softmax(local_engine.model(torch.tensor([ids + want]), use_cache=False).logits[0], -1)
    for step, (tok_lp, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs)):
        row = ref[len(ids) - 1 + step]
        assert abs(tok_lp - row[want[step]].item()) < 1e-4
        assert len(top) == 5 and abs(max(top.values()) - row.max().item()) < 1e-4
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob <= 0 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)


def test_usage_counts_each_prompt_once_whatever_n(client, local_engine):
    prompt_len = len(local_engine.encode(PROMPT))
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=1.0, n=3, seed=5)
    print("completions n=3 usage:", r.usage)
    assert r.usage.prompt_tokens == prompt_len and 3 <= r.usage.completion_tokens <= 9
    two = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=2, n=2, seed=5)
    assert two.usage.prompt_tokens == prompt_len + len(local_engine.encode("Hello"))
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, n=3, seed=5)
    text = local_engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.usage.prompt_tokens == len(local_engine.encode(text))


MARKERS = ("<|im_start|>", "<|im_end|>")


def test_chat_reply_ends_at_the_turn_without_template_markers(client, http, local_engine):
    """Greedy tiny-sala answers, then opens a new turn with <|im_start|>assistant: the reply must
    end there, so its text never holds a marker or the next turn's role line, even with
    skip_special_tokens off."""
    messages = [{"role": "user", "content": "What is a list?"}]
    for skip in (True, False):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, temperature=0,
                                           extra_body={"skip_special_tokens": skip})
        text = r.choices[0].message.content
        print(f"skip_special_tokens={skip}: {text!r} ({r.usage.completion_tokens} tokens, {r.choices[0].finish_reason})")
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 200
        assert not any(m in text for m in MARKERS) and "assistant\n" not in text
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text
    # The markers are real special tokens: asked not to stop and not to skip them, the text shows them.
    raw = http.post("/v1/completions", json={"model": MODEL, "prompt": local_engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True), "max_tokens": 40, "temperature": 0, "ignore_eos": True,
        "skip_special_tokens": False}).json()["choices"][0]["text"]
    assert "<|im_start|>assistant" in raw


def test_n_choices_with_seed(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=11)
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [c.text for c in again.choices]
    assert len({c.text for c in r.choices}) > 1, "choice j is seeded with seed + j"
    assert 3 <= r.usage.completion_tokens <= 24


def test_generate_with_logprobs(http, local_engine):
    ids = local_engine.encode(PROMPT)
    r = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 5, "temperature": 0},
                                     "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    want = greedy_text(local_engine, ids, 5)
    assert body["output_ids"] == want.token_ids and body["text"] == want.text
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 5
    with torch.no_grad():
        ref = torch.log_softmax(local_engine.model(torch.tensor([ids + want.token_ids]), use_cache=False).logits[0], -1)
    inp = meta["input_token_logprobs"]
    assert [t for _, t, _ in inp] == ids and inp[0][0] is None
    for pos in range(1, len(ids)):
        assert abs(inp[pos][0] - ref[pos - 1, ids[pos]].item()) < 1e-4
    for step, (lp, tok, _) in enumerate(meta["output_token_logprobs"]):
        assert tok == want.token_ids[step] and abs(lp - ref[len(ids) - 1 + step, tok].item()) < 1e-4
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    text = http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}).json()
    assert text["text"] == greedy_text(local_engine, PROMPT, 5).text


BAD_REQUESTS = [
    # (endpoint, body or raw bytes, headers, status, param)
    ("/v1/completions", b'{"model": "tiny-sala", "prompt": ', {}, 400, None),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, {}, 404, "model"),
    ("/v1/completions", {"model": MODEL}, {}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, {}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 100000}, {}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, {}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, {}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, {}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, {}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 257}, {}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": [5] * 5000}, {}, 400, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 300}, {}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, {}, 400, "messages"),
    ("/generate", {"text": "x", "sampling_params": {"max_tokens": 5}}, {}, 400, "sampling_params.max_tokens"),
    ("/generate", {"text": "x", "return_hidden_states": True}, {}, 400, "return_hidden_states"),
    ("/generate", {"text": "x", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}}, {}, 400,
     "sampling_params.min_new_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"logit_bias": {"x": 1}}}, {}, 400, "sampling_params.logit_bias"),
    ("/generate", {"text": ["x", "y"], "rid": "one"}, {}, 400, "rid"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 500}}, {}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, {}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True, "extra": 1}}, {}, 400,
     "stream_options.extra"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, {}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, {}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "best_of": 0}, {}, 400, "best_of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, {}, 400,
     "tools[0].function"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, {}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "nickname": "bob"}]}, {}, 400,
     "messages[0].nickname"),
    ("/abort_request", {}, {}, 400, "rid"),
    ("/v1/completions", {"prompt": "lone \ud800 surrogate"}, {}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, {}, 400, "messages"),
    ("/tokenize", {"prompt": "lone \ud800 surrogate"}, {}, 400, "prompt"),
    ("/tokenize", {"prompt": ["x", "\ud800"], "add_special_tokens": False}, {}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\udfff"}]}, {}, 400, "messages"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": -1}}, {}, 400, "sampling_params.max_new_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x"}, {"Authorization": "Bearer wrong"}, 401, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x"}, {"Authorization": "Bearer clé".encode()}, 401, None),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * (70 << 10)}, {}, 413, None),
]


def test_cached_prompt_tokens_are_reported(client, http, server, local_engine):
    """A second request over the same 600-token prefix resumes from the snapshot at 512: usage's
    prompt_tokens_details.cached_tokens, /generate's meta_info.cached_tokens and /metrics say
    so, and the output is the engine's (which computes the whole prompt)."""
    doc = (local_engine.encode("The json module encodes and decodes JSON documents.") * 60)[:600]
    hits = ("sala_prefix_cache_hit_tokens_total", ())
    before = metric_samples(server)[hits]
    first = client.completions.create(model=MODEL, prompt=doc + [11, 12], max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=MODEL, prompt=doc + [13, 14, 15], max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == 512
    assert second.choices[0].text == greedy_text(local_engine, doc + [13, 14, 15], 4).text
    r = http.post("/generate", json={"input_ids": doc + [16], "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.json()["meta_info"]["cached_tokens"] == 512
    assert r.json()["output_ids"] == greedy_text(local_engine, doc + [16], 4).token_ids
    samples = metric_samples(server)
    assert samples[hits] == before + 1024
    assert 0 < samples[("sala_prefix_cache_hit_rate", ())] <= 1
    assert samples[("sala_prefix_snapshot_bytes", ())] > 0


@pytest.mark.parametrize("endpoint,body,headers,status,param", BAD_REQUESTS,
                         ids=[f"{s}-{p or i}" for i, (_, _, _, s, p) in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_openai_style_errors(http, endpoint, body, headers, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(endpoint, content=content, headers={"Content-Type": "application/json", **headers})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param


# ---------------------------------------------------------------- structured outputs and tool calls
# Bounded strings and enums: greedy tiny-sala then ends its JSON well within max_tokens.
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["admin", "user"]}, "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}}, "required": ["tz"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER,
                                           "strict": True}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK, "strict": True}}]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CODE = r"[a-z]{3}-[0-9]{2,4}"


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)
    tags: list[Literal["admin", "user"]] = pydantic.Field(max_length=2)


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=16)
    unit: Literal["c", "f"]


def test_response_format_json_schema_validates_through_the_openai_client(client):
    """OpenAI's response_format: a json_schema dict (greedy, and sampled n=3), the client's own
    parse() of a pydantic model, and json_object; every output not cut by its length validates."""
    messages = [{"role": "user", "content": "Describe a person."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    greedy = client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, temperature=0, max_tokens=96)
    assert greedy.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(greedy.choices[0].message.content), PERSON)
    sampled = client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, temperature=1.0, n=3,
                                             seed=3, max_tokens=96)
    assert len(sampled.choices) == 3
    for c in sampled.choices:
        if c.finish_reason != "length":
            jsonschema.validate(json.loads(c.message.content), PERSON)
    parsed = client.chat.completions.parse(model=MODEL, messages=messages, response_format=Person, temperature=0,
                                           max_tokens=96).choices[0].message.parsed
    assert isinstance(parsed, Person)
    any_object = client.chat.completions.create(model=MODEL, messages=messages, response_format={"type": "json_object"},
                                                temperature=0, max_tokens=24).choices[0]
    assert any_object.message.content.startswith("{")
    if any_object.finish_reason != "length":
        assert isinstance(json.loads(any_object.message.content), dict)


def call_of(tool_call) -> tuple[str, str]:
    return tool_call.function.name, tool_call.function.arguments


def test_tool_calls_named_and_required_through_the_openai_client(client):
    """A named function: the client's parse() reads the arguments into the tool's pydantic
    model. "required" without parallel calls: one call of one of the tools, its arguments
    valid for that tool. Both in OpenAI's shape: content null, finish_reason tool_calls."""
    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    named = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[tool], temperature=0, max_tokens=96,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    assert named.finish_reason == "tool_calls" and named.message.content is None
    (call,) = named.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert isinstance(call.function.parsed_arguments, GetWeather)
    required = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, temperature=0, max_tokens=96).choices[0]
    assert required.finish_reason == "tool_calls" and required.message.content is None
    (call,) = required.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


def test_streamed_tool_call_deltas_reassemble_through_the_openai_client(client):
    """Streamed, the same calls as unstreamed: through the client's stream() helper (which
    parses each call's arguments), and as raw deltas for parallel calls cut by max_tokens (the
    calls whose objects are complete). A call's first delta carries its id, type, name and
    arguments ""; its arguments follow."""
    ask = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0)
    whole = client.chat.completions.create(**ask, parallel_tool_calls=False, max_tokens=96).choices[0].message
    with client.chat.completions.stream(**ask, parallel_tool_calls=False, max_tokens=96) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [call_of(c) for c in final.message.tool_calls] == [call_of(c) for c in whole.tool_calls]
    assert [(e.name, e.arguments) for e in done] == [call_of(c) for c in whole.tool_calls]
    assert done[0].parsed_arguments == json.loads(whole.tool_calls[0].function.arguments)

    whole = client.chat.completions.create(**ask, max_tokens=96).choices[0]
    assert whole.finish_reason == "length" and len(whole.message.tool_calls) >= 2, whole
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(**ask, max_tokens=96, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.index not in calls:
                assert delta.id.startswith("call_") and delta.type == "function" and delta.function.arguments == ""
                calls[delta.index] = {"name": delta.function.name, "arguments": ""}
            else:
                assert delta.id is None and delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [call_of(c) for c in whole.message.tool_calls]


def test_regex_choice_and_grammar_fields_of_every_dialect(client, http, local_engine):
    """vLLM's structured_outputs and SGLang's regex / ebnf / json_schema, on the OpenAI routes
    and in /generate's sampling_params: regex outputs full-match, choices are in the set, a
    schema's output validates. An unconstrained request running beside a constrained one is
    unchanged (the mask is its row's alone)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(client.completions.create, model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
        coded = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, n=3, seed=1,
                                          extra_body={"structured_outputs": {"regex": CODE}})
        assert plain.result().choices[0].text == greedy_text(local_engine, PROMPT, 12).text
    assert all(re.fullmatch(CODE, c.text) and c.finish_reason == "stop" for c in coded.choices), coded.choices
    colours = ["red", "green", "blue"]
    picked = client.completions.create(model=MODEL, prompt="My favourite colour is", max_tokens=8, temperature=1.0, n=3,
                                       seed=2, extra_body={"structured_outputs": {"choice": colours}})
    assert all(c.text in colours for c in picked.choices), picked.choices
    yes_no = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0,
                                            extra_body={"ebnf": 'root ::= "yes" | "no"'}).choices[0]
    assert yes_no.message.content in ("yes", "no") and yes_no.finish_reason == "stop"
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": {"regex": CODE, "max_new_tokens": 16,
                                                                          "temperature": 0}}).json()
    assert re.fullmatch(CODE, r["text"]) and r["meta_info"]["finish_reason"]["type"] == "stop", r
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": {"json_schema": json.dumps(WEATHER),
                                                                          "max_new_tokens": 64, "temperature": 0}}).json()
    jsonschema.validate(json.loads(r["text"]), WEATHER)


CHAT_X = {"messages": [{"role": "user", "content": "x"}]}
DEEP = {"type": "array", "items": {}}  # nested past MAX_SCHEMA_DEPTH: refused before anything recurses through it
for _ in range(60):
    DEEP = {"type": "object", "properties": {"a": DEEP}}
BAD_CONSTRAINTS = [
    ("/v1/chat/completions", {**CHAT_X, "response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ("/v1/chat/completions", {**CHAT_X, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format", "nonsense"),
    ("/v1/chat/completions", {**CHAT_X, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "not": {"type": "null"}}}}}, "response_format", "'not'"),
    ("/v1/chat/completions", {**CHAT_X, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "response_format and structured_outputs"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "([a-z"}}, "structured_outputs", "invalid regex"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one"),
    ("/v1/completions", {"prompt": "x", "ebnf": "root ::= "}, "ebnf", "invalid grammar"),
    ("/v1/completions", {"prompt": "x", "json_schema": "{}", "regex": "a"}, "regex", "json_schema and regex"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "(", "max_new_tokens": 4}}, "sampling_params.regex",
     "invalid regex"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "not json"}}, "sampling_params.json_schema", "not valid JSON"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{}", "min_new_tokens": 2}},
     "sampling_params.min_new_tokens", "structured outputs"),
    ("/v1/chat/completions", {**CHAT_X, "tools": TOOLS}, "tool_choice", "--tool-call-parser"),
    ("/v1/chat/completions", {**CHAT_X, "tools": TOOLS, "tool_choice": "auto"}, "tool_choice", '"required"'),
    ("/v1/chat/completions", {**CHAT_X, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ("/v1/chat/completions", {**CHAT_X, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope'"),
    ("/v1/chat/completions", {**CHAT_X, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}]},
     "tools", "nonsense"),
    ("/v1/chat/completions", {**CHAT_X, "tool_choice": "required", "tools": [TOOLS[0], TOOLS[0]]}, "tools", "distinct"),
    ("/v1/chat/completions", {**CHAT_X, "tools": TOOLS, "tool_choice": "required", "regex": "a"}, "tools", "regex and tools"),
    ("/v1/chat/completions", {**CHAT_X, "functions": [{"name": "f"}]}, "functions", "use tools"),
    ("/v1/chat/completions", {**CHAT_X, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}},
     "response_format", "nests deeper"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "[" * 5000 + "]" * 5000}}, "sampling_params.json_schema",
     "nests deeper"),
]


@pytest.mark.parametrize("endpoint,body,param,reason", BAD_CONSTRAINTS, ids=[f"{p}-{i}" for i, (_, _, p, _) in
                                                                          enumerate(BAD_CONSTRAINTS)])
def test_bad_constraints_are_400s_naming_the_field_before_anything_is_queued(http, server, endpoint, body, param, reason):
    prompt_tokens = ("sala_prompt_tokens_total", ())
    before = metric_samples(server)[prompt_tokens]
    r = http.post(endpoint, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and reason in err["message"], err
    assert metric_samples(server)[prompt_tokens] == before, "a refused request was queued"


def test_full_queue_is_503_with_retry_after_and_leaves_nothing_behind(http, server):
    """At most 4 running + 4 waiting: 16 choices cannot all be queued, so none may run; the
    ones queued before the queue filled are cancelled, none runs to its length."""
    cancelled = ("sala_finished_requests_total", (("reason", "cancelled"),))
    length = ("sala_finished_requests_total", (("reason", "length"),))
    before = metric_samples(server)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "n": 16, "max_tokens": 200, "ignore_eos": True})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full"
    for _ in range(100):
        if metric_samples(server)[("sala_running_requests", ())] == 0:
            break
        time.sleep(0.1)
    assert metric_samples(server)[("sala_running_requests", ())] == 0
    after = metric_samples(server)
    assert after[cancelled] >= before[cancelled] + 4 and after[length] == before[length], "queued choices kept running"
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_missing_api_key_is_401(server):
    for path in ("/v1/models", "/get_model_info", "/get_server_info"):
        r = httpx.get(f"{server}{path}")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_unknown_routes_and_methods_are_json_errors(http):
    for method, path, status in (("GET", "/v2/nothing", 404), ("GET", "/v1/completions", 405), ("DELETE", "/generate", 405)):
        r = http.request(method, path)
        assert r.status_code == status and r.json()["error"]["message"], r.text


def test_sampling_controls_over_http_equal_the_engine(client, http, local_engine):
    """Each control reaches the engine from every endpoint: the server's output equals the local
    engine's with the same SamplingParams (whose semantics test_sampling_controls.py checks)."""
    controls = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.6, min_p=0.1)
    want = local_engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, min_tokens=3,
                                                          logit_bias={17: 2.5}, **controls))[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logit_bias={"17": 2.5},
                                  presence_penalty=0.4, frequency_penalty=0.6, user="tester", extra_body={
                                      "repetition_penalty": 1.3, "min_p": 0.1, "min_tokens": 3, "ignore_eos": True})
    assert r.choices[0].text == want.text
    g = http.post("/generate", json={"text": PROMPT, "sampling_params": {
        "max_new_tokens": 10, "temperature": 0, "ignore_eos": True, "min_new_tokens": 3, "logit_bias": {"17": 2.5}, **controls}})
    assert g.status_code == 200 and g.json()["output_ids"] == want.token_ids, g.text
    forced = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                            temperature=1.0, seed=1, logit_bias={"17": 100}, n=None)
    assert forced.usage.completion_tokens == 4 and forced.choices[0].message.content == local_engine.tokenizer.decode([17] * 4)


def test_stop_reason_and_matched_name_the_stop(client, http, local_engine):
    full = greedy_text(local_engine, PROMPT, 16)
    stop = full.text[6:9]
    assert stop.strip()
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    choice = r.choices[0].model_dump()
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop and r.choices[0].text == full.text[:6]
    kept = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": stop,
                                              "include_stop_str_in_output": True}).json()["choices"][0]
    assert kept["text"] == full.text[:9]
    token = full.token_ids[4]
    g = http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                                         "stop": stop, "no_stop_trim": True}}).json()
    assert g["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop} and g["text"] == full.text[:9]
    g = http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                                         "stop_token_ids": [token]}}).json()
    assert g["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is a list?"}],
                                          max_tokens=100, temperature=0)
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].model_dump()["stop_reason"] is None  # eos


def test_logprob_bytes_are_the_tokens_bytes(client, local_engine):
    """A token that is the first byte of a 3-byte character, forced by logit_bias: its text is
    U+FFFD, its bytes the one byte it stands for."""
    from serve.token_bytes import TokenBytes

    to_bytes = TokenBytes(local_engine.tokenizer)
    (piece, *_) = local_engine.tokenizer("東", add_special_tokens=False)["input_ids"]
    assert len(to_bytes(piece)) == 1 and local_engine.tokenizer.decode([piece]) == "\ufffd"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
                                       logprobs=True, top_logprobs=2, logit_bias={str(piece): 100})
    content = r.choices[0].logprobs.content
    assert [c.bytes for c in content] == [list(to_bytes(piece))] * 3
    assert all(t.bytes == list(to_bytes(local_engine.tokenizer.convert_tokens_to_ids(t.token)))
               or t.bytes == list(t.token.encode()) for c in content for t in c.top_logprobs)


def test_rid_abort_and_server_info(http, server, local_engine):
    body = {"text": PROMPT, "rid": "soak-1", "stream": True,
            "sampling_params": {"max_new_tokens": 250, "temperature": 0, "ignore_eos": True}}
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        with c.stream("POST", f"{server}/generate", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["meta_info"]["id"] == "soak-1"
            busy = http.post("/generate", json={**body, "stream": False})
            assert busy.status_code == 400 and busy.json()["error"]["param"] == "rid"
            assert http.post("/abort_request", json={"rid": "soak-1"}).json() == {"aborted": ["soak-1"]}
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "abort"}
    assert events[-1]["meta_info"]["completion_tokens"] < 250
    assert http.post("/abort_request", json={"rid": "soak-1"}).json() == {"aborted": []}
    info = http.get("/get_model_info").json()
    assert info["is_generation"] and info["served_model_names"] == [MODEL, ALIAS] and Path(info["model_path"]).is_dir()
    server_info = http.get("/get_server_info").json()
    assert server_info["max_running_requests"] == 4 and server_info["max_tokens_limit"] == 256
    assert server_info["batch_invariant"] is True and server_info["api_key_required"] is True


def metric_samples(server) -> dict:
    text = httpx.get(f"{server}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_disconnect_mid_stream_frees_the_slot_and_metrics_parse(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 250, "temperature": 0, "ignore_eos": True, "stream": True}
    cancelled = ("sala_finished_requests_total", (("reason", "cancelled"),))
    before = metric_samples(server)[cancelled]
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            lines = [line for _, line in zip(range(6), r.iter_lines())]
    assert any(line.startswith("data: ") for line in lines)
    for _ in range(100):
        samples = metric_samples(server)
        if samples[("sala_running_requests", ())] == 0:
            break
        time.sleep(0.1)
    assert samples[("sala_running_requests", ())] == 0
    assert samples[cancelled] == before + 1, "the request was not cancelled when its client left"
    assert samples[("sala_queue_depth", ())] == 0
    assert samples[("sala_requests_total", (("endpoint", "completions"), ("status", "200")))] >= 1
    assert samples[("sala_generation_tokens_total", ())] > 0
    assert samples[("sala_time_to_first_token_seconds_count", ())] > 0
    assert samples[("sala_inter_token_latency_seconds_count", ())] > 0


def test_disconnects_leave_no_traceback_in_the_replica_log(server):
    """Clients that leave mid-stream, in waves that fill the engine: each is cancelled with (at most)
    Serve's one line, never a 'Future exception was never retrieved' traceback in the replica's log."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())  # this session's Ray log directory
    before = {f: f.stat().st_size for f in logs.glob("worker-*.err")}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 250, "temperature": 0, "ignore_eos": True, "stream": True}

    async def leave_after(c, lines):
        async with c.stream("POST", f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            if r.status_code != 200:
                return 0
            async for i, _ in _aenumerate(r.aiter_lines()):
                if i >= lines:
                    return 1
        return 1

    async def waves():
        async with httpx.AsyncClient(timeout=60) as c:
            return sum([sum(await asyncio.gather(*(leave_after(c, 1 + (w + i) % 7) for i in range(6)))) for w in range(5)])

    left = asyncio.run(waves())
    for _ in range(100):
        if metric_samples(server)[("sala_running_requests", ())] == 0:
            break
        time.sleep(0.1)
    time.sleep(2)  # the log monitor's pace: tracebacks of the last wave reach the files
    new = "".join(f.read_text(errors="replace")[before.get(f, 0):] for f in logs.glob("worker-*.err"))
    print(f"{left} clients left mid-stream; new replica stderr: {len(new.splitlines())} lines")
    assert left >= 20
    assert "Traceback" not in new and "never retrieved" not in new, new[-3000:]


async def _aenumerate(it):
    i = 0
    async for x in it:
        yield i, x
        i += 1


def test_num_gpus_without_cuda_is_a_clear_error(tiny_sala_dir):
    import torch

    from sala.checkpoint import DeviceUnavailable, gpu_device
    from serve.app import parse_args

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    args = parse_args(["--num-gpus", "1", "--batch-invariant", "--served-model-name", "a", "b"])
    assert (args.num_gpus, args.batch_invariant, args.served_model_name) == (1.0, True, ["a", "b"])
    assert gpu_device(0) == "cpu"
    with pytest.raises(DeviceUnavailable, match="sees no CUDA device"):  # what a replica given GPUs checks first
        gpu_device(1)
    r = subprocess.run([sys.executable, "-m", "serve.app", "--model", str(tiny_sala_dir), "--num-gpus", "1"],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "RAY_ADDRESS": ""}, timeout=120)
    print(r.stderr)
    assert r.returncode == 2 and r.stderr.startswith("error: --num-gpus:") and "CUDA" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


SERVING_DOC = ROOT / "docs" / "serving.md"
SERVING_SECTION = "## Start a server and send requests"


def serving_docs_section() -> str:
    """docs/serving.md's section of commands, up to the next section."""
    text = SERVING_DOC.read_text()
    start = text.index(SERVING_SECTION)
    return text[start:text.index("\n## ", start + 1)]


def shell_commands(section: str, first_word: str) -> list[str]:
    """The documented commands starting with first_word, continuation lines joined, comments dropped."""
    lines = section.replace("\\\n", " ").splitlines()
    return [re.sub(r"\s+# .*$", "", line).strip() for line in lines if line.startswith(first_word + " ")]


@pytest.fixture
def registered_tiny_sala(tiny_sala_dir, tmp_path, monkeypatch):
    """tiny-sala registered as the main job registers its checkpoint: tiny-sala-nvfp4@champion."""
    from registry.models import register_checkpoint, set_alias
    from registry.tracking import setup_mlflow

    env = {"SALA_HOME": str(tmp_path / "home"), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    setup_mlflow("readme-test")
    set_alias("tiny-sala-nvfp4", "champion", register_checkpoint(tiny_sala_dir, "tiny-sala-nvfp4"))
    return env


def start_server(argv: list[str], env: dict) -> tuple[subprocess.Popen, str, list[str]]:
    """`python -m serve.app ...` in its own process and Ray; returns it once it serves, with the stop
    command it printed and its output so far."""
    env = {**os.environ, **env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    deadline = time.time() + 300
    try:
        for line in proc.stdout:
            out.append(line)
            if line.startswith("serving on "):
                assert "from another shell: " in line, line
                return proc, line.split("from another shell: ", 1)[1].strip(), out
            assert time.time() < deadline, "".join(out[-50:])
        raise AssertionError(f"server exited ({proc.wait()}):\n{''.join(out[-50:])}")
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def finish(proc: subprocess.Popen, out: list[str], timeout: float = 60) -> str:
    rest, _ = proc.communicate(timeout=timeout)
    return "".join(out) + rest


def test_documented_serving_commands_against_a_registry_uri(registered_tiny_sala):
    section = serving_docs_section()
    (serve_cmd,) = [c for c in shell_commands(section, "python") if "serve.app" in c]
    assert "models:/tiny-sala-nvfp4@champion" in serve_cmd
    port = free_port()
    argv = serve_cmd.replace("--port 8000", f"--port {port}").split()
    proc, stop_cmd, out = start_server([sys.executable, *argv[1:]], registered_tiny_sala)
    try:
        curls = shell_commands(section, "curl")
        assert len(curls) >= 5
        for cmd in curls:
            r = subprocess.run(["bash", "-c", cmd.replace("127.0.0.1:8000", f"127.0.0.1:{port}")],
                               capture_output=True, text=True, timeout=120)
            print(f"$ {cmd[:90]}\n{r.stdout[:300]}")
            assert r.returncode == 0 and r.stdout, r.stderr
            if "/metrics" in cmd:
                assert "sala_requests_total" in r.stdout
            elif "stream" in cmd:
                events = [line for line in r.stdout.splitlines() if line]
                assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
                # An error after the 200 comes in-band as {"error": ...}; the model may well say "error".
                assert not [e for e in events[:-1] if "error" in json.loads(e.removeprefix("data: "))]
            else:
                body = json.loads(r.stdout)
                assert "error" not in body, body
        assert json.loads(subprocess.run(["bash", "-c", f"curl -s 127.0.0.1:{port}/v1/models"], capture_output=True,
                                         text=True).stdout)["data"][0]["id"] == "tiny-sala-nvfp4"
        snippet = section[section.index("```python\n") + 10:]
        snippet = snippet[:snippet.index("```")].replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        py = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120)
        print(f"python snippet: {py.stdout[:200]!r}")
        # The model may answer with end-of-sequence at once (tiny-sala trained on another CPU
        # differs); the stream must still end with a finish reason.
        printed = re.fullmatch(r"(?s)(.*)\n\[finish_reason: (stop|length)\]\n", py.stdout)
        assert py.returncode == 0 and printed, py.stdout + py.stderr
        assert printed[2] == "stop" or printed[1].strip(), "64 tokens streamed and none printed"
        # The agent loop: tiny-sala's own tool-call format by default (its chat template's), a
        # call made and answered by a tool message, then the model's answer.
        loop = section[section.index("```python\n", section.index("An agent's loop")) + 10:]
        loop = loop[:loop.index("```")].replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        py = subprocess.run([sys.executable, "-c", loop], capture_output=True, text=True, timeout=120)
        print(f"agent loop: {py.stdout!r}")
        assert py.returncode == 0, py.stdout + py.stderr
        calls = re.findall(r"^call: get_weather\((.*)\)$", py.stdout, re.M)
        assert calls and py.stdout.splitlines()[-1].startswith("answer: "), py.stdout
        for call in calls:
            arguments = ast.literal_eval(call)
            assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("c", "f"), arguments
        # The documented stop instruction, as the server printed it (with its dashboard's address
        # when that is not Ray's default).
        # It names this environment's serve script by its full path, and runs without it on PATH.
        (documented_stop,) = [c for c in shell_commands(section, "RAY_AUTH_MODE=token")]
        assert stop_cmd.startswith(documented_stop.replace(".venv/bin/serve", os.path.join(sysconfig.get_path("scripts"), "serve")))
        stop = subprocess.run(["bash", "-c", stop_cmd], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PATH": "/usr/bin:/bin"})
        assert stop.returncode == 0 and "Sent shutdown request" in stop.stdout + stop.stderr, stop.stdout + stop.stderr
        log = finish(proc, out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(log[-1500:])
    assert proc.returncode == 0 and "Serve was shut down; exiting" in log
    # The replica said what its start-up was doing, and how long that took.
    assert "warming up the engine for " in log and re.search(r"engine warmed up in \d+\.\d s", log)
    assert "Traceback" not in log and "SIGTERM received" not in log


def test_metrics_count_preemptions_and_free_pages(tiny_sala_dir, local_engine):
    """The replica's engine series on an engine whose pool is too small for its requests."""
    from prometheus_client import CollectorRegistry, generate_latest

    from sala.checkpoint import load_model
    from sala.engine import Engine
    from serve.metrics import EngineSeries

    engine = Engine(load_model(tiny_sala_dir), local_engine.tokenizer, compile=False, page_size=16, max_seqs=8,
                    max_model_len=128, memory_bytes=8 * 16 * 1536 + 8 * 81920)
    prompts = [local_engine.encode(f"The {w} statement") * 4 for w in ("for", "while", "if", "try", "with", "del")]
    engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    registry = CollectorRegistry()
    registry.register(EngineSeries(engine.info(), engine.stats()))
    samples = {s.name: s.value for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    assert samples["sala_preemptions_total"] == engine.num_preemptions > 0
    # Every page is back: free, or held by the prefix cache for reuse (and no request).
    assert samples["sala_kv_pages_free"] + samples["sala_prefix_cache_pages"] == samples["sala_kv_pages"] == 8


def full_forward_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's one full forward over ids: row p scores token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(engine.model(torch.tensor([ids]), use_cache=False).logits[0].float(), -1)


def assert_prompt_logprobs(ref: torch.Tensor, ids: list[int], token_logprobs: list, top_ids: list[list[int]],
                           top_lps: list[list[float]], k: int) -> None:
    """Entry p is token p's logprob given the tokens before it (the first: none), with the k most likely."""
    assert token_logprobs[0] is None and len(token_logprobs) >= len(ids)
    for p in range(1, len(ids)):
        row = ref[p - 1]
        assert abs(token_logprobs[p] - row[ids[p]].item()) < 1e-4, p
        want_lp, want_ids = row.topk(k)
        assert len(top_ids[p]) == k
        assert torch.allclose(torch.tensor(top_lps[p]), want_lp, atol=1e-4), p
        # ties at the k-th place may order either way; the sets of clear winners must agree
        clear = [t for t, lp in zip(want_ids.tolist(), want_lp.tolist()) if lp > want_lp[-1].item() + 1e-4]
        assert set(clear) <= set(top_ids[p]), p


def test_echo_logprobs_equal_full_forward_for_text_ids_and_batches(http, local_engine):
    """/v1/completions echo + logprobs: every prompt token's logprob (the first null), then the
    generated ones, as vLLM answers and lm-evaluation-harness's local-completions reads them."""
    k = 8
    prompts = [PROMPT, "def f(x):\n    return x"]
    ids = [local_engine.encode(p) for p in prompts]
    for prompt in (prompts[0], ids[0], ids):  # a string, a list of ids, a batch of lists
        r = http.post("/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": k, "max_tokens": 2,
                                               "temperature": 0, "return_tokens_as_token_ids": True})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        for c, seq_ids, text in zip(choices, ids, prompts):
            lp = c["logprobs"]
            gen = greedy_text(local_engine, seq_ids, 2)
            seq = seq_ids + gen.token_ids
            assert [int(t.removeprefix("token_id:")) for t in lp["tokens"]] == seq
            # a string prompt comes back as given; ids as their text, special tokens included (as vLLM)
            assert c["text"] == (text if isinstance(prompt, str) else local_engine.tokenizer.decode(seq_ids)) + gen.text
            tops = [None] + [[int(t.removeprefix("token_id:")) for t in d] for d in lp["top_logprobs"][1:]]
            top_lps = [None] + [list(d.values()) for d in lp["top_logprobs"][1:]]
            assert_prompt_logprobs(full_forward_logprobs(local_engine, seq), seq, lp["token_logprobs"], tops, top_lps, k)
    # lm-evaluation-harness's loglikelihood request: ids of context + continuation, max_tokens 1, token text keys
    ctx, cont = ids[0][:3], ids[0][3:]
    r = http.post("/v1/completions", json={"prompt": [ctx + cont], "echo": True, "logprobs": 1, "max_tokens": 1,
                                           "temperature": 0}).json()
    lp = r["choices"][0]["logprobs"]
    ref = full_forward_logprobs(local_engine, ctx + cont)
    want = sum(ref[p - 1, ids[0][p]].item() for p in range(len(ctx), len(ids[0])))
    assert abs(sum(lp["token_logprobs"][len(ctx):-1]) - want) < 1e-4
    assert lp["tokens"][: len(ctx)] == [local_engine.tokenizer.decode([t]) for t in ctx]
    # echo with max_tokens 0 scores the prompt alone; streamed, the prompt comes in the first chunk
    r = http.post("/v1/completions", json={"prompt": ids[0], "echo": True, "logprobs": 0, "max_tokens": 0}).json()
    c = r["choices"][0]
    assert len(c["logprobs"]["tokens"]) == len(ids[0]) and r["usage"]["completion_tokens"] == 0
    assert c["text"] == local_engine.tokenizer.decode(ids[0]) and c["finish_reason"] == "length"
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "echo": True, "max_tokens": 3, "temperature": 0,
                                                      "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(e["choices"][0]["text"] for e in events) == PROMPT + greedy_text(local_engine, PROMPT, 3).text


def test_generate_input_top_logprobs_equal_full_forward(http, local_engine):
    """SGLang's /generate, logprob_start_len 0: input_token_logprobs / input_top_logprobs as
    [logprob, token_id, text] (the first entry null), for a batch of id lists."""
    k = 6
    ids = [local_engine.encode(PROMPT), local_engine.encode("Q: what is a dict?")]
    r = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                                     "return_logprob": True, "top_logprobs_num": k, "logprob_start_len": 0,
                                     "return_text_in_logprobs": True})
    assert r.status_code == 200, r.text
    for out, seq in zip(r.json(), ids):
        meta = out["meta_info"]
        inp, top = meta["input_token_logprobs"], meta["input_top_logprobs"]
        assert [t for _, t, _ in inp] == seq and top[0] is None
        assert inp[1][2] == local_engine.tokenizer.decode([seq[1]])
        assert_prompt_logprobs(full_forward_logprobs(local_engine, seq), seq, [lp for lp, _, _ in inp],
                               [None] + [[t for _, t, _ in e] for e in top[1:]],
                               [None] + [[lp for lp, _, _ in e] for e in top[1:]], k)


def test_tokenize_and_detokenize_as_vllm_and_sglang(http, server, local_engine):
    ids = local_engine.encode(PROMPT)
    r = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == local_engine.config.max_model_len
    assert r["token_strs"] == local_engine.tokenizer.convert_ids_to_tokens(ids)
    batch = http.post("/v1/tokenize", json={"prompt": [PROMPT, "Hello"]}).json()
    assert batch["tokens"] == [ids, local_engine.encode("Hello")] and batch["count"] == [len(ids), len(batch["tokens"][1])]
    messages = [{"role": "user", "content": "Hi"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    text = local_engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == local_engine.encode(text)
    d = http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()
    assert d["prompt"] == d["text"] == local_engine.tokenizer.decode(ids)
    assert http.post("/v1/detokenize", json={"tokens": [ids, ids[:2]]}).json()["text"][1] == local_engine.tokenizer.decode(ids[:2])
    bad = http.post("/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert http.post("/tokenize", json={"prompt": "x", "model": "nope"}).status_code == 404
    assert http.post("/tokenize", json={}).status_code == 400
    assert httpx.post(f"{server}/tokenize", json={"prompt": "x"}).status_code == 401


def kv_plan_file(tmp_path, config, kv: dict[int, str], state: dict[int, str]) -> Path:
    """A kv_plan.json written by hand, as another tool would (the contract in sala/kv/plan.py)."""
    layers = [{"layer": i, "kind": "sparse", "kv": kv[i]} if i in kv else {"layer": i, "kind": "lightning", "state": state[i]}
              for i in range(config.num_hidden_layers) if i in kv or i in state]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"layers": layers}))
    return path


def test_kv_plan_bad_fails_before_serving_and_good_shows_its_bytes_in_metrics(tiny_sala_dir, tmp_path):
    from sala.checkpoint import read_config

    config = read_config(tiny_sala_dir)
    sparse, lightning = config.sparse_layers, config.lightning_layers
    bad = kv_plan_file(tmp_path, config, {i: "int3" for i in sparse}, {i: "fp32" for i in lightning})
    r = subprocess.run([sys.executable, "-m", "serve.app", "--model", str(tiny_sala_dir), "--kv-plan", str(bad)],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "RAY_ADDRESS": ""}, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("error: --kv-plan: ") and f"layer {sparse[0]}: unknown kv format 'int3'" in r.stderr

    kv = {i: ("fp8" if n % 2 else "nvfp4") for n, i in enumerate(sparse)}
    state = {i: ("bf16" if n % 2 else "fp32") for n, i in enumerate(lightning)}
    good = kv_plan_file(tmp_path, config, kv, state)
    # Independent of sala/kv/formats.py: FP8 is a byte an element plus, with no calibrated amax in
    # the plan, an fp32 scale per head computed on write; NVFP4 half a byte plus one FP8 scale per
    # 16 elements; for K and for V.
    h, hd = config.num_key_value_heads, config.num_key_value_heads * config.head_dim
    want_token = {i: 2 * (hd + 4 * h if f == "fp8" else hd // 2 + hd // 16) for i, f in kv.items()}
    want_seq = {i: config.lightning_nh * config.lightning_head_dim**2 * (2 if s == "bf16" else 4) for i, s in state.items()}
    # The gauges as the replica's collector reads them off an engine holding the plan (a server
    # started on a checkpoint's plan is test_quantize_pipeline's end-to-end test; starting one here
    # again cost two minutes of compiling).
    from prometheus_client import CollectorRegistry, generate_latest

    from sala.engine import Engine
    from serve.metrics import EngineSeries

    engine = Engine.from_pretrained(tiny_sala_dir, kv_plan=str(good), compile=False)
    registry = CollectorRegistry()
    registry.register(EngineSeries(engine.info(), engine.stats()))
    text = generate_latest(registry).decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    value = {s.name: s.value for s in samples}
    assert value["sala_kv_cache_bytes_per_token"] == sum(want_token.values())
    assert value["sala_state_bytes_per_sequence"] == sum(want_seq.values())
    layers = {int(s.labels["layer"]): (s.labels["format"], s.labels["per"], s.value) for s in samples
              if s.name == "sala_cache_layer_bytes"}
    assert layers == {i: (kv[i], "token", b) for i, b in want_token.items()} | {
        i: (state[i], "sequence", b) for i, b in want_seq.items()}


def test_generate_refuses_a_bad_kv_plan_before_ray(tiny_sala_dir, tmp_path, capsys):
    from pipelines.generate import main
    from sala.checkpoint import read_config

    config = read_config(tiny_sala_dir)
    bad = kv_plan_file(tmp_path, config, {i: "fp8" for i in config.sparse_layers},
                       {i: "fp32" for i in config.lightning_layers[1:]})  # one lightning layer missing
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    rc = main(["--dataset", str(data), "--output", str(tmp_path / "out"), "--model", str(tiny_sala_dir), "--kv-plan", str(bad)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: --kv-plan: ") and f"no entry for layer(s) [{config.lightning_layers[0]}]" in err


@pytest.fixture
def untrained_medusa_checkpoint(tiny_sala_dir, tmp_path):
    """tiny-sala with Medusa heads as initialised: what the argument checks below read, without
    the session's training run (tests/conftest.py), which another test worker owns."""
    return write_untrained_medusa(tiny_sala_dir, tmp_path / "tiny-sala-medusa", shared_lm_head=False)


def test_medusa_settings_refused_without_medusa_or_when_malformed(tiny_sala_dir, untrained_medusa_checkpoint, tmp_path,
                                                                  capsys):
    """--medusa-nodes and --medusa-max-batch are refused in one line, before Ray starts, when
    malformed, and when the model is decoded without Medusa (a setting silently ignored)."""
    from pipelines.generate import main as generate_main
    from serve.app import main as serve_main
    from serve.app import parse_args
    from serve.build import MedusaOff, build_app

    assert parse_args(["--medusa-max-batch", "4"]).medusa_max_batch == 4
    assert parse_args(["--medusa-nodes", "8"]).medusa_nodes == 8 and parse_args([]).medusa_nodes is None
    for flag, value, reason in (("--medusa-max-batch", "-1", "medusa_max_batch=-1: give an integer >= 0"),
                                ("--medusa-max-batch", "auto", "medusa_max_batch='auto': Medusa now chooses"),
                                ("--medusa-nodes", "many", "medusa_nodes='many': give 'auto'")):
        with pytest.raises(SystemExit) as exit_:
            parse_args([flag, value])
        assert exit_.value.code == 2 and reason in capsys.readouterr().err
    for flag in ("--medusa-max-batch", "--medusa-nodes"):
        assert serve_main(["--model", str(tiny_sala_dir), flag, "2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {flag[2:].replace('-', '_')}=2 but ") and "served without Medusa" in err
        assert len(err.splitlines()) == 1
    with pytest.raises(MedusaOff):
        build_app(str(untrained_medusa_checkpoint), medusa=False, medusa_nodes=4)
    build_app(str(untrained_medusa_checkpoint), medusa_max_batch=4, medusa_nodes="auto")  # with heads: accepted
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    for flag, value, reason in (("--medusa-max-batch", "2", "--medusa-max-batch: "),
                                ("--medusa-nodes", "2", "--medusa-nodes: "),
                                ("--medusa-max-batch", "lots", "medusa_max_batch='lots': give an integer >= 0")):
        rc = generate_main(["--dataset", str(data), "--output", str(tmp_path / "out"), "--model", str(tiny_sala_dir),
                            flag, value])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("error: ") and reason in err and len(err.splitlines()) == 1, err
