"""The hermes tool-call format, many ChatML models' (Hermes, Qwen2.5, Qwen3): a JSON object of the
name and the arguments between <tool_call> tags.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}
    </tool_call>
"""
from __future__ import annotations

import json

from sala.structured import json_grammar
from sala.tools.format import Function, ToolCallFormat

DECODER = json.JSONDecoder()


class Hermes(ToolCallFormat):
    name = "hermes"
    trigger = "<tool_call>"
    end = "}\n</tool_call>"

    def begin(self, f: Function) -> str:
        return f'<tool_call>\n{{"name": {json.dumps(f.name, ensure_ascii=False)}, "arguments": '

    def arguments(self, f: Function) -> dict:
        return {"type": "grammar", "grammar": json_grammar(json.dumps(f.parameters, ensure_ascii=False))}

    def read_arguments(self, f: Function, text: str, start: int) -> tuple[str, int | None]:
        try:
            _, stop = DECODER.raw_decode(text, start)
        except ValueError:  # the object is still coming: all of it so far is arguments
            return text[start:], None
        return text[start:stop], stop + len(self.end) if text.startswith(self.end, stop) else None
