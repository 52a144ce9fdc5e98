"""Tool calls and reasoning through the Serve app on a real local Ray, over real HTTP on
127.0.0.1, with the official openai client: tiny-sala served with no flag, so its chat
template's minicpm format and qwen3 reasoning are the defaults; the other formats asked for
per request (`tool_call_parser`).

Every call a response holds, streamed or not, is checked with jsonschema against its tool's
schema; the prompt of a conversation with calls and results is the one transformers renders
from the same messages (arguments as objects) with tiny-sala's template.
"""
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from sala.tiny import TOOL_CALL_TOKEN
from sala.tools import FORMATS, Function
from tests.conftest import serve_tiny_sala

MODEL = "tiny-sala"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 6}}, "required": ["tz"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Logit biases that make tiny-sala start calls often (untrained for tools, it seldom does on its
# own): its <|tool_call|> token; "<" and "function", minicpm5's "<function" in its vocabulary.
# hermes's "<tool_call>" is six tokens here, which no bias puts in order: its calls come when asked
# for ("required", a named function). Room for a call: minicpm5's is the longest.
BIAS = {"minicpm": {"543": 8}, "minicpm5": {"32": 8, "1176": 8}, "hermes": {}}
MAX_TOKENS = {"minicpm": 48, "minicpm5": 96, "hermes": 64}


@pytest.fixture(scope="module")
def server(tiny_sala_dir):
    yield from serve_tiny_sala(tiny_sala_dir, "tools", served_model_name=MODEL, max_seqs=8, max_waiting=64)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=120) as c:
        yield c


def test_the_trigger_bias_is_tiny_salas_tool_call_token(tokenizer):
    assert tokenizer.convert_tokens_to_ids(TOOL_CALL_TOKEN) == 543
    assert tokenizer.convert_ids_to_tokens([32, 1176]) == ["<", "function"]


def valid_call(call, names=SCHEMAS) -> dict:
    """The call's arguments, checked: a tool's name, an id, JSON valid for the tool's schema."""
    assert call["id"].startswith("call_") and call["type"] == "function" and call["function"]["name"] in names, call
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, SCHEMAS[call["function"]["name"]])
    return arguments


def reassembled(chunks) -> tuple[dict, str | None]:
    """A streamed choice as a message, from its deltas: each call's first delta carries its id and
    name (arguments ""), the next ones only arguments."""
    message, calls, finish = {"content": None, "reasoning_content": None}, {}, None
    for chunk in chunks:
        (choice,) = chunk.choices
        delta = choice.delta
        for key in ("content", "reasoning_content"):
            if (piece := getattr(delta, key, None)) is not None:
                message[key] = (message[key] or "") + piece
        for d in delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.function.name and d.function.arguments == "", d
                assert d.index == len(calls)
                calls[d.index] = {"id": d.id, "type": d.type, "function": {"name": d.function.name, "arguments": ""}}
            else:
                assert d.id is None and d.function.name is None, d
                calls[d.index]["function"]["arguments"] += d.function.arguments
        finish = choice.finish_reason or finish
    message["tool_calls"] = [calls[i] for i in sorted(calls)] or None
    return message, finish


def ask(client, parser: str, mode, stream: bool, seed: int) -> tuple[dict, str | None]:
    """One request of the 200: tool_choice `mode` (None: left out, so "auto"; "one": auto with
    parallel_tool_calls false), sampled at temperature 1.0, as (message dict, finish_reason)."""
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS[parser], temperature=1.0, seed=seed,
                  logit_bias=BIAS[parser],
                  extra_body={"tool_call_parser": parser})
    if mode == "one":
        kwargs["parallel_tool_calls"] = False
    elif mode is not None:
        kwargs["tool_choice"] = mode
    if stream:
        return reassembled(client.chat.completions.create(**kwargs, stream=True))
    choice = client.chat.completions.create(**kwargs).choices[0]
    message = choice.message.model_dump()
    return {**message, "tool_calls": message["tool_calls"] or None}, choice.finish_reason


