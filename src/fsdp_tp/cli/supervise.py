"""Each process of a multi-process ``fsdp-tp train`` trains in a child of a small parent that
says how it ended (the flags that make a run multi-process: :func:`add_process_flags`).

When one process of a run dies, JAX's coordination service ends every other one with a C++
abort: a check-failure stack on stderr and SIGABRT, once the lost process has missed
heartbeats for ``--peer-timeout`` seconds (JAX's default is 100), or at once when the lost
one is process 0, which runs the service. Nothing inside the process can catch that abort:
jaxlib's ``missed_heartbeat_callback`` cannot hand its status to Python (it aborts with
``std::bad_cast``). So the parent runs the training as ``python -m fsdp_tp`` with the same
arguments, and:

- the child's Python output (progress, the one-line errors, warnings) reaches the terminal
  as before; what native code writes to its stderr (XLA, gloo, the coordination service)
  comes to the parent through a pipe, passed on with ``--verbose``;
- when the child ends, :func:`verdict.verdict` reads that log and the parent prints one line
  naming the lost process and the checkpoint ``--resume`` continues from;
- SIGINT and SIGTERM sent to the parent are passed to the child, which stops between steps
  (a copy the child also got straight from the terminal or a scheduler counts once); the
  child ends within a second if the parent is killed.

The parent never imports more than the CLI: it makes no devices and holds no JAX state.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from contextlib import redirect_stderr, redirect_stdout

from .distributed import DistributedError, this_process
from .verdict import DELIBERATE, Identity, verdict
from .workdir import saved_steps

__all__ = [
    "CHILD",
    "PEER_TIMEOUT",
    "add_process_flags",
    "adopt",
    "ended_deliberately",
    "supervisable",
    "supervise",
    "wait_for_verdict",
]

PEER_TIMEOUT = 30  # s; heartbeats come from a thread of their own, so compiling never delays them
CHILD = "FSDP_TP_NATIVE_STDERR"  # set in the child: the pipe its native stderr goes to
_KEPT = 256 * 1024  # the native log's last bytes, read when the child ends
_FORWARDED = (signal.SIGINT, signal.SIGTERM)
# A collective that failed because a peer went away (gloo: "Connection closed by peer").
_PEER_WORDS = re.compile(r"gloo|nccl|connection|peer|socket", re.IGNORECASE)
_adopted = False


def supervisable(argv: list[str], parse) -> object | None:
    """The parsed flags when ``argv`` asks for a multi-process ``train``; ``None`` otherwise
    (or for flags ``main`` will refuse: it says why)."""
    if any(a in ("-h", "--help") for a in argv):
        return None
    try:
        with redirect_stderr(io.StringIO()), redirect_stdout(io.StringIO()):
            args = parse(argv)
        if args.command != "train":
            return None
        who = this_process(args.coordinator, args.num_processes, args.process_id, args.distributed)
    except (SystemExit, DistributedError):
        return None
    return args if who.processes != 1 else None


def _identity(args) -> Identity:
    who = this_process(args.coordinator, args.num_processes, args.process_id, args.distributed)
    return Identity(who.process, who.processes, args.peer_timeout, args.coordinator_timeout)


class _NativeLog(threading.Thread):
    """Reads the child's native stderr to its end, keeping the last bytes (and echoing all of
    it to our stderr when asked)."""

    def __init__(self, fd: int, echo: bool):
        super().__init__(daemon=True)
        self.fd, self.echo = fd, echo
        self.kept = bytearray()

    def run(self) -> None:
        with os.fdopen(self.fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                self.kept += chunk
                del self.kept[:-_KEPT]
                if self.echo:
                    sys.stderr.buffer.write(chunk)
                    sys.stderr.flush()

    def text(self) -> str:
        return bytes(self.kept).decode(errors="replace")


def supervise(argv: list[str], args) -> int:
    """Runs ``fsdp-tp`` with ``argv`` in a child process and returns its exit status, after one
    line on stderr where the child was ended from outside (a lost process, a signal)."""
    read, write = os.pipe()
    env = {**os.environ, CHILD: str(write)}
    child = subprocess.Popen([sys.executable, "-m", "fsdp_tp", *argv], env=env, pass_fds=(write,))
    os.close(write)
    log = _NativeLog(read, echo=args.verbose)
    log.start()
    previous = {s: signal.signal(s, lambda signum, _: child.send_signal(signum)) for s in _FORWARDED}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    log.join(timeout=10)
    steps = saved_steps(args.checkpoint_dir) if args.checkpoint_dir else []
    ended = verdict(code, log.text(), _identity(args), args.checkpoint_dir, steps)
    if ended.line is not None:
        print(f"fsdp-tp: error: {ended.line}", file=sys.stderr)
    elif ended.code < 0 or ended.code not in (0, 1, 2, 130, 143):
        sys.stderr.write(log.text()[-4000:])  # unexplained: what native code said is all there is
    return ended.code if ended.code >= 0 else 128 - ended.code


def _orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)  # the parent was killed: this process goes with it, as one process would


def adopt() -> bool:
    """In a supervised child: native stderr to the parent's pipe, Python's ``sys.stderr`` kept
    on the terminal, and an end when the parent goes; ``True``. Anywhere else: ``False``."""
    global _adopted
    given = os.environ.pop(CHILD, None)
    if given is None:
        return False
    fd = _pipe(given)
    _adopted = True
    sys.stderr.flush()
    terminal = os.dup(2)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = open(terminal, "w", buffering=1, errors="backslashreplace")
    threading.Thread(target=_orphaned, args=(os.getppid(),), daemon=True).start()
    return True


def _pipe(given: str) -> int:
    """The pipe ``CHILD`` names, as the parent made it; exits 2 with one line where it names
    none (the variable set by hand, or inherited from another run)."""
    try:
        fd = int(given)
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            return fd
    except (ValueError, OSError):
        pass
    print(
        f"fsdp-tp: error: {CHILD}={given!r} names no pipe of this process: fsdp-tp sets it only in the "
        f"child of a multi-process run, for its native stderr; unset it (env -u {CHILD} fsdp-tp ...).",
        file=sys.stderr,
    )
    sys.exit(2)


def ended_deliberately(code: int) -> None:
    """In a supervised child that has printed why it ends with ``code``: says so in the native
    log, so the parent returns ``code`` even if the coordination service, going away first,
    aborts this process before it exits (:func:`verdict.verdict`)."""
    if _adopted:
        os.write(2, f"\n{DELIBERATE} {code}\n".encode())


def wait_for_verdict(error: Exception, peer_timeout: int) -> None:
    """In a supervised child whose collective failed as when a peer goes away: waits for the
    coordination service, which ends this process within ``peer_timeout`` seconds if a process
    was lost (the parent then names it), and returns if none was, to let ``error`` show."""
    if _adopted and _PEER_WORDS.search(str(error)):
        time.sleep(peer_timeout + 10)


def add_process_flags(train: argparse.ArgumentParser) -> None:
    """``train``'s flags for joining a multi-process run (each also read from the environment)."""
    hosts = train.add_argument_group(
        "multi-process (also JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)"
    )
    hosts.add_argument("--coordinator", help="process 0's HOST:PORT; process 0 listens on HOST only")
    hosts.add_argument("--num-processes", type=int, help="processes in the run")
    hosts.add_argument("--process-id", type=int, help="this process's index, 0 .. num-processes - 1")
    hosts.add_argument(
        "--coordinator-timeout", type=int, default=300, help="seconds to wait for the other processes"
    )
    hosts.add_argument(
        "--peer-timeout",
        type=int,
        default=PEER_TIMEOUT,
        help="seconds without a heartbeat after which a process is taken for lost: every other one "
        "then stops, with one line naming it and the checkpoint to --resume from",
    )
    hosts.add_argument(
        "--distributed", action="store_true", help="let JAX detect the cluster (SLURM, Open MPI)"
    )
