"""What a tool-call format is: the text a call starts with, its arguments' grammar and its end, and
the parser from an output's text to its content and calls.

A format names its call's `trigger` (the text that starts every call: a special token such as
<|tool_call|>, or a tag), the `begin` of a call of one function (trigger, name and opening), the
`arguments` format that holds the call's arguments to the function's schema, and the `end`. From
these it makes the structural tag of a request's tool_choice (`tool_format`): free text until
the trigger, then a call held to the grammar, then free text or another call; with "required" a
call first, with a named function that call alone. The grammar only lets a call through that its
parser reads back as JSON valid for the function's parameters.

`parse` reads an output (whole, or so far while it streams) into the text outside the calls and
the calls: each call's name once its begin is complete, its arguments as JSON text as far as
they go, and whether the call has ended. Text that may still become a trigger is held back
until it is told apart, so content never holds call syntax; every part of a parse is a prefix of
the next parse's, so a stream can send just what is new.
"""
from __future__ import annotations

from dataclasses import dataclass

from sala.sampling import InvalidParam
from sala.structured import unsupported_keyword
from sala.text_markers import held_back


@dataclass(frozen=True)
class Function:
    """A function a model may call: its name and the JSON schema of its arguments object."""

    name: str
    parameters: dict


@dataclass
class Call:
    """One call read from an output: `arguments` is its JSON text so far, whole once `ended`."""

    name: str
    arguments: str
    ended: bool


@dataclass
class Parsed:
    """An output read by a format: the text outside the calls, and the calls."""

    content: str
    calls: list[Call]


class ToolCallFormat:
    """A model's tool-call syntax. Subclasses set `name`, `trigger`, `end` and write `begin`,
    `arguments` (InvalidParam for a function the syntax cannot write) and `read_arguments`."""

    name: str
    trigger: str
    end: str

    def begin(self, f: Function) -> str:
        """The text a call of f starts with, its trigger first."""
        raise NotImplementedError

    def arguments(self, f: Function) -> dict:
        """The structural-tag format of a call's arguments, between its begin and its end."""
        raise NotImplementedError

    def read_arguments(self, f: Function, text: str, start: int) -> tuple[str, int | None]:
        """A call's arguments from text[start:] on (just after its begin): (their JSON text so far,
        where the call's end ends, None while it has not come)."""
        raise NotImplementedError

    def tag(self, f: Function) -> dict:
        return {"type": "tag", "begin": self.begin(f), "content": self.arguments(f), "end": self.end}

    def tool_format(self, functions: list[Function], choice: str, parallel: bool, excludes: list[str]) -> dict:
        """The structural-tag format of an output under tool_choice `choice`: "auto" (text, calls
        where the model starts them), "required" (a call first, then text or more calls) or a
        function's name (one call of it). Without `parallel`, at most one call, nothing after it.
        `excludes`: strings never in the free text (the tokenizer's special tokens).
        InvalidParam("tools") for a function this syntax cannot write, or a schema no grammar holds."""
        tags = []
        for f in functions if choice in ("auto", "required") else [f for f in functions if f.name == choice]:
            try:
                unsupported_keyword(f.parameters)  # a keyword no grammar holds: refused, never ignored
                tags.append(self.tag(f))
            except InvalidParam as e:
                raise InvalidParam("tools", f"tool {f.name!r}: {e}") from None
        if choice not in ("auto", "required"):
            return tags[0]
        return {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags, "at_least_one": choice == "required",
                "stop_after_first": not parallel, "excludes": [e for e in excludes if e != self.trigger]}

    def parse(self, text: str, functions: list[Function], final: bool) -> Parsed:
        """`text` (the whole output if `final`, else the output so far) as content and calls."""
        content, calls, pos = [], [], 0
        while True:
            i = text.find(self.trigger, pos)
            if i < 0:
                rest = text[pos:]
                content.append(rest if final else rest[: len(rest) - held_back(rest, self.trigger)])
                break
            content.append(text[pos:i])
            f = next((f for f in functions if text.startswith(self.begin(f), i)), None)
            if f is None:
                if any(self.begin(g).startswith(text[i:]) for g in functions):
                    break  # a call whose name is still coming (or never came: cut by max_tokens), not text
                content.append(self.trigger)  # not a call of any function: text (an unconstrained output)
                pos = i + len(self.trigger)
                continue
            arguments, end = self.read_arguments(f, text, i + len(self.begin(f)))
            calls.append(Call(f.name, arguments, end is not None))
            if end is None:
                break
            pos = end
        return Parsed("".join(content), calls)


def special_texts(tokenizer, stop_ids: set[int]) -> list[str]:
    """The tokenizer's special tokens but its stop tokens: what no free text of a call's output
    holds (`tool_format`'s excludes; a request with tool calls keeps special tokens in its text,
    for the trigger)."""
    return [t for t, i in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids) if i not in stop_ids]


def refuse(fmt: ToolCallFormat, why: str) -> InvalidParam:
    return InvalidParam("tools", f"the {fmt.name} tool-call format cannot write its calls: {why}")
