"""One choice's chat output as OpenAI shapes it: the reasoning (reasoning_content), the text
outside tool calls (content) and the calls (tool_calls), read from the output's text as it grows.

The text is split again whole at each step, the reasoning by its format (sala/reasoning.py),
the answer by the request's tool-call parser (sala/tools; serve/json_tools.py's without one);
each part of a split is a prefix of the next one's, so `feed` hands out just what is new: a
stream's deltas. A call goes out once it has ended, as its name (with its id) and then its
arguments in the pieces they were generated in: a stream, like a message, never holds a call
cut short by max_tokens (whose finish_reason "length" says the turn was cut).
"""
from __future__ import annotations

import uuid

from sala.reasoning import ReasoningFormat
from sala.tools import Function, Parsed


class ChatOutput:
    def __init__(self, parser=None, functions: list[Function] | None = None, reasoning: ReasoningFormat | None = None,
                 opened: bool = False):
        """parser: the tool calls' (None: no tools, the answer is content); reasoning: the
        reasoning's format (None: not split out); opened: the prompt left the output inside it."""
        self.parser, self.functions, self.reasoning, self.opened = parser, functions or [], reasoning, opened
        self.text = ""
        self.reasoning_text, self.parsed = "", Parsed("", [])
        self.ids: list[str] = []  # of the calls sent
        self.pieces: list[list[str]] = []  # each call's arguments, in the pieces they came in

    def feed(self, text: str, final: bool) -> list[dict]:
        """Add output text (`final`: the output has ended); the deltas of what this makes new, in order."""
        self.text += text
        reasoning, answer = (("", self.text) if self.reasoning is None else
                             self.reasoning.split(self.text, self.opened, final))
        parsed = Parsed(answer, []) if self.parser is None else self.parser.parse(answer, self.functions, final)
        deltas = []
        if len(reasoning) > len(self.reasoning_text):
            deltas.append({"reasoning_content": reasoning[len(self.reasoning_text):]})
        if len(parsed.content) > len(self.parsed.content):
            deltas.append({"content": parsed.content[len(self.parsed.content):]})
        for i, call in enumerate(parsed.calls):
            if i == len(self.pieces):
                self.pieces.append([])
            if len(call.arguments) > sum(map(len, self.pieces[i])):
                self.pieces[i].append(call.arguments[sum(map(len, self.pieces[i])):])
            if call.ended and i == len(self.ids):
                self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
                deltas.append({"tool_calls": [{"index": i, "id": self.ids[i], "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
                deltas += [{"tool_calls": [{"index": i, "function": {"arguments": piece}}]} for piece in self.pieces[i]]
        self.reasoning_text, self.parsed = reasoning, parsed
        return deltas

    @property
    def called(self) -> bool:
        return any(c.ended for c in self.parsed.calls)

    def message(self) -> dict:
        """OpenAI's message of the output read so far (after its final feed): content null when
        calls or reasoning are all there is; tool_calls when there are calls; reasoning_content
        when it is split."""
        calls = [{"id": self.ids[i], "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for i, c in enumerate(self.parsed.calls) if c.ended]
        content = self.parsed.content
        read = self.parser is not None or self.reasoning is not None  # the text was split: nothing left is null
        out = {"role": "assistant", "content": None if read and not content.strip() else content}
        if calls:
            out["tool_calls"] = calls
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning_text or None
        return out
