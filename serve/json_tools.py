"""Tool calls as JSON, for a server without a tool-call format (vLLM's way without a parser):
tool_choice naming a function holds the output to that function's arguments; "required" to a
JSON array of {"name", "parameters"} objects, one per call. Each read back by a parser of the
same shape as a model format's (sala/tools/format.py): `parse(text, functions, final)`.
"""
from __future__ import annotations

import json

from sala.engine import InvalidParam
from sala.tools import Call, Function, Parsed
from serve.protocol import shallow

# A JSON schema's definitions: a tool's are moved to the root of the "required" schema, where its
# references ("#/$defs/...") then point.
DEFINITIONS = ("$defs", "definitions")
DECODER = json.JSONDecoder()


def tool_calls_schema(functions: list[Function], parallel: bool) -> dict:
    """The output of tool_choice "required", as vLLM constrains it: a JSON array of at least one
    {"name", "parameters"} object, each one tool's name and arguments (at most one without
    parallel tool calls)."""
    defs: dict[str, dict] = {}
    calls = []
    for f in functions:
        shallow(f.parameters, "tools")  # before local_ref recurses through it
        params = dict(f.parameters)
        for key in DEFINITIONS:
            for name, sub in (params.pop(key, None) or {}).items():
                if defs.setdefault(key, {}).setdefault(name, sub) != sub:
                    raise InvalidParam("tools", f"two tools define {key}/{name} differently; with tool_choice \"required\" "
                                                "their definitions share one schema")
        outside = local_ref(params)
        if outside is not None:
            raise InvalidParam("tools", f"tool {f.name!r}: $ref {outside!r} cannot be resolved once its parameters are "
                                        "one branch of tool_choice \"required\"'s schema; refer to #/$defs/... only")
        calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [f.name]}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}} | ({} if parallel else {"maxItems": 1})
    return schema | defs


def local_ref(schema) -> str | None:
    """The first $ref in schema that points elsewhere than its definitions (#/$defs/..., #/definitions/...)."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and not ref.startswith(("#/$defs/", "#/definitions/")):
            return ref
        values = schema.values()
    elif isinstance(schema, list):
        values = schema
    else:
        return None
    return next((r for v in values if (r := local_ref(v)) is not None), None)


class ArgumentsOf:
    """A named function's output: its arguments, streamed as they come, ended once the output
    has ended with the whole object (not cut short by max_tokens)."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, functions: list[Function], final: bool) -> Parsed:
        return Parsed("", [Call(self.name, text, final and whole_json(text))])


def whole_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class CallArray:
    """tool_choice "required"'s output: each call once its object in the array is complete."""

    def parse(self, text: str, functions: list[Function], final: bool) -> Parsed:
        calls, pos = [], 0
        while True:
            rest = text[pos:].lstrip()
            if not rest.startswith(("[", ",")):  # the array's end, or more to come
                return Parsed("", calls)
            start = len(text) - len(rest[1:].lstrip())
            try:
                call, pos = DECODER.raw_decode(text, start)
            except ValueError:  # this call's object is not complete yet
                return Parsed("", calls)
            calls.append(Call(call["name"], json.dumps(call["parameters"], ensure_ascii=False), True))
