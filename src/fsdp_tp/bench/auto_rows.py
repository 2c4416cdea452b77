"""What finding the Megatron plan costs (``find_tp_rules``, one abstract trace of the model's
forward), on 32-layer models in both Flax APIs, what checking it against a device's trace adds
(``size=`` checks the plan found: :mod:`fsdp_tp._check.driver`), and whether the plan found gives
every module the role the model's hand-written rules give it.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .. import nnx as fsdp_nnx
from .._check.driver import switched_off
from ..linen.auto_rules import find_tp_rules
from ..models.llama import RULES, LlamaLM, NNXLlamaLM
from ..models.llama import SIZES as LLAMA
from ..models.nnx_transformer import NNXTransformer, tp_rules
from ..tp.auto import TPPlan
from .figures import median
from .report import spread

__all__ = ["Found", "auto_costs", "auto_section"]

TENSOR = 2
SEQ = 128


@dataclass(frozen=True)
class Found:
    model: str
    api: str
    layers: int
    seconds: list[float]  # the plan found, unchecked
    checked: list[float]  # found and checked against a device's trace
    differences: list[str]


def _cases(layers: int) -> list[tuple[str, str, Callable[[], TPPlan], Sequence]]:
    """``(model, api, find its plan, the hand-written rules)``; each model built (abstractly)
    here, so that what is timed is the finding alone."""
    ids = jax.ShapeDtypeStruct((8, SEQ), jnp.int32)
    llama: dict[str, Any] = dict(LLAMA, layers=layers)
    sizes = (32000, 1024, layers, 16, 64, 16, 4096)
    gpts = {
        scan: nnx.eval_shape(lambda scan=scan: NNXTransformer(*sizes, scan_layers=scan, rngs=nnx.Rngs(0)))
        for scan in (False, True)
    }
    nnx_llama = nnx.eval_shape(lambda: NNXLlamaLM(**llama, rngs=nnx.Rngs(0)))
    gpt = functools.partial(fsdp_nnx.find_tp_rules, size=TENSOR, outputs_split=True)
    return [
        ("GPT, layers unrolled", "nnx", lambda: gpt(gpts[False], ids), tp_rules()),
        ("GPT, nnx.scan", "nnx", lambda: gpt(gpts[True], ids), tp_rules()),
        ("Gemma/Llama-style", "linen", lambda: find_tp_rules(LlamaLM(**llama), ids, size=TENSOR), RULES),
        ("Gemma/Llama-style", "nnx", lambda: fsdp_nnx.find_tp_rules(nnx_llama, ids, size=TENSOR), RULES),
    ]


def auto_costs(layers: int = 32, repeats: int = 3) -> list[Found]:
    """Each case's plan found ``repeats`` times, unchecked and checked (interleaved, each timed
    alone), and compared with the hand rules."""
    out = []
    for model, api, find, hand in _cases(layers):
        seconds: list[float] = []
        checked: list[float] = []
        plan = None
        for _ in range(repeats):
            for times, off in ((seconds, True), (checked, False)):
                start = time.perf_counter()
                with switched_off() if off else contextlib.nullcontext():
                    plan = find()
                times.append(time.perf_counter() - start)
        assert plan is not None
        out.append(Found(model, api, layers, seconds, checked, plan.differences(hand)))
    return out


def auto_section(found: list[Found]) -> str:
    """The benchmark page's section for :func:`auto_costs`."""
    rows = [
        f"| {f.model} | {f.api} | {f.layers} | {spread(f.seconds)} | {spread(f.checked)} | "
        f"{median(f.checked) / median(f.seconds):.2f} | "
        f"{'yes' if not f.differences else '; '.join(f.differences)} |"
        for f in found
    ]
    return (
        "\n### Finding the Megatron plan: `find_tp_rules`\n\n"
        f"Each model built abstractly and its forward traced once (batch 8, sequence {SEQ}, "
        f"`tensor` {TENSOR}); the plan found from the trace, timed alone, {len(found[0].seconds)} "
        "times. The GPT: d 1024, 16 heads of 64, an MLP of 4096, a 32000-word vocabulary, its "
        "logits left split (`outputs_split=True`); the Gemma/Llama-style model: "
        "`fsdp_tp.models.llama`'s sizes. *= hand rules*: the plan gives every module the role the "
        "model's hand-written rules give it (`models.nnx_transformer.tp_rules()`, "
        "`models.llama.RULES`), else the modules where they differ. *Checked*: the same call with "
        "the plan checked against one device's trace on an abstract mesh of that size (what "
        '`size=` does; `tp_rules="auto"` checks under the real mesh): the model laid out by the '
        "plan initialized, its call traced on a device and the unsharded model's traced, then "
        "read against each other; *unchecked* is the finding alone (the check switched off). "
        "Trace time only, once per plan and input shape: the step runs the same program either "
        "way:\n\n"
        "| model | API | layers | unchecked ms, median (min-max) | checked ms | checked / unchecked "
        "| = hand rules |\n"
        "|---|---|---:|---:|---:|---:|---|\n" + "\n".join(rows) + "\n"
    )
