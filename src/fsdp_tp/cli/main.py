"""``fsdp-tp``: train the library's GPT-style model end to end, or print its sharding plan.

    fsdp-tp train                        # 8 simulated CPU devices, mesh 2x2x2, embedded data
    fsdp-tp train --check 3              # and first compare 3 steps with the unsharded twin
    fsdp-tp train --checkpoint-dir ckpt --resume   # save every 100 steps; continue the newest
    fsdp-tp plan --preset base --mesh data=8,fsdp=64,tensor=8 --batch 512
    fsdp-tp bench                        # every strategy vs the baselines -> docs/benchmarks.md
    fsdp-tp finetune --from DIR --data corpus.txt --check 2 --export tuned/   # a Hub checkpoint

Bad input exits with status 2 and one line saying what to change.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings

from jax.errors import JaxRuntimeError

from ..errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointSaveError,
    FsdpTpWarning,
    IndivisibleShapeError,
    MeshShapeError,
)
from ..recipe.token_file import DataChangedError, DataError
from .agreement import DisagreementError, check_agreement, run_settings
from .bench_command import bench
from .checks import UsageError, check_attention, check_ranges
from .distributed import DistributedError
from .experts import with_expert_axis
from .machine import (
    check_cpu_devices,
    check_mesh_fits,
    check_platforms,
    requested_cpu_devices,
    select_devices,
    uses_accelerator,
)
from .options import DEFAULT_MESH, parser
from .output import LogWriteError
from .settings import mesh_sizes, settings_of, tokens_and_settings
from .stdout_filter import restore_stdout
from .supervise import adopt, supervisable, supervise, wait_for_verdict
from .workdir import check_contents, check_paths, resuming

__all__ = ["console", "main"]


def _checked_train(args, out) -> int:
    """``train``: every input checked (flags, paths, data, processes), then devices, then the run.
    Without ``--mesh`` on accelerators or with ``--cpu-devices N``, the devices come first: the
    mesh is all of them on fsdp."""
    import jax

    check_paths(args)
    check_platforms()
    check_attention(args.attention, args.dtype, uses_accelerator(args))
    if args.checkpoint_dir:
        check_contents(args.checkpoint_dir, resuming(args), args.overwrite, args.resume_from)
    if args.mesh is None and (uses_accelerator(args) or args.cpu_devices):
        check_cpu_devices(args)
        select_devices(args, None)  # checks the multi-process flags first
        sizes = with_expert_axis({"data": 1, "fsdp": jax.device_count(), "tensor": 1}, args.experts)
        args.mesh, args.mesh_chosen = f"fsdp={jax.device_count()}", True
        train_tokens, eval_tokens, settings = tokens_and_settings(args, sizes)
    else:
        sizes = mesh_sizes(args.mesh or DEFAULT_MESH, args.experts)
        train_tokens, eval_tokens, settings = tokens_and_settings(args, sizes)
        if (total := requested_cpu_devices(args)) is not None:
            check_mesh_fits(sizes, total, settings)  # before the devices are made
        select_devices(args, sizes)
    from .resume import data_identity, data_name

    # Before the mesh check and any device work: a process started otherwise would hang there.
    same = run_settings(args, data_identity(train_tokens, data_name(args)))
    check_agreement(same, args.coordinator_timeout)
    check_mesh_fits(sizes, jax.device_count(), settings)
    from .output import library_logs
    from .run import train

    with library_logs(args.verbose):
        return train(settings, sizes, args, train_tokens, eval_tokens, out)


def _with_command(argv: list[str]) -> list[str]:
    """``train`` is the default command: ``fsdp-tp --steps 3`` is ``fsdp-tp train --steps 3``."""
    argv = list(argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["train", *argv]
    return argv


def _parse(argv: list[str]):
    return parser(__doc__).parse_args(argv)


def main(argv: list[str] | None = None, out=sys.stdout) -> int:
    """Runs ``fsdp-tp`` with ``argv``; returns the exit status: 0, 1 when the run failed (a save,
    a non-finite step, ``--check``), 2 for bad input (one line on stderr, nothing started)."""
    argv = _with_command(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    if args.command == "bench":
        return bench(args, argv[1:], out)
    try:
        check_ranges(args)
        if args.command == "finetune":
            from .finetune import finetune

            return finetune(args, out)
        if args.command == "plan":
            sizes = mesh_sizes(args.mesh or DEFAULT_MESH, args.experts)
            if args.from_dir:
                from .hub_plan import print_hub_plan

                print_hub_plan(args.from_dir, sizes, args.batch, args.seq_len or 2048, out)
                return 0
            from .fit import print_plan

            print_plan(settings_of(args, sizes), sizes, out)
            return 0
        return _checked_train(args, out)
    except (CheckpointSaveError, LogWriteError, DataChangedError) as err:
        print(f"fsdp-tp: error: {err}", file=sys.stderr)
        return 1
    except (
        MeshShapeError,
        IndivisibleShapeError,
        DataError,
        UsageError,
        DistributedError,
        CheckpointMismatchError,
        CheckpointCorruptError,
    ) as err:
        print(f"fsdp-tp: error: {err}", file=sys.stderr)
        if isinstance(err, DisagreementError):
            err.leave()
        return 2
    except JaxRuntimeError as err:
        wait_for_verdict(err, getattr(args, "peer_timeout", 0))
        raise
    except BrokenPipeError:
        # The reader stopped reading (`fsdp-tp plan | head`): not an error. Point stdout at
        # /dev/null so the interpreter's last flush does not raise it again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def console() -> None:
    """The ``fsdp-tp`` executable: ``main``, then exit even if a failed save left orbax threads
    waiting for signals that will never come (they would hold the interpreter for 20 minutes).
    A failed run (1: an error; 2: a bad argument) leaves at once, its one line said: a
    multi-process run's process (a child a parent watches, ``supervise.py``) would otherwise
    wait in JAX's clean shutdown at a barrier the other processes, stuck in the next step's
    collectives, never reach (gone, it is a lost process: they stop within --peer-timeout,
    naming it); and the interpreter's exit would report, after that line, the writes a failed
    save cut short (coroutines orbax never awaited, seen under load). A run stopped by a signal
    exits cleanly, as the other processes do."""
    with warnings.catch_warnings():  # (the process's: restored for a caller in process)
        warnings.showwarning = _one_line(warnings.showwarning)
        if adopt():
            code = main()
        elif (args := supervisable(argv := _with_command(sys.argv[1:]), _parse)) is not None:
            sys.exit(supervise(argv, args))
        else:
            code = main()
    stuck = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if (code and stuck) or code in (1, 2):
        restore_stdout()  # flushes stdout, and passes on what the gloo-line filter holds
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _one_line(shown):
    """``warnings.showwarning`` that prints the library's warnings as the command prints its
    errors, one line, ``fsdp-tp: warning: ...``: the file and line Python adds would point at
    the console script, not at code the command's user wrote; an argument the advice names is
    the command's flag. Other warnings as ``shown``."""

    def show(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, FsdpTpWarning):
            return shown(message, category, filename, lineno, file, line)
        # (the advice names the library's argument; the command's user types its flag)
        text = str(message).replace("min_weight_size", "--min-weight-size")
        print(f"fsdp-tp: warning: {category.__name__}: {text}", file=sys.stderr if file is None else file)

    return show


if __name__ == "__main__":
    console()