MODES = [None, None, None, "one", "required", {"type": "function", "function": {"name": "get_time"}}, "none"]


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_every_call_of_200_sampled_requests_is_valid(client, parser):
    """200 requests per format, the tool_choice modes in turn (mostly none given: "auto"), half
    streamed: every call is valid JSON for its tool's schema; content never holds a call; finish_reason is tool_calls exactly when a turn that stopped made a call; none: no
    call; a named function: that call alone; parallel_tool_calls false: one call at most."""
    jobs = [(MODES[i % len(MODES)], i % 2 == 1, i) for i in range(200)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda job: (job[0], *ask(client, parser, *job)), jobs))
    made = {"auto": 0, "required": 0}
    for mode, message, finish in results:
        calls = message["tool_calls"] or []
        for call in calls:
            valid_call(call)
        # No call syntax: the content is the text around the calls, joined (a trigger may form
        # where two pieces meet, "<" + call + "function", but no call's begin).
        content = message["content"] or ""
        assert not any(FORMATS[parser].begin(Function(name, {})) in content for name in SCHEMAS), message
        assert (finish == "tool_calls") == (bool(calls) and finish != "length"), (finish, message)
        if mode == "none":
            assert not calls
        elif isinstance(mode, dict):
            assert [c["function"]["name"] for c in calls] in (["get_time"], [])
            assert calls or finish == "length"
        elif mode == "one":
            assert len(calls) <= 1
        if mode in (None, "one"):
            made["auto"] += bool(calls)
        if mode == "required":
            made["required"] += bool(calls)
            assert calls or finish == "length"
    print(f"{parser}: calls in {made['auto']} auto responses, {made['required']} required")
    assert made["required"] >= 20 and made["auto"] >= {"hermes": 0}.get(parser, 40), made


def test_streamed_deltas_are_the_whole_response(client):
    """Greedy, one request at a time: the streamed deltas reassemble to the unstreamed message,
    for each format."""
    for parser in sorted(FORMATS):
        kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=96, temperature=0, logit_bias=BIAS[parser],
                      tool_choice="required", extra_body={"tool_call_parser": parser})
        whole = client.chat.completions.create(**kwargs).choices[0]
        streamed, finish = reassembled(client.chat.completions.create(**kwargs, stream=True))
        assert finish == whole.finish_reason and whole.message.tool_calls, whole
        assert (streamed["content"] or None) == whole.message.content
        assert [c["function"] for c in streamed["tool_calls"]] == [c.function.model_dump() for c in whole.message.tool_calls]


def test_agent_loop_with_two_tool_round_trips(client, tokenizer):
    """The openai client as an agent drives it: tools and no tool_choice; each call answered by a
    tool message, the assistant message sent back as the client returned it (content null, the
    calls); two round trips, then an answer. The last prompt is what transformers renders from
    the conversation with tiny-sala's template (every message shape taken: text parts, names)."""
    messages = [{"role": "system", "content": "You report the weather.", "name": "ops"},
                {"role": "user", "content": [{"type": "text", "text": "What is the weather in Paris, "},
                                             {"type": "text", "text": "and in Lyon?"}]}]
    rendered = [{"role": "system", "content": "You report the weather.", "name": "ops"},
                {"role": "user", "content": "What is the weather in Paris, and in Lyon?"}]
    for step in range(2):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=64, temperature=0,
                                           logit_bias=BIAS["minicpm"], stream=step == 1)
        message, finish = reassembled(r) if step == 1 else (r.choices[0].message.model_dump(), r.choices[0].finish_reason)
        assert message["tool_calls"] and finish in ("tool_calls", "length"), message  # tiny-sala may write on after a call
        messages.append(r.choices[0].message if step == 0 else {"role": "assistant", "content": message["content"],
                                                                 "tool_calls": message["tool_calls"]})
        rendered.append({"role": "assistant", "content": message["content"] or "", "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["function"]["name"], "arguments": valid_call(c)}}
            for c in message["tool_calls"]]})
        for c in message["tool_calls"]:
            result = json.dumps({"temperature": 21 + step, "sky": "clear"})
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
            rendered.append({"role": "tool", "tool_call_id": c["id"], "content": result})
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=24, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None and choice.message.content
    prompt = tokenizer.apply_chat_template(rendered, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert answer.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    assert prompt.count(TOOL_CALL_TOKEN) >= 3 and prompt.count("<|im_start|>tool\n") >= 2


def test_reasoning_is_split_out_on_a_template_that_thinks(client, http):
    """enable_thinking through chat_template_kwargs: the prompt opens <think>, the output is
    reasoning until </think> (tiny-sala does not close it: all of it here), never content; a
    response_format then holds only after the reasoning. Without thinking, the answer is content."""
    thinking = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=0,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": True}}).choices[0]
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
    assert thinking.message.reasoning_content and thinking.message.content is None
    assert plain.message.reasoning_content is None and plain.message.content
    streamed, _ = reassembled(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=0,
                                                             stream=True,
                                                             extra_body={"chat_template_kwargs": {"enable_thinking": True}}))
    assert streamed["reasoning_content"] == thinking.message.reasoning_content and not streamed["content"]
    kept = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=0, extra_body={
        "chat_template_kwargs": {"enable_thinking": True}, "separate_reasoning": False}).choices[0]
    assert kept.message.content == thinking.message.reasoning_content
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    held = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=0, response_format=fmt,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": True}}).choices[0]
    assert held.message.reasoning_content == thinking.message.reasoning_content  # free: the reasoning has not ended
    at_once = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0, response_format=fmt,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
    jsonschema.validate(json.loads(at_once.message.content), WEATHER)


