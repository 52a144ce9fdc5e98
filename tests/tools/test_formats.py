"""Tool-call formats (sala/tools) and reasoning (sala/reasoning.py) against references outside
them: calls written by hand in each format's syntax (the minicpm one also as tiny-sala's chat
template writes it, and read by Python's own parser), compiled by real xgrammar over tiny-sala's
vocabulary, read back to the JSON they hold; malformed calls refused by the grammar; streamed
parses prefixes of the whole; calls sampled by the engine at temperature 1.0 valid for their
tool's schema by jsonschema.
"""
import ast
import json

import jsonschema
import pytest
import xgrammar as xgr

from sala.engine import Engine, SamplingParams, StructuredOutputs
from sala.engine.engine import stop_token_ids
from sala.reasoning import REASONING_FORMATS, REASONING_MARKS
from sala.structured import Grammars, structural_tag
from sala.text_markers import detected
from sala.tiny import TOOL_CALL_TOKEN
from sala.tools import FORMATS, TEMPLATE_MARKS, Function, special_texts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["c", "f"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "alerts": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    "note": {"type": ["string", "null"], "maxLength": 6},
}, "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {}}
FUNCTIONS = [Function("get_weather", WEATHER), Function("now", CLOCK)]
SCHEMAS = {f.name: f.parameters for f in FUNCTIONS}
CALLS = [("get_weather", {"city": "Pa/ris é", "unit": "c", "days": 3, "alerts": True, "tags": ["a"], "note": None}),
         ("get_weather", {"city": "Lyon", "unit": "f"}),
         ("now", {})]


def python_literal(v) -> str:
    """A value as Python source, JSON's strings and numbers, Python's True, False, None."""
    if isinstance(v, bool) or v is None:
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(map(python_literal, v)) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {python_literal(x)}" for k, x in v.items()) + "}"
    return json.dumps(v, ensure_ascii=False)


def written(fmt: str, name: str, args: dict) -> str:
    """A call as each format's documentation writes it."""
    if fmt == "hermes":
        return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args, ensure_ascii=False)}}}\n</tool_call>'
    if fmt == "minicpm":
        return f"{TOOL_CALL_TOKEN}{name}(" + ", ".join(f"{k}={python_literal(v)}" for k, v in args.items()) + ")"
    params = "".join(f'<param name="{k}">{v if k == "city" else json.dumps(v)}</param>' for k, v in args.items())
    return f'<function name="{name}">{params}</function>'


@pytest.fixture(scope="module")
def grammars(tokenizer, tiny_sala_dir):
    from sala.checkpoint import load_model

    stops = stop_token_ids(load_model(tiny_sala_dir), tokenizer)
    return Grammars(tokenizer, len(tokenizer), stops), stops


def accepts(grammars, constraint: StructuredOutputs, text: str, stop: int) -> bool:
    """Whether `text`, then a stop token, is an output the constraint allows (xgrammar's matcher)."""
    m = xgr.GrammarMatcher(grammars.compiled(constraint))
    return m.accept_string(text) and m.accept_token(stop)


def auto(fmt, tokenizer, stops, choice="auto", parallel=True) -> StructuredOutputs:
    return StructuredOutputs(structural_tag=structural_tag(fmt.tool_format(FUNCTIONS, choice, parallel,
                                                                          special_texts(tokenizer, stops))))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_written_calls_are_allowed_and_read_back_to_their_arguments(name, grammars, tokenizer):
    grammars, stops = grammars
    fmt, stop = FORMATS[name], tokenizer.convert_tokens_to_ids("<|im_end|>")
    constraint = auto(fmt, tokenizer, stops)
    if name == "minicpm":  # its arguments are Python's: the language's own parser reads them as the values
        call = ast.parse(written(name, *CALLS[0])[len(TOOL_CALL_TOKEN):], mode="eval").body
        assert {k.arg: ast.literal_eval(k.value) for k in call.keywords} == CALLS[0][1]
    text = "Let me look. " + " and ".join(written(name, *c) for c in CALLS) + " Done."
    assert accepts(grammars, constraint, text, stop)
    parsed = fmt.parse(text, FUNCTIONS, final=True)
    assert parsed.content == "Let me look.  and  and  Done."
    assert [(c.name, json.loads(c.arguments), c.ended) for c in parsed.calls] == [(n, a, True) for n, a in CALLS]
    for c in parsed.calls:
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    assert accepts(grammars, constraint, "Just text, no call.", stop)
    # Streamed, every parse of a prefix is a prefix of the whole one: content, calls, arguments.
    for k in range(len(text)):
        part = fmt.parse(text[:k], FUNCTIONS, final=False)
        assert parsed.content.startswith(part.content) and fmt.trigger not in part.content
        assert len(part.calls) <= len(parsed.calls)
        for a, b in zip(part.calls, parsed.calls):
            assert a.name == b.name and b.arguments.startswith(a.arguments) and (b.ended or not a.ended)


BAD_ARGUMENTS = [{"city": "Paris"}, {"city": "Paris", "unit": "k"}, {"city": "Paris", "unit": "c", "days": "3"},
                 {"city": "Paris", "unit": "c", "days": 9}, {"city": "Paris", "unit": "c", "extra": 1},
                 {"unit": "c", "city": "Paris"}]  # out of the schema's order


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_malformed_calls_are_not_allowed(name, grammars, tokenizer):
    grammars, stops = grammars
    fmt, stop = FORMATS[name], tokenizer.convert_tokens_to_ids("<|im_end|>")
    constraint = auto(fmt, tokenizer, stops)
    for args in BAD_ARGUMENTS:
        assert not accepts(grammars, constraint, written(name, "get_weather", args), stop), args
    assert not accepts(grammars, constraint, written(name, "get_time", {}), stop)  # no such tool
    spelled = {"hermes": '<tool_call>\n{"name": "now", "arguments": {}}</tool_call>',  # no newline before the end
               "minicpm": f'{TOOL_CALL_TOKEN}get_weather(city="P", unit="c", alerts=true)',  # JSON's true, not Python's
               "minicpm5": '<function name="get_weather"><param name="city">a<b</param><param name="unit">"c"</param>'
                           '</function>'}[name]  # "<" in a text argument
    assert not accepts(grammars, constraint, spelled, stop)


