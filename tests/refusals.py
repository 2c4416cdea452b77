"""Issue 82: every refusal the suite raises names a fix, and the test that raises it applies that
fix as a user would and sees it accepted (equal to unsharded where it trains).

A test reads the fix off the message with :func:`named_fix` (the text must be in the message,
else the fix applied is not the one a user is told) and then runs it; where the fix is a role
or a spec, :func:`role_named` turns the text the message gives into the object, so what runs is
what the message says. ``tests/test_refusal_fixes.py`` holds every test function that raises a
refusal to this: it calls :func:`named_fix` (or :func:`role_named`), or it is in
:data:`BY_HAND` with the reason no test can apply its fix by the message.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from jax.sharding import PartitionSpec

import fsdp_tp.tp as tp
from fsdp_tp.errors import RuleError

__all__ = ["BY_HAND", "named_fix", "role_named", "stored_as_named"]


def named_fix(refused: pytest.ExceptionInfo | BaseException | str, fix: str) -> str:
    """``fix``, asserted to be what the refusal's message names (exactly, in its text)."""
    value = refused.value if isinstance(refused, pytest.ExceptionInfo) else refused
    message = str(value)
    assert fix in message, f"the refusal does not name the fix the test applies, {fix!r}: {message}"
    return fix


def role_named(refused: pytest.ExceptionInfo | BaseException | str, pattern: str) -> Any:
    """The role or ``PartitionSpec`` the refusal's message spells (the first text matching the
    regular expression ``pattern``, e.g. ``r"ColumnParallel\\(letter='K'\\)"``), built from that
    text: ``ColumnParallel(letter='K')`` is ``tp.ColumnParallel(letter="K")``."""
    value = refused.value if isinstance(refused, pytest.ExceptionInfo) else refused
    found = re.search(pattern, str(value))
    assert found, f"the refusal spells no {pattern!r}: {value}"
    namespace = {name: getattr(tp, name) for name in tp.__all__} | {"P": PartitionSpec}
    return eval(named_fix(value, found[0]), {"__builtins__": {}}, namespace)  # (the library's names only)


_STORE = re.compile(r"^(\S+): .*Store it as (P\([^)]*\)) \(the role adds", re.S)


def stored_as_named(refused: pytest.ExceptionInfo | BaseException, build, rounds: int = 8):
    """The storage fixes refusals name (``"<parameter>: ... Store it as P(...)"``), applied as a
    user would: a rule for the parameter it names, with that spec, ahead of the rest; then
    ``build(rules)`` again, until it is accepted (``(rules, None)``) or refused for another
    reason (``(rules, that refusal)``). A rule matching several parameters misfits each in its
    turn: one refusal names one parameter."""
    rules: list = []
    error = refused.value if isinstance(refused, pytest.ExceptionInfo) else refused
    for _ in range(rounds):
        found = _STORE.search(str(error))
        if found is None:
            return rules, error
        rules.insert(0, ("^" + re.escape(found[1]) + "$", role_named(error, re.escape(found[2]))))
        try:
            build(rules)
            return rules, None
        except RuleError as again:
            error = again
    raise AssertionError(f"still refused after {rounds} storage fixes: {error}")


# Test functions (file::name) whose refusals carry a fix no test can apply by the message, and why.
_SABOTAGED = (
    "a negative control: the refused plan is made by breaking the library (a role, the finder or the "
    "check patched) or the model on purpose, to show the check catches it; the fix the message names "
    "is to the code the test broke"
)
_CODE = (
    "the fix the message names rewrites the model's code (its reshape, its own parameter, its einsum), "
    "which no test can derive from the message; the test beside it shows the written fix accepted"
)
BY_HAND: dict[str, str] = {
    # (issue 99: the model normalizes each shard by its own statistics on purpose, to read the
    # step's model state; the fix, BatchNorm(axis_name=...), is applied in test_model_state.py)
    "test_nnx.py::test_a_step_updates_batch_statistics_and_rng_counts_as_the_twin": _SABOTAGED,
    "test_moe.py::test_negative_control_a_load_balancing_loss_not_the_global_batchs_is_caught": _SABOTAGED,
    "test_agreeing_layouts.py::test_negative_control_the_old_suggestion_is_refused_in_turn": _SABOTAGED,
    "test_auto_tp.py::test_negative_control_a_finder_blind_to_a_norms_mean": _SABOTAGED,
    "test_dropout.py::"
    "test_negative_control_flax_s_own_dropout_on_blocks_is_not_the_unsharded_models": _SABOTAGED,
    "test_einsum_tp.py::test_negative_control_a_row_einsum_adding_its_own_bias": _SABOTAGED,
    "test_einsum_tp.py::test_negative_control_query_heads_split_and_kv_heads_whole": _SABOTAGED,
    "test_einsum_tp.py::test_negative_control_a_row_einsum_without_its_sum": _SABOTAGED,
    "test_einsum_tp.py::test_negative_control_an_unregistered_module_is_refused_by_name": _SABOTAGED,
    "test_moe.py::test_negative_control_a_combine_without_the_return_all_to_all_is_caught": _SABOTAGED,
    "test_moe.py::"
    "test_negative_control_an_expert_bank_that_never_sends_the_tokens_back_is_refused": _SABOTAGED,
    "test_nnx.py::test_negative_control_a_row_layer_without_its_sum": _SABOTAGED,
    "test_plan_check.py::test_negative_control_leaving_the_refused_layer_alone_whole_is_refused_again": (
        _SABOTAGED + " (here the fix as it was once worded, shown refused)"
    ),
    "test_tp_rules.py::test_negative_control_a_row_bias_added_on_every_device": _SABOTAGED,
    "test_plan_check.py::test_the_layers_check_sees_a_users_model_through_the_librarys_wrappers": (
        _CODE + " (the Linen Megatron layers are classes in the model's code: leaving one whole is a "
        "code change too)"
    ),
    "test_plan_check.py::test_a_jitted_jnp_function_on_the_sequence_slices_is_refused_at_its_line_or_equal": (
        _CODE + " (the way that computes where the dim is whole, along the features, is proved equal "
        "in the same test)"
    ),
    "test_plan_check.py::test_a_per_head_value_cut_to_a_devices_heads_is_refused_at_its_line": (
        _CODE + " (the slopes cut by the model's head count, not q's shape)"
    ),
    "test_plan_check.py::test_attention_as_people_write_it_is_refused_at_its_line_or_equal": (
        _CODE + " (the ways that take it pass in the same test; the rules' fix, leave it whole, is "
        "applied by test_a_refusals_leave_whole_fix_is_accepted_and_equal)"
    ),
}
