"""Arguments as a list of named values, held to the function's parameters schema: the grammar the
keyword-argument formats (minicpm's Python calls, minicpm5's XML params) give a call's arguments.

The parameters schema must be an object that lists its properties (`properties`, `required`;
no other properties, as an object schema allows in strict mode): a call writes them in the
schema's order, each required one present, each optional one present or not. Each value is
held to its property's schema through xgrammar's own JSON grammar of that schema
(`sala.structured.json_grammar`), its rules renamed into one grammar per call, and respelled
where the format writes a value otherwise (`respell`).
"""
from __future__ import annotations

import json
from typing import Callable

from sala.structured import EBNF_TOKEN, json_grammar
from sala.tools.format import Function, ToolCallFormat, refuse

SCHEMA_KEYS = {"type", "properties", "required", "additionalProperties", "title", "description", "$defs", "definitions",
               "$schema", "$id"}


def properties(f: Function, fmt: ToolCallFormat, name_ok: Callable[[str], bool]) -> list[tuple[str, dict, bool]]:
    """(name, schema, required) of each property of f's parameters, in order; InvalidParam("tools")
    where the parameters are no object of listed properties, or a name is not one `name_ok` takes."""
    p = f.parameters
    props, required = p.get("properties", {}), p.get("required", [])
    if (p.get("type", "object") != "object" or not SCHEMA_KEYS >= p.keys() or p.get("additionalProperties", False) is not False
            or not isinstance(props, dict) or not isinstance(required, list)):
        raise refuse(fmt, "its parameters must be an object schema that lists its properties (properties, required; "
                          f"no additionalProperties), got keys {sorted(p)}")
    if bad := [k for k in props if not name_ok(k)]:
        raise refuse(fmt, f"parameter name {bad[0]!r} cannot be written as an argument name")
    return [(k, v, k in required) for k, v in props.items()]


def value_schema(f: Function, schema: dict) -> str:
    """A property's schema as JSON text, with the parameters' definitions it may refer to."""
    defs = {k: f.parameters[k] for k in ("$defs", "definitions") if k in f.parameters}
    return json.dumps({**schema, **defs} if isinstance(schema, dict) else schema, ensure_ascii=False)


def renamed(ebnf: str, prefix: str, respell: Callable[[str], str] = lambda t: t) -> str:
    """xgrammar's EBNF with every rule name prefixed (so grammars can share one namespace), its
    lookahead assertions dropped (they only speed matching up, and name what follows a JSON value
    in JSON: `,` `}` `]`, where a keyword argument is followed by others), and each literal and
    character class through `respell`."""
    out, tokens, i = [], EBNF_TOKEN.findall(ebnf), 0
    while i < len(tokens):
        t = tokens[i]
        if t == "(" and i + 1 < len(tokens) and tokens[i + 1] == "=":  # a lookahead: skip to its closing parenthesis
            depth = 0
            while True:
                depth += {"(": 1, ")": -1}.get(tokens[i], 0)
                i += 1
                if depth == 0:
                    break
            continue
        out.append(f"{prefix}{t}" if t[0].isalpha() or t[0] == "_" else respell(t) if t[0] in '"[' else t)
        i += 1
    return "".join(out)


def keyword_arguments(f: Function, fmt: ToolCallFormat, name_ok: Callable[[str], bool], around: Callable[[str], tuple[str, str]],
                      value_rules: Callable[[dict, str], str], separator: str) -> dict:
    """The structural-tag format of f's arguments as named values: around(name) is the text
    before and after a value, value_rules(schema, prefix) a value's rules (root `{prefix}root`),
    `separator` between two; InvalidParam where `properties` refuses the parameters."""
    values, rules = [], []
    for i, (name, schema, required) in enumerate(properties(f, fmt, name_ok)):
        before, after = (json.dumps(t) for t in around(name))  # as EBNF string literals
        values.append((f"{before} p{i}_root {after}", required))
        rules.append(value_rules(schema, f"p{i}_"))
    return {"type": "grammar", "grammar": "\n".join([keyword_grammar(values, separator), *rules])}


def keyword_grammar(values: list[tuple[str, bool]], separator: str) -> str:
    """The rules of a list of named values, root `root`: values are (one named value as an EBNF
    sequence, whose rules come apart; whether it is required), written in order, each optional
    one there or not, `separator` between two."""
    n, sep = len(values), json.dumps(separator)
    rules = ["root ::= first_0", f'first_{n} ::= ""', f'rest_{n} ::= ""']
    for i, (value, required) in enumerate(values):  # first_i: values i.. with none before them; rest_i: after one
        rules.append(f"first_{i} ::= {value} rest_{i + 1}" + ("" if required else f" | first_{i + 1}"))
        rules.append(f"rest_{i} ::= {sep} {value} rest_{i + 1}" + ("" if required else f" | rest_{i + 1}"))
    return "\n".join(rules)


def json_value_rules(f: Function, schema: dict, prefix: str, respell: Callable[[str], str] = lambda t: t) -> str:
    """Rules of a JSON value valid for `schema` (a property's), root `{prefix}root`."""
    return renamed(json_grammar(value_schema(f, schema)), prefix, respell)
