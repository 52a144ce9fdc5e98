"""Token ids -> text, one token at a time, with stop strings.

Decoding each new token on its own is wrong twice over: byte-level BPE splits multi-byte
characters across tokens (half a character decodes to U+FFFD), and SentencePiece-style
tokenizers drop a leading space at the start of a decode. The tokenizers library's DecodeStream
does in Rust what vLLM's prefix/read-offset window did here in Python (two decodes through
transformers a token): the text of the new tokens is the decode of a short window (a few earlier
tokens as context plus the new ones) minus the decode of the context alone, held back while it
ends in U+FFFD. The first window's context is the prompt's last CONTEXT_TOKENS tokens (from the
start of a character), so the first generated token keeps its leading space mid-sentence.

Stop strings: the output text is cut before the first occurrence of any of them (after it,
with no_stop_trim). While a request streams, the last (longest stop string - 1) characters are held back, since they may
be the start of a stop string that the next token completes.

The tokenizer must have a fast (tokenizers) backend, as every one AutoTokenizer gives for a SALA
checkpoint has (sala/config.py registers only the fast class). Decoding goes straight to the
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


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins (GPT-2's bytes_to_unicode), character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_strings(tokenizer) -> set[str]:
    """Every string in a fast tokenizer's decoder (its and its sub-decoders' types: ByteLevel,
    ByteFallback, Metaspace, ...; Replace patterns such as "▁")."""
    import json

    found: set[str] = set()

    def walk(node):
        if isinstance(node, str):
            found.add(node)
        for v in node.values() if isinstance(node, dict) else node if isinstance(node, list) else ():
            walk(v)

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        walk(json.loads(backend.to_str()).get("decoder"))
    return found


class TokenBytes:
    """Token id -> the bytes it stands for, as OpenAI's logprob `bytes` report them: a token that
    is half of a UTF-8 character gives that half, not the U+FFFD its decode would show. Byte-level
    BPE pieces map back through their alphabet, SentencePiece byte-fallback pieces (<0xE2>) are
    their byte and its word marker a space; added and special tokens are their own text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        kinds = _decoder_strings(tokenizer)
        self.byte_level = _byte_level_alphabet() if "ByteLevel" in kinds else None
        self.byte_fallback = "ByteFallback" in kinds
        self.metaspace = "Metaspace" in kinds or "▁" in kinds
        self.added = set(tokenizer.get_added_vocab().values()) if hasattr(tokenizer, "get_added_vocab") else set()
        self.cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        if token_id not in self.cache:
            self.cache[token_id] = self._bytes(token_id)
        return self.cache[token_id]

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if token_id in self.added or not isinstance(piece, str):
            return (piece or "").encode()
        if self.byte_level is not None and all(c in self.byte_level for c in piece):
            return bytes(self.byte_level[c] for c in piece)
        if self.byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        if self.metaspace:
            return piece.replace("▁", " ").encode()
        return self.tokenizer.decode([token_id]).encode()  # a decoder of another kind: its own text
