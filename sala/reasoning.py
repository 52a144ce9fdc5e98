"""A model's reasoning, split from its answer: the text between a start and an end marker
(<think> ... </think>), which a chat template may open in the prompt (its enable_thinking).

`REASONING_FORMATS` by name, as --reasoning-parser names them (qwen3: vLLM's and SGLang's name for
<think> ... </think>, which MiniCPM's thinking models write too); `REASONING_MARKS` tell the one
a chat template writes (sala/text_markers.py's `detected`).
"""
from __future__ import annotations

from dataclasses import dataclass

from sala.text_markers import held_back


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str
    end: str

    def opened_by(self, prompt: str) -> bool:
        """Whether the prompt leaves the output inside a reasoning block (a start with no end after it)."""
        i = prompt.rfind(self.start)
        return i >= 0 and self.end not in prompt[i:]

    def split(self, text: str, opened: bool, final: bool) -> tuple[str, str]:
        """(the reasoning so far, the answer so far) of an output (whole if `final`) that starts
        inside a reasoning block if `opened`, else may start one. Text that may still be a marker is
        held back until it is told apart; each part is a prefix of the next split's."""
        if not opened:
            lead = text.lstrip()
            if not lead.startswith(self.start):
                return "", "" if not final and self.start.startswith(lead) else text
            text = lead[len(self.start):]
        i = text.find(self.end)
        if i < 0:
            return text if final else text[: len(text) - held_back(text, self.end)], ""
        return text[:i], text[i + len(self.end):].lstrip()


REASONING_FORMATS = {f.name: f for f in (ReasoningFormat("qwen3", "<think>", "</think>"),)}
REASONING_MARKS = (("</think>", "qwen3"),)  # a template that closes a reasoning block writes that format
