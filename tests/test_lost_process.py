"""Issue 34 point 2: a process of a multi-process run that dies ends every other one with one
line naming it and the checkpoint to --resume from, within --peer-timeout (not a C++ abort
stack after 100 s); the process that was killed says so too. A signal to one process stops
every process after the same step."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fsdp_tp.cli.verdict import DELIBERATE, Identity, verdict
from fsdp_tp.cli.workdir import saved_steps
from tests.processes import MESH, free_port, start_two_processes

# What jaxlib 0.10.2's coordination service wrote on the survivors here (cut to the words read).
PROCESS_1_LOST = (
    "E1125 02:37:00.942642 9381 coordination_service.cc:1549] Use error polling to propagate the "
    "following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending "
    "heartbeats):\n1\nThe tasks have crashed. Check the task logs for an earlier error\n"
    "F1125 02:37:00.944848 9392 client.h:80] Terminating process because the JAX distributed "
    "service detected fatal errors.\n*** Check failure stack trace: ***\n"
)
PROCESS_0_LOST = (
    "F1125 02:45:36.517183 10379 client.h:80] Terminating process because the JAX distributed "
    "service detected fatal errors. absl::Status: UNAVAILABLE: Failed to send RPC to coordination "
    "service. Either the leader task was preempted/died/restarted unexpectedly\n"
)
SAME_ID = (
    "absl::Status: ALREADY_EXISTS: Aborted connect attempt as there is a request from a newer incarnation."
)
NOT_JOINED = "absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded\n\nRPC: /xla.coordination.Coordination"
NOT_JOINED += "Service/RegisterTask"
OTHER_ABORT = "F1125 02:50:00.000000 1 pjrt_client.cc:12] Check failed: buffer != nullptr\n"
WHO = Identity(process=0, processes=2, peer_timeout=30, coordinator_timeout=300)
RESUME = "the last checkpoint is ck/20: start every process again with --resume to continue from it."


@pytest.mark.parametrize(
    "code, native, who, ended",
    [
        (-6, PROCESS_1_LOST, WHO, (1, "process 1 of 2 stopped answering for --peer-timeout 30 s")),
        (-6, PROCESS_0_LOST, Identity(1, 2, 30), (1, "lost process 0 of 2, which runs the coordinator")),
        (
            -6,
            SAME_ID,
            Identity(1, 3, 30),
            (2, "joined the run as process 1 too; give each its own --process-id (0 .. 2)"),
        ),
        (-6, NOT_JOINED, WHO, (2, "not all 2 processes joined within --coordinator-timeout 300 s")),
        (-9, "", WHO, (137, "this process (0) of 2 was killed by SIGKILL; " + RESUME)),
        # Negative controls: nothing said for a child that ended on its own, or for an abort the
        # service did not cause (the parent shows the native log then).
        (143, PROCESS_1_LOST, WHO, (143, None)),
        (-6, OTHER_ABORT, WHO, (-6, None)),
        # Issue 46 point 4: a process that printed why it ends (the settings differ), then was
        # aborted because process 0 had left first, is not a lost coordinator (the row
        # "coordinator-lost" above is the same log without the child's word: the control).
        (-6, f"\n{DELIBERATE} 2\n" + PROCESS_0_LOST, Identity(1, 2, 30), (2, None)),
    ],
    ids=[
        "peer-lost",
        "coordinator-lost",
        "same-id",
        "not-joined",
        "killed",
        "own-exit",
        "other-abort",
        "said-why-then-aborted",
    ],
)
def test_the_native_log_is_read_as_one_line(code, native, who, ended):
    got = verdict(code, native, who, "ck", [10, 20])
    assert got.code == ended[0]
    assert (got.line is None) if ended[1] is None else (ended[1] in got.line), got.line
    if got.code == 1:
        assert got.line.endswith(RESUME)


def _until_a_checkpoint(procs: list, ckpt: Path) -> None:
    """Waits while both processes train until the run has saved a checkpoint."""
    began = time.monotonic()
    while not saved_steps(ckpt):
        assert all(p.poll() is None for p in procs) and time.monotonic() - began < 300
        time.sleep(0.2)


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.parametrize("lost", [1, 0], ids=["process-1", "coordinator"])
def test_a_lost_process_ends_the_others_with_one_line_naming_it_and_the_checkpoint(tmp_path, lost):
    """Process ``lost``'s training child is killed (as the out-of-memory killer would) once a
    checkpoint exists. The survivor ends within --peer-timeout 5 s (JAX's own 100 s would run
    past the wait below) with exit 1 and one line; the killed one's parent names its signal."""
    ckpt, port = tmp_path / "ckpt", free_port()
    argv = ["train", "--steps", "100000", "--checkpoint-every", "2", "--eval-every", "0", "--mesh", MESH]
    flags = ["--checkpoint-dir", str(ckpt), "--peer-timeout", "5"]
    procs = start_two_processes(lambda i: [*argv, *flags], port, stdout=subprocess.DEVNULL)
    try:
        _until_a_checkpoint(procs, ckpt)
        (child,) = _children(procs[lost].pid)
        subprocess.run(["kill", "-9", str(child)], check=True)
        errs = [p.communicate(timeout=60)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    newest = f"{ckpt}/{max(saved_steps(ckpt))}"
    survivor = 1 - lost
    assert procs[survivor].returncode == 1, errs[survivor][-3000:]
    line = errs[survivor].strip()
    assert len(line.splitlines()) == 1 and "Check failure" not in line, line[-3000:]
    said = (
        "process 1 of 2 stopped answering" if lost == 1 else "lost process 0 of 2, which runs the coordinator"
    )
    assert line.startswith(f"fsdp-tp: error: {said}") and line.endswith(
        f"so this process ({survivor}) stopped too; the last checkpoint is {newest}: start every "
        "process again with --resume to continue from it."
    ), line
    assert procs[lost].returncode == 128 + signal.SIGKILL
    assert errs[lost].strip() == (
        f"fsdp-tp: error: this process ({lost}) of 2 was killed by SIGKILL; the last checkpoint is "
        f"{newest}: start every process again with --resume to continue from it."
    )


def test_a_signal_to_one_process_stops_every_process_after_the_same_step(tmp_path):
    """SIGTERM to process 1 alone used to stop process 1 and leave process 0 waiting in the next
    step's collectives for ever (both hung, seen for 400 s). Now process 1's parent passes the
    signal to its child, which tells the others through the coordination service: every process
    stops after the same step, names it and the same checkpoint, and exits 143."""
    ckpt, log, port = tmp_path / "ckpt", tmp_path / "log.jsonl", free_port()
    argv = ["train", "--steps", "100000", "--checkpoint-every", "2", "--eval-every", "0", "--mesh", MESH]
    flags = ["--checkpoint-dir", str(ckpt), "--log-file", str(log)]
    procs = start_two_processes(lambda i: [*argv, *flags], port, stdout=subprocess.DEVNULL)
    try:
        _until_a_checkpoint(procs, ckpt)
        procs[1].send_signal(signal.SIGTERM)  # the parent: it passes the signal on
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [143, 143], errs
    reached = max(json.loads(line).get("step", 0) for line in log.read_text().splitlines())
    newest = f"{ckpt}/{max(saved_steps(ckpt))}"
    tail = f"after step {reached} of 100000; last checkpoint {newest}; --resume continues from it."
    assert errs[0].strip() == f"fsdp-tp: stopped by SIGTERM (sent to process 1) {tail}"
    assert errs[1].strip() == f"fsdp-tp: stopped by SIGTERM {tail}"
