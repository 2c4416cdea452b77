"""Every process of a run trains the same run, or every process says why not.

Each process of a multi-process run is started by hand (or by a launcher) with its own
command line; one flag typed differently on one process used to train a model neither
setting would give (``--lr``), or hang (``--steps``, ``--mesh``). Before any device work, each
process compares its settings with process 0's through the coordination service's key-value
store (no device computation, so mismatched meshes or device counts cannot hang it), and
every process ends with the same one line naming each difference.
"""

from __future__ import annotations

import json
from importlib import metadata

import jax

from .checks import UsageError
from .distributed import coordination_client
from .supervise import ended_deliberately

__all__ = ["DisagreementError", "check_agreement", "differences", "run_settings"]

# Flags a process may set for itself: its index, where its own log would go (only process 0
# writes one), how often it would print, whether it shows the libraries' logs, how long it
# waits for the others; and --data, whose
# path may differ between machines: the data's identity is compared instead.
PER_PROCESS = frozenset({"process_id", "log_file", "log_every", "verbose", "coordinator_timeout", "data"})


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def run_settings(args, data: dict) -> dict[str, str]:
    """What every process must share: each flag's value, the data's identity (name, length,
    a CRC of sampled tokens) and the code's versions, as text by name.

    >>> import argparse
    >>> run_settings(argparse.Namespace(lr=0.01, process_id=1), {"name": "x"})["--lr"]
    '0.01'
    """
    given = sorted((k, v) for k, v in vars(args).items() if k not in PER_PROCESS)
    flags = {f"--{k.replace('_', '-')}": str(v) for k, v in given}
    versions = {name: str(_version(name)) for name in ("fsdp-tp", "jax", "flax", "optax")}
    return {**flags, "data": json.dumps(data, sort_keys=True), **versions}


def differences(reference: dict[str, str], mine: dict[str, str], process: int) -> list[str]:
    """Each setting of process ``process`` that differs from process 0's, in words.

    >>> differences({"--lr": "0.003"}, {"--lr": "0.01"}, 1)
    ['process 1 has --lr 0.01, process 0 has --lr 0.003']
    """
    names = sorted(set(reference) | set(mine))
    return [
        f"process {process} has {name} {mine.get(name)}, process 0 has {name} {reference.get(name)}"
        for name in names
        if reference.get(name) != mine.get(name)
    ]


class DisagreementError(UsageError):
    """The processes were started with other settings. Raised on every process; each, once
    it has said so (:meth:`leave`), tells the others, and process 0, which runs the
    coordination service, leaves last: a process still printing its line when the service
    went away was aborted by it, and read as a lost coordinator."""

    def __init__(self, message: str, client, me: int, processes: int, timeout_ms: int):
        super().__init__(message)
        self._client, self._me, self._processes, self._timeout_ms = client, me, processes, timeout_ms

    def leave(self) -> None:
        """After this process printed its line."""
        ended_deliberately(2)  # for a supervising parent: whatever native code says next
        try:
            if self._me:
                self._client.key_value_set(f"fsdp_tp/left/{self._me}", "1")
                return
            for process in range(1, self._processes):
                self._client.blocking_key_value_get(f"fsdp_tp/left/{process}", self._timeout_ms)
        except Exception:  # the service or a process gone meanwhile: this one has said its line
            return


def check_agreement(settings: dict[str, str], timeout_s: int) -> None:
    """Raises ``UsageError`` on every process when any process's ``settings`` differ from
    process 0's; returns on every process otherwise. A single process returns at once.

    Process 0 publishes its settings; each process publishes what it found different; all
    read every verdict, then meet at a barrier, so none ends while another still reads; the
    caller prints the error, then calls its :meth:`DisagreementError.leave`.
    """
    client = coordination_client()
    if client is None:
        return
    me, timeout_ms = jax.process_index(), timeout_s * 1000
    if me == 0:
        client.key_value_set("fsdp_tp/settings", json.dumps(settings))
    reference = json.loads(client.blocking_key_value_get("fsdp_tp/settings", timeout_ms))
    client.key_value_set(f"fsdp_tp/verdict/{me}", json.dumps(differences(reference, settings, me)))
    found = []
    for process in range(jax.process_count()):
        found += json.loads(client.blocking_key_value_get(f"fsdp_tp/verdict/{process}", timeout_ms))
    client.wait_at_barrier("fsdp_tp/compared", timeout_ms)
    if found:
        raise DisagreementError(
            "the processes of this run were started with other settings: "
            + "; ".join(found)
            + ". Start every process with the same flags and data (only --process-id differs).",
            client,
            me,
            jax.process_count(),
            timeout_ms,
        )
