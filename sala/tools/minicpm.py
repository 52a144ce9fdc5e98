"""The minicpm tool-call format, MiniCPM's and tiny-sala's: after the <|tool_call|> token, a Python
call with keyword arguments, each value a Python literal (JSON's spelling, with True, False and
None).

    <|tool_call|>get_weather(city="Paris", unit="c", days=3, alerts=False)

Its arguments are the parameters' properties in the schema's order (sala/tools/kwargs.py), so a
tool's parameters must be an object schema that lists its properties, named as Python names.
"""
from __future__ import annotations

import json
import re

from sala.tools.format import Function, ToolCallFormat
from sala.tools.kwargs import json_value_rules, keyword_arguments

KEY = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=")
# Inside a value: a JSON string (kept as it is), or a Python constant spelled as JSON spells it.
LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"|True|False|None')
AS_JSON = {"True": "true", "False": "false", "None": "null"}
AS_PYTHON = {f'"{v}"': f'"{k}"' for k, v in AS_JSON.items()}
JSON_ESCAPES, PYTHON_ESCAPES = r'[\"\\/bfnrt]', r'[\"\\bfnrt]'  # Python reads "\/" as two characters


def python_spelling(token: str) -> str:
    """A literal or character class of a JSON grammar as Python writes that value."""
    return AS_PYTHON.get(token, PYTHON_ESCAPES if token == JSON_ESCAPES else token)


def value_end(text: str, start: int) -> int | None:
    """Where the value from text[start] ends: the first "," or ")" outside its strings and
    brackets; None until one comes."""
    depth, in_string, i = 0, False, start
    while i < len(text):
        c = text[i]
        if in_string:
            if c == "\\":
                i += 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif depth == 0 and c in ",)":
            return i
        i += 1
    return None


class MiniCPM(ToolCallFormat):
    name = "minicpm"
    trigger = "<|tool_call|>"
    end = ")"

    def begin(self, f: Function) -> str:
        return f"{self.trigger}{f.name}("

    def arguments(self, f: Function) -> dict:
        return keyword_arguments(f, self, str.isidentifier, lambda name: (f"{name}=", ""),
                                 lambda schema, prefix: json_value_rules(f, schema, prefix, python_spelling), ", ")

    def read_arguments(self, f: Function, text: str, start: int) -> tuple[str, int | None]:
        pairs, pos = [], start
        while True:
            if text.startswith(self.end, pos):
                return "{" + ", ".join(pairs) + "}", pos + len(self.end)
            if pairs:
                if not text.startswith(", ", pos):
                    return "{" + ", ".join(pairs), None
                pos += 2
            key = KEY.match(text, pos)
            end = None if key is None else value_end(text, key.end())
            if end is None:
                return "{" + ", ".join(pairs), None
            value = LITERAL.sub(lambda m: AS_JSON.get(m[0], m[0]), text[key.end():end])
            pairs.append(f"{json.dumps(key[1])}: {value}")
            pos = end
