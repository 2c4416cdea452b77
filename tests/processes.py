"""Two ``fsdp-tp`` processes of one run on this machine (gloo over 127.0.0.1, 4 CPU devices
each): what the multi-process tests start."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys

__all__ = ["MESH", "command", "free_port", "start_two_processes", "two_processes"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command() -> list[str]:
    script = shutil.which("fsdp-tp")
    return [script] if script else [sys.executable, "-m", "fsdp_tp"]


MESH = "data=2,fsdp=2,tensor=2"


def start_two_processes(argv, port: int, stdout=subprocess.PIPE) -> list:
    """``fsdp-tp`` started as processes 0 and 1 of one run, 4 CPU devices each; ``argv(i)``
    gives process i's own flags. Their stderr is piped (text)."""
    return [
        subprocess.Popen(
            [
                *command(),
                *argv(i),
                *("--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)),
                *("--cpu-devices", "4"),
            ],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]


def two_processes(argv, port: int, timeout: int) -> tuple[list, list[tuple[str, str]]]:
    """:func:`start_two_processes`, run to their end: the processes and their ``(stdout, stderr)``."""
    procs = start_two_processes(argv, port)
    return procs, [p.communicate(timeout=timeout) for p in procs]
