"""Token data for the ``fsdp-tp`` command: an embedded corpus, or a user's file.

The embedded corpus is generated from a small grammar with a fixed seed: text
with structure to learn (words, agreement, punctuation), so the loss falls
visibly within a few hundred steps. Batches are drawn by step index, so a run
resumed at step ``s`` sees the same batches as one that never stopped.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

__all__ = [
    "EVAL_FRACTION",
    "DataChangedError",
    "DataError",
    "batch_at",
    "check_tokens",
    "check_vocab",
    "embedded_corpus",
    "load_tokens",
    "split_held_out",
    "vocab_for",
    "windows_at",
]


EVAL_FRACTION = 0.05  # the tail of the tokens held out when --eval-every is on


class DataError(ValueError):
    """A data file that is missing, empty, or too short for one batch."""


class DataChangedError(DataError):
    """The memory-mapped data file was truncated or rewritten in place while a run read it."""


# Each memory-mapped file's (inode, size, mtime) when it was opened. Reading a mapping whose file
# was truncated in place kills the process with SIGBUS, and Python cannot catch that: every
# batch first checks the file is as it was. A file replaced (renamed over) or deleted is not
# a change to the mapping, which keeps reading the old inode.
_OPENED: dict[str, tuple[int, int, int]] = {}


def _stamp(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


def _check_unchanged(tokens: np.ndarray) -> None:
    """Raises ``DataChangedError`` if the file ``tokens`` map was changed in place since it was
    opened (a truncation would otherwise end the process with SIGBUS at the next read)."""
    name = getattr(tokens, "filename", None)
    if name is None or name not in _OPENED:
        return
    try:
        now = _stamp(name)
    except FileNotFoundError:
        return  # deleted: the mapping still holds the data
    inode, size, _ = was = _OPENED[name]
    if now[0] == inode and now != was:
        raise DataChangedError(
            f"--data {name} was changed while the run read it ({size:,} bytes when opened, "
            f"{now[1]:,} now); give a run a file nobody writes: write new data to another file."
        )


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


def load_tokens(path: str | None) -> np.ndarray:
    """Tokens from ``path``: ``.npy`` (any int dtype) or ``.bin`` (uint16, nanoGPT-style), both
    memory-mapped; any other file is UTF-8 text as bytes. ``None``: the embedded corpus."""
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
        try:
            tokens = np.load(file, mmap_mode="r")
        except (ValueError, OSError, EOFError) as err:
            raise DataError(
                f"--data {path}: not a readable .npy file ({err}); save one with numpy.save."
            ) from err
        if not np.issubdtype(tokens.dtype, np.integer):
            raise DataError(
                f"--data {path}: tokens must be integers, got dtype {tokens.dtype}; "
                f"convert with tokens.astype(np.int32) (ids are not rounded for you)."
            )
    elif file.suffix == ".bin":
        if file.stat().st_size % 2:
            raise DataError(
                f"--data {path}: {file.stat().st_size} bytes is not a whole number of uint16 tokens "
                f"(2 bytes each); the file is truncated or not a nanoGPT-style .bin."
            )
        tokens = np.memmap(file, dtype=np.uint16, mode="r")
    else:  # text: its bytes are the tokens, memory-mapped (a 40 GB file is not read into memory)
        tokens = np.memmap(file, dtype=np.uint8, mode="r")
    if tokens.ndim != 1:
        raise DataError(f"--data {path}: tokens must be a flat array, got shape {tokens.shape}.")
    _OPENED[tokens.filename] = _stamp(tokens.filename)
    if tokens.size == 0:
        raise DataError(f"--data {path}: holds no tokens (an empty array).")
    return tokens


def check_tokens(tokens: np.ndarray, seq_len: int, what: str = "the data") -> None:
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


def split_held_out(tokens: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """``tokens`` cut into a train part and the last ``fraction`` held out for eval."""
    cut = len(tokens) - int(len(tokens) * fraction)
    return tokens[:cut], tokens[cut:]


def windows_at(
    tokens: np.ndarray, step: int, batch: int, seq_len: int, seed: int, rows: slice = slice(None)
) -> np.ndarray:
    """Rows ``rows`` of step ``step``'s global batch: windows of ``seq_len + 1`` tokens (int32).

    The window starts depend only on ``(seed, step)``, so every process, mesh and resumed
    run agrees on the batch; only the requested rows are read from the (memory-mapped) file.
    """
    _check_unchanged(tokens)
    starts = np.random.default_rng([seed, step]).integers(0, len(tokens) - seq_len - 1, size=batch)
    return np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int32) for s in starts[rows]])


def batch_at(tokens: np.ndarray, step: int, batch: int, seq_len: int, seed: int) -> tuple:
    """The whole global batch of ``step`` as ``(ids, targets)``, targets shifted by one."""
    windows = windows_at(tokens, step, batch, seq_len, seed)
    return windows[:, :-1], windows[:, 1:]
