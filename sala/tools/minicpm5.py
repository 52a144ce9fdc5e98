"""The minicpm5 tool-call format, MiniCPM5's: a call as XML, each argument a <param>.

    <function name="get_weather"><param name="city">Paris</param><param name="days">3</param></function>

A string argument (its schema a plain string: a type and length bounds) is written as it is, and
holds no "<"; any other value is JSON. The arguments are the parameters' properties in the
schema's order (sala/tools/kwargs.py), so a tool's parameters must be an object schema that lists
its properties.
"""
from __future__ import annotations

import json
import re

from sala.tools.format import Function, ToolCallFormat
from sala.tools.kwargs import json_value_rules, keyword_arguments, properties

PARAM = re.compile(r'<param name="([^"<>&]+)">')
PARAM_END = "</param>"
TEXT_KEYS = {"type", "minLength", "maxLength", "title", "description", "default", "examples"}


def plain_string(schema) -> bool:
    """A schema every string of some length is valid for: its value is written as text."""
    return isinstance(schema, dict) and schema.get("type") == "string" and schema.keys() <= TEXT_KEYS


def name_ok(name: str) -> bool:
    return bool(name) and not set(name) & set('"<>&')


class MiniCPM5(ToolCallFormat):
    name = "minicpm5"
    trigger = "<function"
    end = "</function>"

    def begin(self, f: Function) -> str:
        return f'<function name="{f.name}">'

    def arguments(self, f: Function) -> dict:
        return keyword_arguments(f, self, name_ok, lambda name: (f'<param name="{name}">', PARAM_END),
                                 lambda schema, prefix: text_rule(schema, prefix) if plain_string(schema)
                                 else json_value_rules(f, schema, prefix), "")

    def read_arguments(self, f: Function, text: str, start: int) -> tuple[str, int | None]:
        schemas = {name: schema for name, schema, _ in properties(f, self, name_ok)}
        pairs, pos = [], start
        while True:
            if text.startswith(self.end, pos):
                return "{" + ", ".join(pairs) + "}", pos + len(self.end)
            param = PARAM.match(text, pos)
            close = -1 if param is None else text.find(PARAM_END, param.end())
            if close < 0:
                return "{" + ", ".join(pairs), None
            raw = text[param.end():close]
            value = json.dumps(raw, ensure_ascii=False) if plain_string(schemas.get(param[1])) else raw
            pairs.append(f"{json.dumps(param[1], ensure_ascii=False)}: {value}")
            pos = close + len(PARAM_END)


def text_rule(schema: dict, prefix: str) -> str:
    """A string of the schema's length, without "<", as text."""
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    return f"{prefix}root ::= [^<]{{{low},{'' if high is None else high}}}"
