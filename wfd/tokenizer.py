"""Tokenizers: bytes for the tiny models, the `tokenizers` library for a checkpoint's
tokenizer.json, and none (token ids in, token ids out) for a folder without one."""

from __future__ import annotations

import json
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

        from .checkpoint import CheckpointError

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for a file it cannot read
            raise CheckpointError(f"{path} is not a tokenizer file ({exc})") from None

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


def byte_alphabet() -> list[str]:
    """A printable character for each byte value, as byte-level BPE tokenizers write bytes:
    the printable Latin-1 characters stand for themselves, every other byte for a character
    past U+00FF, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_byte_tokenizer(folder: Path, max_length: int) -> None:
    """A tokenizer.json (and tokenizer_config.json) whose token ids are a text's UTF-8 bytes,
    the tiny models' vocabulary: for engines that read text through a tokenizer file (vLLM)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in enumerate(byte_alphabet())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
