"""A server's tool calls and reasoning (its --tool-call-parser and --reasoning-parser), applied to a
chat request: the constraint its tool_choice makes, the parser of its output, the sampling
changes they need.

With a tool-call format, tool_choice "auto", "required" and a named function are structural
tags in the model's own syntax (sala/tools): free text, and calls held to their functions'
schemas from their trigger on; "none" bans the trigger (free text without it, unless another
constraint holds the output). Without one, "required" and a named function are JSON
(serve/json_tools.py) and "auto" is refused, naming the flag. A constraint applies after the
reasoning where the prompt opens it (StructuredOutputs.reasoning_end).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from sala.engine import InvalidParam, SamplingParams, StructuredOutputs
from sala.reasoning import REASONING_FORMATS, REASONING_MARKS, ReasoningFormat
from sala.structured import structural_tag
from sala.text_markers import detected, named
from sala.tools import FORMATS, TEMPLATE_MARKS, Function, ToolCallFormat, special_texts
from serve.json_tools import ArgumentsOf, CallArray, tool_calls_schema
from serve.protocol import schema_text


@dataclass(frozen=True)
class ChatTools:
    """format: the tool-call format (None: calls as JSON only); reasoning: the reasoning format
    (None: not split out); excludes: the special tokens no free text of a tool call's output
    holds (every one but the stop tokens)."""

    format: ToolCallFormat | None
    reasoning: ReasoningFormat | None
    excludes: tuple[str, ...]

    @classmethod
    def of(cls, tokenizer, stop_ids: set[int], tool_call_parser: str | None, reasoning_parser: str | None) -> ChatTools:
        """A server's settings: the parsers named (None: the one the chat template writes, if any;
        "none": none) for its tokenizer."""
        tool_call_parser = detected(tokenizer.chat_template, TEMPLATE_MARKS) if tool_call_parser is None else tool_call_parser
        reasoning_parser = detected(tokenizer.chat_template, REASONING_MARKS) if reasoning_parser is None else reasoning_parser
        return cls(None if tool_call_parser in (None, "none") else named(FORMATS, tool_call_parser, "tool-call parser"),
                   None if reasoning_parser in (None, "none") else named(REASONING_FORMATS, reasoning_parser, "reasoning parser"),
                   tuple(special_texts(tokenizer, stop_ids)))

    def describe(self) -> str:
        return (f"tool-call parser {self.format.name if self.format else 'none'}, "
                f"reasoning parser {self.reasoning.name if self.reasoning else 'none'}")

    def with_format(self, name: str | None) -> ChatTools:
        """These settings with the format a request names (None: the server's; "none": no format);
        InvalidParam for an unknown one."""
        if name is None:
            return self
        if name not in (*FORMATS, "none"):
            raise InvalidParam("tool_call_parser", f"unknown tool-call parser {name!r}; known: {', '.join(sorted(FORMATS))}, "
                                                   "or none")
        return replace(self, format=FORMATS.get(name))

    def constraint(self, mode: str | None, functions: list[Function], parallel: bool) -> StructuredOutputs | None:
        """The output's constraint under tool_choice `mode` (ChatCompletionRequest.tool_call)."""
        if mode is None:
            return None
        if self.format is None:
            if mode == "auto":
                raise InvalidParam("tool_choice", 'tool_choice "auto" (the default when tools are given) needs a parser '
                                                  "of the model's tool-call format to tell its calls from its text: "
                                                  "start the server with --tool-call-parser (hermes, minicpm, minicpm5); "
                                                  'or use tool_choice "required" or {"type": "function", "function": '
                                                  '{"name": ...}}, which hold the output to calls as JSON')
            if mode == "required":
                return StructuredOutputs(json=schema_text(tool_calls_schema(functions, parallel), "tools"))
            return StructuredOutputs(json=schema_text(next(f for f in functions if f.name == mode).parameters, "tools"))
        return StructuredOutputs(structural_tag=structural_tag(self.format.tool_format(functions, mode, parallel,
                                                                                       list(self.excludes))))

    def parser(self, mode: str | None):
        """What reads the calls back from the output (None: no calls)."""
        if mode is None:
            return None
        if self.format is not None:
            return self.format
        return CallArray() if mode == "required" else ArgumentsOf(mode)

    def sampling(self, params: SamplingParams, mode: str | None, tools_given: bool, opened: bool) -> SamplingParams:
        """A request's parameters as its tools and reasoning need them: with tool_choice "none",
        text without the trigger (unless another constraint holds it); the trigger token kept in
        the text its parser reads; the constraint after the reasoning when the prompt opened it."""
        if self.format is not None and tools_given and mode is None and params.structured_outputs is None:
            banned = structural_tag({"type": "any_text", "excludes": [self.format.trigger]})
            params = replace(params, structured_outputs=StructuredOutputs(structural_tag=banned))
        if self.format is not None and mode is not None:
            params = replace(params, skip_special_tokens=False)
        c = params.structured_outputs
        if c is not None and opened:
            params = replace(params, structured_outputs=replace(c, reasoning_end=self.reasoning.end))
        return params
