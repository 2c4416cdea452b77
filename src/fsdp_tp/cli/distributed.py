"""Joining a multi-process run through JAX's own distributed runtime.

Every process runs the same ``fsdp-tp train`` command with its own ``--process-id``
(or the environment variables below); process 0's address is the coordinator.
Two local processes on CPU (gloo collectives):

    fsdp-tp train --coordinator 127.0.0.1:9911 --num-processes 2 --process-id 0 --cpu-devices 4 &
    fsdp-tp train --coordinator 127.0.0.1:9911 --num-processes 2 --process-id 1 --cpu-devices 4

Under SLURM or Open MPI, ``--distributed`` alone lets JAX read the cluster's variables.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from dataclasses import dataclass

import jax

from .stdout_filter import drop_stdout_lines

__all__ = [
    "DistributedError",
    "Process",
    "coordination_client",
    "join",
    "parse_address",
    "requested",
    "this_process",
]

ENV = {
    "coordinator": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}


class DistributedError(ValueError):
    """Multi-process flags that do not form a complete set."""


def _options(coordinator: str | None, num_processes: int | None, process_id: int | None) -> dict:
    """The flags, each falling back to its environment variable."""
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    for key, var in ENV.items():
        if given[key] is None and os.environ.get(var):
            value = os.environ[var]
            if key != "coordinator" and not value.strip().isdigit():
                raise DistributedError(
                    f"{var}={value!r} is not a whole number; set it to the {_MEANING[key]}."
                )
            given[key] = value if key == "coordinator" else int(value)
    return given


_MEANING = {"num_processes": "number of processes", "process_id": "process's index, 0 .. processes - 1"}


def parse_address(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (``"[::1]:PORT"`` for IPv6) as ``(host, port)``, or ``DistributedError``.

    >>> parse_address("127.0.0.1:9911"), parse_address("[::1]:80")
    (('127.0.0.1', 9911), ('::1', 80))
    """
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(
            f"--coordinator {text!r} is not HOST:PORT; write e.g. 127.0.0.1:9911 (a port 1..65535)."
        )
    return host, int(port)


def _bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _wait_for(host: str, port: int, timeout: float) -> None:
    """Waits until the coordinator accepts connections. JAX itself would abort the process with a
    C++ stack trace after its timeout; this says what is wrong instead."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"could not reach the coordinator at {_bind_address(host, port)} within {timeout:g} s "
                    f"({err.strerror or err}); start process 0 first, check --coordinator, or raise "
                    f"--coordinator-timeout."
                ) from None
            time.sleep(0.25)


def requested(coordinator: str | None, num_processes: int | None, process_id: int | None, auto: bool) -> int:
    """How many processes the flags (or environment) ask for: 1 when none are set.

    Raises ``DistributedError`` for an incomplete set, naming what is missing.
    """
    options = _options(coordinator, num_processes, process_id)
    if auto:
        return -1  # the cluster decides (SLURM, Open MPI); known after join
    if all(v is None for v in options.values()):
        return 1
    missing = [f"--{k.replace('_', '-')} (or {ENV[k]})" for k, v in options.items() if v is None]
    if missing:
        raise DistributedError(
            f"a multi-process run needs {', '.join(missing)} as well; or pass --distributed on SLURM."
        )
    parse_address(options["coordinator"])
    if not 0 <= options["process_id"] < options["num_processes"]:
        raise DistributedError(
            f"--process-id {options['process_id']} is outside 0 .. {options['num_processes'] - 1} "
            f"(--num-processes {options['num_processes']})."
        )
    return options["num_processes"]


@dataclass(frozen=True)
class Process:
    """This process's index and the run's process count; ``None`` where the cluster decides."""

    process: int | None
    processes: int | None


def this_process(
    coordinator: str | None, num_processes: int | None, process_id: int | None, auto: bool
) -> Process:
    """Which process of how many the flags (or environment) make this one: ``Process(0, 1)``
    alone. Raises ``DistributedError`` as :func:`requested` does.

    >>> this_process("127.0.0.1:9911", 2, 1, False)
    Process(process=1, processes=2)
    """
    if auto:
        return Process(None, None)
    processes = requested(coordinator, num_processes, process_id, auto)
    if processes == 1:
        return Process(0, 1)
    return Process(_options(coordinator, num_processes, process_id)["process_id"], processes)


def _check_listenable(host: str, port: int) -> None:
    """Process 0 is about to serve the coordinator on ``host:port``: refuses an address this
    machine does not have, and a port another program listens on (a second process 0, whose
    service would take the first's place, each then aborting after minutes)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds it
            probe.bind((host, port))
    except OSError as err:
        address = _bind_address(host, port)
        if err.errno == errno.EADDRINUSE:
            why = (
                "something on this machine listens there already: another run's process 0, or this "
                "run's if two processes got --process-id 0; pick a free port, or give each process "
                "its own --process-id."
            )
        else:
            why = (
                f"process 0 serves the coordinator, so HOST must be an address of its own machine "
                f"({err.strerror or err}); start process 0 on {host}, or name this machine's address."
            )
        raise DistributedError(f"--coordinator {address}: process 0 cannot listen there: {why}") from None


def join(
    coordinator: str | None,
    num_processes: int | None,
    process_id: int | None,
    auto: bool,
    timeout: int = 300,
    peer_timeout: int = 100,
) -> None:
    """``jax.distributed.initialize`` with the flags (or environment); call before any JAX work.

    Process 0's coordination service listens on the coordinator's host only (JAX's default is
    every interface, and the service has no authentication): loopback stays loopback. The
    other processes wait up to ``timeout`` seconds for it, then raise ``DistributedError``.
    A process that sends no heartbeat for ``peer_timeout`` seconds is taken for lost, and the
    service ends the others (``supervise.py`` says so in one line).
    CPU devices talk over gloo (the default CPU collectives would reject a computation that
    spans processes); the lines gloo prints on connecting are kept out of the output.
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    drop_stdout_lines()
    if auto:
        try:
            jax.distributed.initialize(initialization_timeout=timeout, heartbeat_timeout_seconds=peer_timeout)
        except ValueError as err:  # no cluster JAX knows: 'coordinator_address should be defined.'
            raise DistributedError(
                f"--distributed found no cluster to join ({err}): JAX reads SLURM's, Open MPI's or a "
                f"Cloud TPU's variables, and none is set here. Run on the cluster's nodes, or name the "
                f"run yourself: --coordinator HOST:PORT --num-processes N --process-id I."
            ) from None
        return
    options = _options(coordinator, num_processes, process_id)
    host, port = parse_address(options["coordinator"])
    if options["process_id"] == 0:
        _check_listenable(host, port)
    else:
        _wait_for(host, port, timeout)
    jax.distributed.initialize(
        options["coordinator"],
        options["num_processes"],
        options["process_id"],
        initialization_timeout=timeout,
        heartbeat_timeout_seconds=peer_timeout,
        coordinator_bind_address=_bind_address(host, port) if options["process_id"] == 0 else None,
    )


def coordination_client():
    """The coordination service's client (its key-value store and barriers) in a multi-process
    run; ``None`` alone. JAX has no public handle for it."""
    from jax._src import distributed

    client = distributed.global_state.client
    return client if client is not None and jax.process_count() > 1 else None
