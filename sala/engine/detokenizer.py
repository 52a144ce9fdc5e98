"""Token ids -> text, one token at a time, with stop strings.

Decoding each new token on its own is wrong twice over: byte-level BPE splits multi-byte
characters across tokens (half a character decodes to U+FFFD), and SentencePiece-style
tokenizers drop a leading space at the start of a decode. So, as vLLM does, the text of the
new tokens is the decode of a short window (a few earlier tokens as context plus the new ones)
minus the decode of the context alone, and it is held back while it ends in U+FFFD.

Stop strings: the output text is cut before the first occurrence of any of them. While a
request streams, the last (longest stop string - 1) characters are held back, since they may
be the start of a stop string that the next token completes.
"""
from __future__ import annotations

CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # the output text so far (cut at a stop string once one is found)
        self.emitted = 0  # characters of `text` already handed out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> bool:
        """Add one generated token; True when the text now contains a stop string."""
        self.ids.append(token_id)
        context = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.ids[self.prefix_offset :])
        if len(window) <= len(context) or window.endswith("\ufffd"):
            return False
        searched_from = max(0, len(self.text) - self.holdback)
        self.text += window[len(context) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        hits = [i for i in (self.text.find(s, searched_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def delta(self, finished: bool) -> str:
        """Text not handed out yet, keeping back a possible stop-string prefix unless finished."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
