"""An einsum layer's equation as a tensor-parallel role reads it: which kernel dims a layer
produces and which it contracts, framework-free (a class of the user's registered as one:
:mod:`fsdp_tp.tp._registered`).

An einsum layer (``nn.Einsum``, ``nnx.Einsum``) computes ``einsum("<inputs>,<kernel>-><output>",
x, kernel)``. A kernel letter that appears in the output and not in the inputs is *produced*
(a feature or a heads dim: a column-parallel layer splits it, and its output is split there);
one that appears in the inputs and not in the output is *contracted* (a row-parallel layer
splits it: its input arrives split there and the partial sums are reduced once). The bias,
when there is one, has the kernel's letters in the order the output has them.

>>> eq = Equation.parse("BTD,NDH->BTNH", "attn/q")
>>> eq.produced, eq.contracted
('NH', 'D')
>>> eq.kernel_dim("N"), eq.bias_letters
(0, 'NH')
>>> Equation.parse("BTNH,NHD->BTD", "attn/out").contracted
'NH'
"""

from __future__ import annotations

import dataclasses

from ..errors import RuleError

__all__ = ["Equation", "shrunk", "split_letter"]


@dataclasses.dataclass(frozen=True)
class Equation:
    """``inputs,kernel->output`` of the layer at ``path`` (spaces dropped; ``...`` kept in
    the inputs and the output, where it stands for the batch-like dims)."""

    inputs: str
    kernel: str
    output: str
    path: str

    @classmethod
    def parse(cls, equation: str, path: str) -> Equation:
        """The equation checked: explicit (``->``), two operands, a kernel of distinct letters."""
        text = equation.replace(" ", "")
        operands, arrow, output = text.partition("->")
        parts = operands.split(",")
        if not arrow or len(parts) != 2:
            raise RuleError(
                f"{path} is an einsum layer with equation {equation!r}: a tp role reads an explicit "
                f"two-operand equation 'inputs,kernel->output' (e.g. 'BTD,DF->BTF')."
            )
        inputs, kernel = parts
        if unknown := sorted(set(output) - set(inputs) - set(kernel) - {"."}):
            raise RuleError(
                f"{path} is an einsum layer with equation {equation!r}: its output names "
                f"{', '.join(map(repr, unknown))}, which neither operand has; each output letter is "
                f"a dim of the inputs or of the kernel (e.g. 'BTD,DF->BTF')."
            )
        if "." in kernel or len(set(kernel)) != len(kernel):
            raise RuleError(
                f"{path} is an einsum layer with equation {equation!r}: its kernel {kernel!r} must name "
                f"each dim with its own letter (no '...', no repeated letter) for a tp role to split one."
            )
        return cls(inputs, kernel, output, path)

    @property
    def text(self) -> str:
        return f"{self.inputs},{self.kernel}->{self.output}"

    @property
    def produced(self) -> str:
        """Kernel letters in the output and not the inputs, in the kernel's order."""
        return "".join(c for c in self.kernel if c in self.output and c not in self.inputs)

    @property
    def contracted(self) -> str:
        """Kernel letters in the inputs and not the output, in the kernel's order."""
        return "".join(c for c in self.kernel if c in self.inputs and c not in self.output)

    @property
    def batched(self) -> str:
        """Kernel letters in the inputs and the output both, in the kernel's order: a dim the
        layer computes one by one (an expert dim: one kernel an expert)."""
        return "".join(c for c in self.kernel if c in self.output and c in self.inputs)

    @property
    def bias_letters(self) -> str:
        """The bias's dims: the kernel's letters in the output's order."""
        return "".join(c for c in self.output if c in self.kernel)

    def kernel_dim(self, letter: str) -> int:
        return self.kernel.index(letter)

    def choose(self, letter: str | None, role: str, what: str) -> str:
        """The letter a role splits: ``letter`` when given, else the first of the kernel's
        ``what`` (``"produced"`` or ``"contracted"``) letters; an error names the equation,
        the letter and the ones that work."""
        options = getattr(self, what)
        if letter is None and options:
            return options[0]
        if letter is not None and len(letter) == 1 and letter in options:
            return letter
        verb, where = {
            "produced": ("splits an output dim", "in the output and not the inputs"),
            "contracted": ("splits a contracted dim", "in the inputs and not the output"),
            "batched": ("splits the experts", "in the inputs and the output (one kernel an expert)"),
        }[what]
        given = f"letter {letter!r} is not one of them" if letter is not None else "it has none"
        other = {"produced": "RowParallel", "contracted": "ColumnParallel", "batched": "ColumnParallel"}[what]
        fix = (
            f"give {role}(letter=...) one of {', '.join(repr(c) for c in options)}"
            if options
            else f"give it {other}(), or drop the rule"
        )
        raise RuleError(
            f"{self.path}: {role} {verb} of an einsum's kernel: a letter of the kernel {self.kernel!r} "
            f"{where} of {self.text!r}; {given}. Fix: {fix}."
        )

    def dim_of(self, letter: str, operand: str, ndim: int) -> int:
        """Where ``letter`` is in an array of ``ndim`` dims written ``operand`` (the inputs or
        the output, whose ``...`` stands for the dims not named), counted from the end."""
        before, _, after = operand.partition("...")
        if letter in after:
            return after.index(letter) - len(after)
        return before.index(letter) - ndim

    def output_dim(self, dim: int, ndim: int) -> int:
        """Where dim ``dim`` of an input of ``ndim`` dims lands in the output, counted from the
        end (a sequence the layer computes position by position: ``'BSD,CDKH->CBSKH'`` moves
        dim 1 to -3). A dim the layer contracts has no place there: refused by name.

        >>> Equation.parse("BSD,CDKH->CBSKH", "attn/kv").output_dim(1, 3)
        -3
        >>> Equation.parse("...D,DF->...F", "mlp/up").output_dim(-2, 3)
        -2
        """
        before, dots, after = self.inputs.partition("...")
        out_before, _, out_after = self.output.partition("...")
        dim, middle = dim % ndim, ndim - len(before) - len(after)
        if len(before) <= dim < len(before) + middle:  # a dim of the '...': in the same place of the output's
            return dim - len(before) - middle - len(out_after)
        letter = before[dim] if dim < len(before) else after[dim - len(before) - middle]
        if letter not in self.output:
            raise RuleError(
                f"{self.path}: dim {dim} of the input ({letter!r} in {self.text!r}) is contracted, and a "
                f"ring computes the layer chunk by chunk of it; name the sequence's dim as sequence_dim."
            )
        return self.dim_of(letter, self.output, len(out_before) + (middle if dots else 0) + len(out_after))

    def bias_shape(self, shape: tuple[int, ...], ndim: int) -> tuple[int, ...]:
        """The bias (``shape``, one size per :attr:`bias_letters`) as it broadcasts over an
        output of ``ndim`` dims."""
        sizes = dict(zip(self.bias_letters, shape, strict=True))
        before, dots, after = self.output.partition("...")
        middle = ndim - len(before) - len(after) if dots else 0
        return tuple(sizes.get(c, 1) for c in before) + (1,) * middle + tuple(sizes.get(c, 1) for c in after)

    def require_slice(self, letter: str, shape: tuple[int, ...], want: int) -> None:
        """A row-parallel einsum's input of ``shape`` holds ``want`` (this device's slice) on
        ``letter``; an input that arrived whole is named."""
        at = self.dim_of(letter, self.inputs, len(shape))
        if shape[at] != want:
            raise RuleError(
                f"{self.path} (RowParallel) cannot compute on its slices: its input {shape} has "
                f"{shape[at]} on dim {at % len(shape)} (letter {letter!r} of {self.text!r}), where this "
                f"device's slice is {want}. A RowParallel layer takes the split features a ColumnParallel "
                f"layer returns; its input arrived whole. Fix: make the layer that feeds {self.path} "
                f"ColumnParallel, or drop {self.path}'s rule so it stays whole."
            )


def split_letter(kind: str, equation: str, path: str, role: str, letter: str | None, what: str):
    """``(equation, letter, kernel dim)`` a ``role`` splits on an einsum layer (``what``:
    ``"produced"`` for a column role, ``"contracted"`` for a row role); for another kind of
    layer ``letter`` must be None and the answer is ``(an empty equation, "", 0)``."""
    if kind != "einsum":
        if letter is not None:
            raise RuleError(
                f"{path}: {role}(letter={letter!r}) names an einsum's dim, but {path} is a {kind} "
                f"layer, whose split is its features; drop letter=."
            )
        return Equation("", "", "", path), "", 0
    eq = Equation.parse(equation, path)
    chosen = eq.choose(letter, role, what)
    return eq, chosen, eq.kernel_dim(chosen)


def shrunk(shape: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    """``shape`` with dim ``dim`` divided by ``size``: a kernel's local shape."""
    return tuple(n // size if i == dim else n for i, n in enumerate(shape))
