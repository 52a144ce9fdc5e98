"""Markers in a model's text (a tool call's trigger, a reasoning block's end) and in its chat
template: how much of a text that is still growing may yet become a marker, and which format a
chat template's markers name, as --tool-call-parser and --reasoning-parser name formats."""
from __future__ import annotations


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` may be the start of `marker`."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)


def template_text(chat_template) -> str:
    """A tokenizer's chat template as one text (named templates joined; none: empty)."""
    return "".join(chat_template.values()) if isinstance(chat_template, dict) else chat_template or ""


def detected(chat_template, marks: tuple[tuple[str, str], ...]) -> str | None:
    """The name of the first (mark, name) whose mark the chat template writes; None if it writes none."""
    text = template_text(chat_template)
    return next((name for mark, name in marks if mark in text), None)


def named(formats: dict, name: str, what: str):
    """formats[name]; ValueError naming the known ones (`what`: the kind, for the message)."""
    if name not in formats:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(formats))}")
    return formats[name]