def test_structural_tag_response_format_and_generate(client, http):
    """vLLM's response_format structural_tag, in both its shapes, and SGLang's in /generate: the
    output follows it (a triggered tag's content valid for its schema)."""
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<w>", "content": {
        "type": "json_schema", "json_schema": WEATHER, "max_whitespace_cnt": 1}, "end": "</w>"}}
    legacy = {"type": "structural_tag", "structures": [{"begin": "<w>", "schema": WEATHER, "end": "</w>"}], "triggers": ["<w>"]}
    for fmt in (tag, legacy):
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0, response_format=fmt,
                                           logit_bias={"32": 8})
        text = r.choices[0].message.content
        if fmt is tag:
            assert text.startswith("<w>") and text.endswith("</w>") and r.choices[0].finish_reason == "stop", text
        for piece in text.split("<w>")[1:]:
            if "</w>" in piece:
                jsonschema.validate(json.loads(piece.split("</w>")[0]), WEATHER)
    r = http.post("/generate", json={"text": "The weather:", "sampling_params": {
        "structural_tag": json.dumps(tag), "max_new_tokens": 64, "temperature": 0}}).json()
    assert r["text"].startswith("<w>") and r["text"].endswith("</w>"), r
    jsonschema.validate(json.loads(r["text"][3:-4]), WEATHER)


BAD = [
    ({**dict(messages=ASK), "tools": [{"type": "function", "function": {"parameters": WEATHER}}]}, "tools[0].function.name",
     "Field required"),
    ({"messages": ASK, "tools": TOOLS, "tool_call_parser": "nope"}, "tool_call_parser", "unknown tool-call parser"),
    ({"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope'"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True}}}]}, "tools",
     "minicpm tool-call format"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"not a name": {"type": "string"}}}}}]}, "tools", "'not a name'"),
    ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}]}, "messages",
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0]", "needs content"),
    ({"messages": [*ASK, {"role": "tool", "content": "21C"}]}, "messages[1]", "tool_call_id"),
    ({"messages": ASK, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "'tools'"),
    ({"messages": ASK, "response_format": {"type": "structural_tag", "format": {"type": "nonsense"}}}, "response_format",
     "structural_tag"),
]


@pytest.mark.parametrize("body,param,reason", BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)])
def test_bad_tool_requests_are_400s_naming_the_field(http, body, param, reason):
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and reason in err["message"], err


def test_openai_client_raises_bad_request_for_a_malformed_tool(client):
    with pytest.raises(openai.BadRequestError, match="tools\\[0\\].function.name"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[{"type": "function", "function": {"parameters": {}}}])
