"""A byte-level tokenizer built in, so the default model needs no download.

Ids 0-255 are raw UTF-8 bytes; then PAD, BOS and EOS.

Example:
    >>> tok = ByteTokenizer()
    >>> tok.decode(tok.encode("12+3="))
    '12+3='
"""

from __future__ import annotations

from typing import Any, Protocol


class Tokenizer(Protocol):
    pad_id: int
    eos_id: int
    bos_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    pad_id = 256
    bos_id: int | None = 257
    eos_id = 258
    vocab_size = 260  # 259 used, rounded up to an even size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """Adapter over a tokenizer loaded from a local model directory."""

    def __init__(self, tok: Any):
        self._tok = tok
        self.eos_id = int(tok.eos_token_id)
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        self.bos_id = int(tok.bos_token_id) if tok.bos_token_id is not None else None
        self.vocab_size = len(tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))
