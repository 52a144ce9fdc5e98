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
