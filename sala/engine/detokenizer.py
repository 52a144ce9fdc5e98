"""Token ids -> text, one token at a time, with stop strings.

Decoding each new token on its own is wrong twice over: byte-level BPE splits multi-byte
characters across tokens (half a character decodes to U+FFFD), and SentencePiece-style
tokenizers drop a leading space at the start of a decode. So, as vLLM does, the text of the
new tokens is the decode of a short window (a few earlier tokens as context plus the new ones)
minus the decode of the context alone, and it is held back while it ends in U+FFFD.

Stop strings: the output text is cut before the first occurrence of any of them (after it,
with no_stop_trim). While a request streams, the last (longest stop string - 1) characters are held back, since they may
be the start of a stop string that the next token completes.
"""
from __future__ import annotations

CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool = True,
                 no_stop_trim: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.no_stop_trim = no_stop_trim
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # the output text so far (cut at a stop string once one is found)
        self.emitted = 0  # characters of `text` already handed out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add one generated token; returns the stop string the text now contains, if any
        (check_stop False: none is looked for, as before a request's min_tokens)."""
        self.ids.append(token_id)
        context = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.ids[self.prefix_offset :])
        if len(window) <= len(context) or window.endswith("\ufffd"):
            return None
        searched_from = max(0, len(self.text) - self.holdback)
        self.text += window[len(context) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if not check_stop:
            return None
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, searched_from)) >= 0]
        if hits:
            i, s = min(hits, key=lambda h: (h[0], -len(h[1])))
            self.text = self.text[: i + len(s) if self.no_stop_trim else i]
            return s
        return None

    def delta(self, finished: bool) -> str:
        """Text not handed out yet, keeping back a possible stop-string prefix unless finished."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
