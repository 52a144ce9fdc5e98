"""Token id -> the bytes it stands for, as OpenAI's logprob `bytes` report them (serve/protocol.py's
TokenText.bytes): read from the tokenizer's vocabulary and decoder, not from a decode of the
token alone, which turns half a UTF-8 character into U+FFFD.
"""
from __future__ import annotations

import json


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
