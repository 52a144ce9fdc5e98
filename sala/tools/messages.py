"""A conversation as chat templates read it (transformers' convention): content as text, each
call's arguments an object where OpenAI sends them as JSON text."""
from __future__ import annotations

import json

from sala.sampling import InvalidParam


def template_message(message: dict, index: int) -> dict:
    """Message `index` of a conversation (OpenAI's shape; keys whose value is null left out) for
    the template; InvalidParam("messages") for a call whose arguments are no JSON object."""
    out = {k: v for k, v in message.items() if v is not None}
    if isinstance(out.get("content"), list):  # text parts
        out["content"] = "".join(p.get("text") or "" for p in out["content"])
    out.setdefault("content", "")
    if calls := out.get("tool_calls"):
        out["tool_calls"] = [{**call, "function": {**call["function"], "arguments": arguments(call, index, j)}}
                             for j, call in enumerate(calls)]
    return out


def arguments(call: dict, message: int, index: int) -> dict:
    value = call["function"].get("arguments")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            value = None
    if not isinstance(value, dict):
        raise InvalidParam("messages", f"messages[{message}].tool_calls[{index}].function.arguments must be a JSON object "
                                       f"(or its text), got {str(call['function'].get('arguments'))[:80]!r}")
    return value
