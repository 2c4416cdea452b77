"""Issue 34 point 15: the main job trains the losses recorded for this jax version, bit for bit
(``tests/golden_losses.py`` says what is recorded, why one run per instruction set, and how to
record again when a change of the numbers is intended)."""

from __future__ import annotations

import numpy as np

from tests.golden_losses import COMMAND, main_job, matching, mismatch, recorded


def test_the_main_job_trains_the_recorded_losses_bit_for_bit(tmp_path):
    golden = recorded()
    assert golden["command"] == ["fsdp-tp", *COMMAND], "the job changed: record its losses again"
    run = main_job(tmp_path)
    assert len(run["losses"]) == int(COMMAND[-1])
    assert matching(run, golden), mismatch(run, golden)


def test_one_ulp_anywhere_is_a_different_run():
    # Negative control: the comparison sees the smallest move of any one number.
    golden = recorded()
    run = next(iter(golden["runs"].values()))
    assert matching(run, golden)
    for step in (0, len(run["losses"]) - 1):
        moved = {**run, "losses": list(run["losses"])}
        moved["losses"][step] = float(np.nextafter(np.float32(moved["losses"][step]), np.float32(np.inf)))
        assert not matching(moved, golden)
        assert f"step {step + 1} loss {moved['losses'][step]!r}" in mismatch(moved, golden)
    moved = {**run, "eval_loss": float(np.nextafter(run["eval_loss"], np.inf))}
    assert not matching(moved, golden)
