"""Joining a multi-process run through JAX's own distributed runtime.

Every process runs the same ``fsdp-tp train`` command with its own ``--process-id``
(or the environment variables below); process 0's address is the coordinator.
Two local processes on CPU (gloo collectives):

    fsdp-tp train --coordinator 127.0.0.1:9911 --num-processes 2 --process-id 0 --cpu-devices 4 &
    fsdp-tp train --coordinator 127.0.0.1:9911 --num-processes 2 --process-id 1 --cpu-devices 4

Under SLURM or Open MPI, ``--distributed`` alone lets JAX read the cluster's variables.
"""

from __future__ import annotations

import os

import jax

__all__ = ["DistributedError", "join", "requested"]

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
            given[key] = value if key == "coordinator" else int(value)
    return given


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
    if not 0 <= options["process_id"] < options["num_processes"]:
        raise DistributedError(
            f"--process-id {options['process_id']} is outside 0 .. {options['num_processes'] - 1} "
            f"(--num-processes {options['num_processes']})."
        )
    return options["num_processes"]


def join(coordinator: str | None, num_processes: int | None, process_id: int | None, auto: bool) -> None:
    """``jax.distributed.initialize`` with the flags (or environment); call before any JAX work.

    CPU devices talk over gloo (the default CPU collectives would reject a
    computation that spans processes).
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if auto:
        jax.distributed.initialize()
        return
    options = _options(coordinator, num_processes, process_id)
    jax.distributed.initialize(options["coordinator"], options["num_processes"], options["process_id"])
