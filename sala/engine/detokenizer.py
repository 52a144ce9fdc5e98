"""Token ids -> text, one token at a time, with stop strings.

Decoding each new token on its own is wrong twice over: byte-level BPE splits multi-byte
characters across tokens (half a character decodes to U+FFFD), and SentencePiece-style
tokenizers drop a leading space at the start of a decode. So the tokenizers library's
DecodeStream (one call into Rust a token) takes the text of the new tokens as the decode of a
short window (a few earlier tokens as context plus the new ones) minus the decode of the context
alone, held back while it ends in U+FFFD, as vLLM's prefix and read offsets do. The first window's context is the prompt's last CONTEXT_TOKENS tokens (from the
start of a character), so the first generated token keeps its leading space mid-sentence.

Stop strings: the output text is cut before the first occurrence of any of them (after it,
with no_stop_trim). While a request streams, the last (longest stop string - 1) characters are held back, since they may
be the start of a stop string that the next token completes.

The tokenizer must have a fast (tokenizers) backend, as every one `sala.checkpoint.load_tokenizer`
or AutoTokenizer gives for a SALA checkpoint has (sala/hf.py registers only the fast class). Decoding goes straight to the
backend: a tokenizer's clean_up_tokenization_spaces (False for SALA's) is not applied.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool = True,
                 no_stop_trim: bool = False):
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        if self.backend is None:
            raise TypeError(f"{type(tokenizer).__name__} has no fast (tokenizers) backend: the engine detokenizes through one")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.no_stop_trim = no_stop_trim
        # The context starts on a character: with it cut, SentencePiece's byte fallback decodes a
        # whole run of byte tokens (CJK text, emoji), the new ones too, as U+FFFDs.
        n = min(CONTEXT_TOKENS, len(prompt_ids))
        start = self._decode(prompt_ids[len(prompt_ids) - n :])
        while start.startswith("\ufffd") and n < min(CONTEXT_TOKENS + 3, len(prompt_ids)):  # UTF-8: 4 bytes at most
            n += 1
            start = self._decode(prompt_ids[len(prompt_ids) - n :])
        self.stream = DecodeStream(ids=list(prompt_ids[len(prompt_ids) - n :]), skip_special_tokens=skip_special_tokens)
        # A prompt cut mid-character: the stream keeps no start text ending in U+FFFD, so what it
        # gives first is the whole window's text, the context's included. As a full decode less
        # the prompt's has it, the output is that text less as many characters as the context's
        # (a U+FFFD may stand for 2 bytes that become 1 character: then 1 more is cut).
        self.cut, self.window = (len(start) if start.endswith("\ufffd") else 0), ""
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # the output text so far (cut at a stop string once one is found)
        self.emitted = 0  # characters of `text` already handed out

    def _decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add one generated token; returns the stop string the text now contains, if any
        (check_stop False: none is looked for, as before a request's min_tokens)."""
        try:
            piece = self.stream.step(self.backend, token_id)
        except Exception:  # a decoder whose text for more tokens rewrites that for fewer (none of SALA's)
            self.stream, self.cut = DecodeStream(skip_special_tokens=self.skip_special_tokens), 0  # on from this token
            piece = self.stream.step(self.backend, token_id)
        if not piece:
            return None
        if self.cut:
            self.window += piece
            if len(self.window) <= self.cut:
                return None
            piece, self.cut = self.window[self.cut :], 0
        searched_from = max(0, len(self.text) - self.holdback)
        self.text += piece
        if not check_stop or not self.stop:
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
