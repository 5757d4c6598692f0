"""Tokenizers: bytes for the tiny models, the `tokenizers` library for a checkpoint's
tokenizer.json, and none (token ids in, token ids out) for a folder without one."""

from __future__ import annotations

from pathlib import Path


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255."""

    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class FileTokenizer:
    """A tokenizer.json read by the `tokenizers` library (no code from the folder is run)."""

    name = "tokenizer.json"

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def tokenizer_for(folder: Path | None, vocab_size: int):
    """The folder's tokenizer.json; else bytes when the vocabulary is bytes; else None."""
    if folder is not None and (folder / "tokenizer.json").is_file():
        return FileTokenizer(folder / "tokenizer.json")
    if vocab_size == 256:
        return ByteTokenizer()
    return None
