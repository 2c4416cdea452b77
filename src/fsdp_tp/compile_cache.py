"""A compilation cache that outlives the process: XLA's compiled programs kept on disk, so a
second run of the same programs (a test suite run twice, a CI run after a developer's run of
the same tree, a training job restarted) loads them instead of compiling them again.

It is JAX's own persistent cache (``jax_compilation_cache_dir``), set up with three choices:

- **Where**: ``$FSDP_TP_COMPILE_CACHE`` if set (a directory, or ``off``: no cache, every
  program compiled), else ``$XDG_CACHE_HOME/fsdp_tp/jax`` (``~/.cache/fsdp_tp/jax``). The
  environment variables JAX reads are set too, so the processes this one starts (a CLI run a
  test launches) read and write the same cache.
- **What is kept**: every program, however quick its compile and small its executable (JAX's
  defaults keep only programs that took a second: a test suite compiles thousands of small
  ones).
- **How much**: at most ``max_bytes`` on disk when :func:`enable` returns: the entries used
  longest ago are removed first (:func:`evict`), by the file's last access time where the
  filesystem keeps one (Linux's default ``relatime`` updates it at most once a day after
  the entry's first read, so the order is least recently used to the day), else by when it
  was written. A run adds what it compiles on top until the next :func:`enable`. JAX's own
  bound (``jax_compilation_cache_max_size``) is not used: it needs the ``filelock`` package
  and rescans the whole directory under a lock at every write (thousands of entries, at every
  one of thousands of compiles).

The cache is safe to share: JAX's key hashes the program with its debug information
(source paths and lines) stripped, with the compile options, the XLA flags, the jax and
jaxlib versions and the devices, so a checkout in another folder hits the same entries
(measured: ``tests/test_compile_cache.py`` runs one program from two folders, the second all
hits) and another jax never reads an entry of this one. Where JAX runs on CPU alone
(``JAX_PLATFORMS=cpu``, as the suite does), a cache copied or moved elsewhere is still warm:
JAX names a GPU autotuning cache inside the cache directory in every program's compile options,
and so in its key, unless ``jax_persistent_cache_enable_xla_caches`` says otherwise; with no GPU
there is nothing to autotune, so :func:`enable` turns it off (measured: a copy of a cache 0
hits of 9 with it, 9 of 9 without). Elsewhere the GPU's caches stay, and the path is in the key. An
entry that does not decompress or deserialize (a write cut short, bytes changed) is reported by
JAX as a warning and the program compiled again, never run from it (measured in the test).

>>> cache_dir({"FSDP_TP_COMPILE_CACHE": "off"}) is None
True
>>> str(cache_dir({"XDG_CACHE_HOME": "/var/cache/me"}))
'/var/cache/me/fsdp_tp/jax'
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import jax

__all__ = ["DEFAULT_MAX_BYTES", "ENV", "cache_dir", "enable", "evict"]

ENV = "FSDP_TP_COMPILE_CACHE"
# Measured 2026-12-07: both stacks' runs of the test suite, 308 MB in 12,328 programs (about
# 150 MB a stack); 4 GiB keeps both CI stacks and a developer's older trees many times over.
DEFAULT_MAX_BYTES = 4 << 30


def cache_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """The cache's directory by the environment (``os.environ`` if not given): ``$FSDP_TP_COMPILE_CACHE``
    (``off``: ``None``, no cache), else ``$XDG_CACHE_HOME/fsdp_tp/jax``, else
    ``~/.cache/fsdp_tp/jax``."""
    environ = os.environ if environ is None else environ
    chosen = environ.get(ENV, "").strip()
    if chosen.lower() == "off":
        return None
    if chosen:
        return Path(chosen).expanduser()
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fsdp_tp" / "jax"


def enable(directory: str | os.PathLike | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> Path | None:
    """Compiles through the cache in ``directory`` (default :func:`cache_dir`) from now on, in
    this process and the processes it starts; trims it to ``max_bytes`` first. Returns the
    directory, or ``None`` where ``$FSDP_TP_COMPILE_CACHE`` is ``off`` and no directory is given.
    Call it before the first compile: JAX opens its cache once a process."""
    path = Path(directory).expanduser() if directory is not None else cache_dir()
    if path is None:
        return None
    path.mkdir(parents=True, exist_ok=True)
    evict(path, max_bytes)
    settings: dict[str, object] = {
        "jax_compilation_cache_dir": str(path),
        "jax_persistent_cache_min_compile_time_secs": 0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    if (getattr(jax.config, "jax_platforms", None) or os.environ.get("JAX_PLATFORMS", "")) == "cpu":
        settings["jax_persistent_cache_enable_xla_caches"] = "none"  # (see the module's docstring)
    for name, value in settings.items():
        os.environ[name.upper()] = str(value)  # (for the processes this one starts)
        jax.config.update(name, value)
    return path


def evict(directory: str | os.PathLike, max_bytes: int) -> list[Path]:
    """Removes the cache's entries used longest ago until its files take at most ``max_bytes``;
    returns the removed files. The order is the files' access time, or their write time where
    that is later (a filesystem mounted ``noatime`` never moves the access time).

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> for i, name in enumerate(["old", "mid", "new"]):
    ...     _ = (d / f"{name}-cache").write_bytes(b"x" * 10)
    ...     os.utime(d / f"{name}-cache", (i, i))
    >>> [p.name for p in evict(d, max_bytes=15)]
    ['old-cache', 'mid-cache']
    >>> [p.name for p in d.iterdir()]
    ['new-cache']
    """
    entries = []
    for path in Path(directory).iterdir():
        try:
            stat = path.stat()
        except FileNotFoundError:  # (removed by another process meanwhile)
            continue
        if path.is_file():
            entries.append((max(stat.st_atime, stat.st_mtime), stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    removed = []
    for _, size, path in sorted(entries):
        if total <= max_bytes:
            break
        path.unlink(missing_ok=True)  # (another process may have removed it)
        total -= size
        removed.append(path)
    return removed
