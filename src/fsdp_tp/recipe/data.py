"""Token data for the ``fsdp-tp`` command: an embedded corpus, or a user's file.

The embedded corpus is generated from a small grammar with a fixed seed: text
with structure to learn (words, agreement, punctuation), so the loss falls
visibly within a few hundred steps. Batches are drawn by step index, so a run
resumed at step ``s`` sees the same batches as one that never stopped.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .token_file import DataError, TokenFile

__all__ = [
    "EVAL_FRACTION",
    "Tokens",
    "batch_at",
    "check_tokens",
    "check_vocab",
    "embedded_corpus",
    "load_tokens",
    "packed",
    "split_held_out",
    "token_bounds",
    "vocab_for",
    "windows_at",
]


Tokens = np.ndarray | TokenFile  # the embedded corpus is an array; a user's file is read per batch

EVAL_FRACTION = 0.05  # the tail of the tokens held out when --eval-every is on


_SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher", "her brother"]
_VERBS = ["sees", "likes", "follows", "finds", "watches", "helps", "calls"]
_OBJECTS = ["the ball", "a red fox", "the river", "an apple", "the garden", "a quiet house", "the moon"]
_ENDINGS = [".", " today.", " again.", " at night.", " in the morning."]


def embedded_corpus(num_sentences: int = 20_000, seed: int = 0) -> np.ndarray:
    """Byte tokens (uint8) of generated sentences: ``"The cat sees the river at night. ..."``."""
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(num_sentences):
        sentence = (
            f"{_SUBJECTS[rng.integers(len(_SUBJECTS))]} {_VERBS[rng.integers(len(_VERBS))]} "
            f"{_OBJECTS[rng.integers(len(_OBJECTS))]}{_ENDINGS[rng.integers(len(_ENDINGS))]} "
        )
        parts.append(sentence[0].upper() + sentence[1:])
    return np.frombuffer("".join(parts).encode(), dtype=np.uint8)


def load_tokens(path: str | None) -> Tokens:
    """Tokens from ``path``: ``.npy`` (any int dtype) or ``.bin`` (uint16, nanoGPT-style); any
    other file is UTF-8 text as bytes. A file is read per batch (``TokenFile``), never loaded
    whole or memory-mapped. ``None``: the embedded corpus (an array)."""
    if path is None:
        return embedded_corpus()
    file = Path(path)
    kinds = "a text file, a .npy or a uint16 .bin token file"
    if not file.exists():
        raise DataError(f"--data {path}: no such file; pass {kinds}.")
    if file.is_dir():
        raise DataError(f"--data {path}: is a directory; pass {kinds} in it.")
    if not file.is_file():  # a pipe or a device: read once, never memory-mapped or read again
        raise DataError(f"--data {path}: not a regular file (a pipe or a device); save the data to {kinds}.")
    if file.stat().st_size == 0:
        raise DataError(f"--data {path}: the file is empty.")
    if file.suffix == ".npy":
        try:  # the header only: the tokens are read by TokenFile, batch by batch
            header = np.load(file, mmap_mode="r")
        except (ValueError, OSError, EOFError) as err:
            raise DataError(
                f"--data {path}: not a readable .npy file ({err}); save one with numpy.save."
            ) from err
        if not np.issubdtype(header.dtype, np.integer):
            raise DataError(
                f"--data {path}: tokens must be integers, got dtype {header.dtype}; "
                f"convert with tokens.astype(np.int32) (ids are not rounded for you)."
            )
        if header.ndim != 1:
            raise DataError(f"--data {path}: tokens must be a flat array, got shape {header.shape}.")
        tokens = TokenFile.open(str(file), header.dtype, header.offset)
    elif file.suffix == ".bin":
        if file.stat().st_size % 2:
            raise DataError(
                f"--data {path}: {file.stat().st_size} bytes is not a whole number of uint16 tokens "
                f"(2 bytes each); the file is truncated or not a nanoGPT-style .bin."
            )
        tokens = TokenFile.open(str(file), np.uint16)
    else:  # text: its bytes are the tokens, read per batch (a 40 GB file is not read into memory)
        tokens = TokenFile.open(str(file), np.uint8)
    if len(tokens) == 0:
        raise DataError(f"--data {path}: holds no tokens (an empty array).")
    return tokens


def check_tokens(tokens: Tokens, seq_len: int, what: str = "the data") -> None:
    """Raises ``DataError`` unless ``tokens`` hold two windows of ``seq_len + 1`` tokens
    (checked up front, so a bad file fails before anything is written)."""
    if len(tokens) < 2 * (seq_len + 1):
        raise DataError(
            f"{what} has {len(tokens)} tokens, fewer than two windows of seq_len + 1 = {seq_len + 1}; "
            f"use more data or a shorter --seq-len."
        )


MAX_TOKEN = 2**31 - 1  # token ids are int32 in the step


def check_vocab(low: int, top: int, vocab: int, what: str = "the data") -> None:
    """Raises ``DataError`` when the token ids ``low .. top`` are not all in the vocabulary."""
    if low < 0:
        raise DataError(f"{what} holds token {low}; token ids must be >= 0.")
    if top > MAX_TOKEN:
        raise DataError(
            f"{what} holds token {top}; the model reads ids as int32, at most {MAX_TOKEN}: map the "
            f"ids to 0 .. vocabulary - 1 first."
        )
    if top >= vocab:
        raise DataError(
            f"{what} holds token {top}, outside the model's vocabulary of {vocab}; "
            f"pass --vocab-size {vocab_for(top)} or more."
        )


def vocab_for(top_token: int, multiple: int = 128) -> int:
    """The smallest vocabulary above ``top_token`` that is a multiple of ``multiple`` (so any
    tensor axis up to it divides the vocab-parallel embedding and head)."""
    return -(-(top_token + 1) // multiple) * multiple


def split_held_out(tokens: Tokens, fraction: float) -> tuple[Tokens, Tokens]:
    """``tokens`` cut into a train part and the last ``fraction`` held out for eval."""
    cut = len(tokens) - int(len(tokens) * fraction)
    if isinstance(tokens, TokenFile):  # views: nothing is read until a batch asks
        return tokens.part(0, cut), tokens.part(cut, len(tokens))
    return tokens[:cut], tokens[cut:]


def token_bounds(tokens: Tokens) -> tuple[int, int]:
    """The smallest and largest token id, in one pass over a file of any size."""
    if isinstance(tokens, TokenFile):
        return tokens.bounds()
    return int(np.min(tokens)), int(np.max(tokens))


def windows_at(
    tokens: Tokens, step: int, batch: int, seq_len: int, seed: int, rows: slice = slice(None)
) -> np.ndarray:
    """Rows ``rows`` of step ``step``'s global batch: windows of ``seq_len + 1`` tokens (int32).

    The window starts depend only on ``(seed, step)``, so every process, mesh and resumed
    run agrees on the batch; only the requested rows are read from the file.
    """
    starts = np.random.default_rng([seed, step]).integers(0, len(tokens) - seq_len - 1, size=batch)
    return np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int32) for s in starts[rows]])


def packed(windows, eos: int) -> tuple:
    """``windows`` ``(rows, seq_len + 1)`` as packed documents, each ended by the token ``eos``:
    ``(inputs, targets, segments, weights)``. ``segments``: each input's document in its window
    (1, 2, ...: the token after an ``eos`` starts the next); ``weights``: 0 where the target is
    the next document's first token (the input an ``eos``), else 1.

    >>> inputs, targets, segments, weights = packed(np.array([[5, 46, 7, 8, 46, 9]]), 46)
    >>> segments.tolist(), weights.tolist()
    ([[1, 1, 2, 2, 2]], [[1.0, 0.0, 1.0, 1.0, 0.0]])
    """
    inputs, targets = windows[:, :-1], windows[:, 1:]
    ends = (inputs == eos).astype(np.int32)
    segments = 1 + ends.cumsum(axis=1) - ends
    return inputs, targets, segments, (1 - ends).astype(np.float32)


def batch_at(tokens: Tokens, step: int, batch: int, seq_len: int, seed: int) -> tuple:
    """The whole global batch of ``step`` as ``(ids, targets)``, targets shifted by one."""
    windows = windows_at(tokens, step, batch, seq_len, seed)
    return windows[:, :-1], windows[:, 1:]
