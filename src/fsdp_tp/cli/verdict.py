"""What ended one process of a multi-process run, read from the native log it left: one line.

When a process of a run is lost, JAX's coordination service ends every other process with a
C++ abort; what it wrote to stderr says why. :func:`verdict` turns that into the line the
user reads, with the step ``--resume`` continues from:

>>> text = ("F1125 02:37:00.944848 9392 client.h:80] Terminating process because the JAX "
...         "distributed service detected fatal errors. absl::Status: UNAVAILABLE: The following "
...         "tasks are unhealthy (stopped sending heartbeats):\\n1\\nThe tasks have crashed.")
>>> ended = verdict(-6, text, Identity(process=0, processes=2, peer_timeout=30), "ckpt", [10, 20])
>>> ended.code, ended.line
(1, 'process 1 of 2 stopped answering for --peer-timeout 30 s (it died, was killed, or lost \
its network), so this process (0) stopped too; the last checkpoint is ckpt/20: start every \
process again with --resume to continue from it.')
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

__all__ = ["DELIBERATE", "Ended", "Identity", "lost_processes", "verdict"]

DELIBERATE = "fsdp-tp: this process printed why it ends, with exit status"
"""What a supervised child writes to its native log once it has said why it ends."""
_DELIBERATE = re.compile(re.escape(DELIBERATE) + r" (\d+)")

# The coordination service's words, from XLA's coordination_service*.cc and client.h.
_UNHEALTHY = re.compile(r"unhealthy \(stopped sending heartbeats\):\s*((?:\d+\s*)+)")
_HEARTBEAT = re.compile(r"Task (\d+) heartbeat timeout")
_LEADER_GONE = "Failed to send RPC to coordination service"
_SAME_ID = "newer incarnation"
_NOT_JOINED = re.compile(r"DEADLINE_EXCEEDED[\s\S]*RegisterTask")
# How the process itself ends when the service aborts it (LOG(FATAL): SIGABRT).
_ABORTED = -int(signal.SIGABRT)


@dataclass(frozen=True)
class Identity:
    """Which process this is, of how many (``None`` where a cluster decides), and the flags
    its line names."""

    process: int | None
    processes: int | None
    peer_timeout: int
    coordinator_timeout: int = 300


@dataclass(frozen=True)
class Ended:
    """The exit status to return and the line to print (``None``: the child's own output said it)."""

    code: int
    line: str | None = None


def lost_processes(native: str) -> list[int]:
    """The processes the coordination service found dead, in the order it named them."""
    found = [int(n) for m in _UNHEALTHY.finditer(native) for n in m.group(1).split()]
    found += [int(n) for n in _HEARTBEAT.findall(native)]
    return list(dict.fromkeys(found))


def _resume(checkpoint_dir: str | None, steps: list[int]) -> str:
    if checkpoint_dir is None:
        return "no checkpoint was kept (no --checkpoint-dir): start every process again."
    if not steps:
        return f"no checkpoint was saved in {checkpoint_dir} yet: start every process again."
    return (
        f"the last checkpoint is {checkpoint_dir}/{steps[-1]}: start every process again with "
        "--resume to continue from it."
    )


def _this(who: Identity) -> str:
    return "this process" if who.process is None else f"this process ({who.process})"


def _of(who: Identity) -> str:
    return f" of {who.processes}" if who.processes else ""


def verdict(code: int, native: str, who: Identity, checkpoint_dir: str | None, steps: list[int]) -> Ended:
    """How the child ended (``code``: its exit status, negative for a signal), given what it
    wrote to its native stderr; ``steps``: the checkpoints in ``checkpoint_dir`` now.

    A child that ended on its own (0, 2, 130, 143, or 1 with nothing from the coordination
    service) has said what it had to: its code passes through, as does a negative one no
    pattern explains (the caller shows the native log then)."""
    if code in (0, 2, 130, 143):
        return Ended(code)
    if said := _DELIBERATE.search(native):  # it said why; whatever aborted it afterwards
        return Ended(int(said.group(1)))
    resume = _resume(checkpoint_dir, steps)
    if _SAME_ID in native:
        ids = f" (0 .. {who.processes - 1})" if who.processes else ""
        return Ended(
            2,
            f"another process joined the run as process {who.process} too; give each its own "
            f"--process-id{ids}.",
        )
    if _NOT_JOINED.search(native):
        return Ended(
            2,
            f"not {f'all {who.processes} processes' if who.processes else 'every process'} joined within "
            f"--coordinator-timeout {who.coordinator_timeout} s; start each with the same --coordinator "
            "and --num-processes and its own --process-id.",
        )
    if lost := [p for p in lost_processes(native) if p != who.process]:
        names = ", ".join(map(str, lost))
        return Ended(
            1,
            f"process{'es' if len(lost) > 1 else ''} {names}{_of(who)} stopped answering for --peer-timeout "
            f"{who.peer_timeout} s (it died, was killed, or lost its network), so {_this(who)} stopped too; "
            + resume,
        )
    if _LEADER_GONE in native:
        return Ended(
            1,
            f"lost process 0{_of(who)}, which runs the coordinator (it died, was killed, or lost its "
            f"network), so {_this(who)} stopped too; " + resume,
        )
    if code < 0 and code != _ABORTED:
        name = signal.Signals(-code).name
        return Ended(128 - code, f"{_this(who)}{_of(who)} was killed by {name}; " + resume)
    return Ended(code)
