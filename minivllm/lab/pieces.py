"""Token pieces as text, honest about characters split across tokens.

A byte-level BPE tokenizer (GPT-2's, SmolLM2's, Qwen's) often splits one Chinese character's
three UTF-8 bytes over two or three tokens; decoding such a token alone gives "\ufffd". Here
each token shows what it really adds: the characters it completes (joined with the bytes that
earlier tokens left open) and, for bytes still open at its end, `<0xE4>`-style hex.

Pure Python: no torch here.
"""

from __future__ import annotations

import codecs
import re
from functools import cache, lru_cache
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte-fallback tokens


@cache
def _byte_decoder() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable-character table (GPT-2's)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def hex_bytes(data: bytes) -> str:
    return "".join(f"<0x{b:02X}>" for b in data)


class TokenPieces:
    """Per-token text pieces and whole texts for one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._bytes = lru_cache(maxsize=4096)(self._token_bytes)

    def _token_bytes(self, token_id: int) -> bytes | None:
        """The token's raw bytes, or None when the tokenizer is not byte-level."""
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(token, str):
            return None
        byte = _BYTE_TOKEN.fullmatch(token)
        if byte:
            return bytes([int(byte.group(1), 16)])
        table = _byte_decoder()
        if token and all(c in table for c in token):
            return bytes(table[c] for c in token)
        return None

    def pieces(self, token_ids: list[int]) -> list[str]:
        """One display piece per token (see the module docstring)."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        out = []
        for token_id in token_ids:
            raw = self._bytes(token_id)
            if raw is None:
                decoder.reset()
                out.append(self.tokenizer.decode([token_id]))
                continue
            text = decoder.decode(raw)
            open_bytes = decoder.getstate()[0]  # the start of a character a later token ends
            out.append(text + hex_bytes(open_bytes[-len(raw) :]))  # only this token's own
        return out

    def text(self, token_ids: list[int]) -> str:
        """The decoded text, without a trailing "\ufffd" for a character still incomplete."""
        text = self.tokenizer.decode(token_ids)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        raws = [self._bytes(t) for t in token_ids[-4:]]  # a UTF-8 character has <= 4 bytes
        if all(r is not None for r in raws):
            for raw in raws:
                decoder.decode(raw)
            if decoder.getstate()[0] and text.endswith("\ufffd"):
                return text.rstrip("\ufffd")
        return text