def test_tool_choice_shapes_the_output(grammars, tokenizer):
    """required: a call first; a named function: that call alone; parallel_tool_calls false: one
    call, then nothing. Special tokens other than the stop tokens are never in free text."""
    grammars, stops = grammars
    fmt, stop = FORMATS["minicpm"], tokenizer.convert_tokens_to_ids("<|im_end|>")
    call = written("minicpm", *CALLS[1])
    for choice, parallel, text, allowed in [
            ("required", True, "text first " + call, False), ("required", True, call + " then text " + call, True),
            ("get_weather", True, call, True), ("get_weather", True, written("minicpm", "now", {}), False),
            ("get_weather", True, call + " text", False), ("auto", False, "text " + call, True),
            ("auto", False, call + call, False), ("auto", True, "a <s> b", False)]:
        assert accepts(grammars, auto(fmt, tokenizer, stops, choice, parallel), text, stop) == allowed, (choice, text)


def test_tiny_sala_template_writes_calls_its_format_reads(tokenizer):
    """An assistant turn's calls, rendered by tiny-sala's chat template (arguments as objects,
    transformers' convention), are calls the minicpm format reads back; the template's format is
    the one detected from it, its reasoning format too, and <|tool_call|> one special token."""
    assert detected(tokenizer.chat_template, TEMPLATE_MARKS) == "minicpm"
    assert detected(tokenizer.chat_template, REASONING_MARKS) == "qwen3"
    assert len(tokenizer.encode(TOOL_CALL_TOKEN, add_special_tokens=False)) == 1
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}}
                                                                    for n, a in CALLS]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    turn = text[text.index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"):text.rindex("<|im_end|>")]
    parsed = FORMATS["minicpm"].parse(turn, FUNCTIONS, final=True)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == CALLS and parsed.content == ""


# How tiny-sala, untrained for tools, is made to call: a logit bias on its <|tool_call|> token
# (minicpm), or on "<" and "function" (minicpm5's trigger, two tokens here); hermes's trigger is six
# tokens no bias puts in order, so its calls are asked for ("required"), and come first.
SAMPLED = {"minicpm": ("auto", {543: 8.0}, 64), "minicpm5": ("auto", {32: 8.0, 1176: 8.0}, 96), "hermes": ("required", {}, 96)}


def test_sampled_calls_are_valid_for_their_schemas(tiny_sala_dir, tokenizer):
    """The engine at temperature 1.0: every call of every format that ends is valid for its
    tool's schema (jsonschema); the free text never holds the trigger."""
    engine = Engine.from_pretrained(tiny_sala_dir, compile=False, max_seqs=16)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the weather in Paris?"}], tokenize=False,
                                           add_generation_prompt=True,
                                           tools=[{"type": "function", "function": {"name": f.name, "parameters": f.parameters}}
                                                  for f in FUNCTIONS])
    excludes = special_texts(tokenizer, engine.eos_ids)
    for name, fmt in FORMATS.items():
        choice, bias, max_tokens = SAMPLED[name]
        c = StructuredOutputs(structural_tag=structural_tag(fmt.tool_format(FUNCTIONS, choice, True, excludes)))
        params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, logit_bias=bias, structured_outputs=c,
                                 skip_special_tokens=False) for i in range(16)]
        calls = 0
        for out in engine.generate([prompt] * len(params), params):
            parsed = fmt.parse(out.text, FUNCTIONS, final=True)
            assert fmt.trigger not in parsed.content, out.text
            for call in parsed.calls:
                if call.ended:
                    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
                    calls += 1
        print(f"{name} ({choice}): {calls} calls in 16 outputs")
        assert calls >= 8, name


REASONING = REASONING_FORMATS["qwen3"]


def test_reasoning_is_split_from_the_answer_as_it_streams():
    whole = "I should look it up.\n</think>\n\nIt is sunny."
    for opened, text in ((True, whole), (False, "<think>" + whole), (False, "\n<think>" + whole)):
        assert REASONING.split(text, opened, final=True) == ("I should look it up.\n", "It is sunny.")
        for k in range(len(text)):
            reasoning, answer = REASONING.split(text[:k], opened, final=False)
            assert "I should look it up.\n".startswith(reasoning) and "It is sunny.".startswith(answer), (k, reasoning)
    assert REASONING.split("It is sunny.", False, final=True) == ("", "It is sunny.")
    assert REASONING.split("cut short", True, final=True) == ("cut short", "")
    assert REASONING.opened_by("<|im_start|>assistant\n<think>\n")
    assert not REASONING.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_constraint_holds_from_the_reasoning_end_on(grammars, tokenizer):
    grammars, _ = grammars
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    c = StructuredOutputs(json=WEATHER, reasoning_end=REASONING.end)
    assert accepts(grammars, c, 'Paris, then.\n{"x"</think>{"city": "Paris", "unit": "c"}', stop)
    assert not accepts(grammars, c, '{"city": "Paris", "unit": "c"}', stop)  # no reasoning end: not yet JSON
    assert not accepts(grammars, c, "thinking</think>sunny", stop)
