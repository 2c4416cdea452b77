"""Building device meshes and simulating devices on a CPU-only machine.

``DEFAULT_AXIS_NAMES`` are the three axes the library's defaults use:

>>> DEFAULT_AXIS_NAMES
('data', 'fsdp', 'tensor')
>>> dict(make_mesh({"data": 2, "fsdp": 2, "tensor": 2}).shape)
{'data': 2, 'fsdp': 2, 'tensor': 2}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import AxisType, Mesh

from .errors import MeshShapeError

__all__ = ["DEFAULT_AXIS_NAMES", "make_mesh", "parse_mesh", "simulate_cpu_devices"]

DEFAULT_AXIS_NAMES = ("data", "fsdp", "tensor")
"""Batch split with params replicated, batch split with params sharded, params split by TP rules."""


def _resolve_sizes(axis_sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Fills in the one axis given as ``-1`` and checks the sizes multiply to ``num_devices``."""
    sizes = dict(axis_sizes)
    bad = {
        name: size
        for name, size in sizes.items()
        if isinstance(size, bool) or not isinstance(size, int) or size == 0 or size < -1
    }
    if bad:
        raise MeshShapeError(f"make_mesh: axis sizes must be positive integers (or -1 once), got {bad}.")
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise MeshShapeError(f"make_mesh: only one axis may be -1 (fill the rest), got {free}.")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if num_devices % fixed:
            raise MeshShapeError(
                f"make_mesh: cannot fill axis {free[0]!r}: {num_devices} devices are not divisible "
                f"by the other axes' product {fixed} ({sizes})."
            )
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise MeshShapeError(
            f"make_mesh: axis sizes {sizes} multiply to {fixed} devices, but {num_devices} are "
            f"available. Choose sizes whose product is {num_devices}, pass devices= explicitly, "
            f"or set one axis to -1 to take the rest."
        )
    return sizes


def make_mesh(
    axis_sizes: Mapping[str, int] | str | None = None,
    *,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A mesh with ``Auto`` axis types over all (or the given) devices.

    ``axis_sizes`` maps axis names to sizes, in mesh order (or is the command line's
    ``"data=2,fsdp=4"``); one size may be ``-1`` to take the remaining devices. The
    default is every device on ``fsdp`` of a ``data x fsdp x tensor`` mesh. ``Auto`` (not
    jax 0.10's default ``Explicit``) lets ``jax.shard_map`` take inputs that are not sharded
    like its ``in_specs`` yet.

    >>> mesh = make_mesh({"data": 2, "fsdp": -1, "tensor": 1})
    >>> dict(mesh.shape)
    {'data': 2, 'fsdp': 4, 'tensor': 1}
    """
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(axis_sizes, str):  # what the command line takes: "data=2,fsdp=4"
        axis_sizes = parse_mesh(axis_sizes)
    if axis_sizes is not None and not isinstance(axis_sizes, Mapping):
        raise MeshShapeError(
            f"make_mesh: axis_sizes must map axis names to sizes, e.g. {{'data': 2, 'fsdp': 4}} or "
            f"'data=2,fsdp=4'; got {axis_sizes!r} ({type(axis_sizes).__name__})."
        )
    if axis_sizes is None:
        axis_sizes = {"data": 1, "fsdp": -1, "tensor": 1}
    bad = [name for name in axis_sizes if not (isinstance(name, str) and name)]
    if bad:
        raise MeshShapeError(
            f"make_mesh: axis names must be non-empty names such as 'data' or 'fsdp'; got {bad} in "
            f"{dict(axis_sizes)!r}."
        )
    sizes = _resolve_sizes(axis_sizes, len(devices))
    return jax.make_mesh(
        tuple(sizes.values()),
        tuple(sizes),
        axis_types=(AxisType.Auto,) * len(sizes),
        devices=devices,
    )


def parse_mesh(text: str) -> dict[str, int]:
    """Parses ``"data=2,fsdp=2,tensor=2"`` into axis sizes for :func:`make_mesh`.

    >>> parse_mesh("data=2, fsdp=-1")
    {'data': 2, 'fsdp': -1}
    """
    sizes: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name or not value.strip().lstrip("-").isdigit():
            raise MeshShapeError(
                f"mesh {text!r}: item {item!r} is not NAME=SIZE; write e.g. 'data=2,fsdp=2,tensor=2'."
            )
        if name in sizes:
            raise MeshShapeError(f"mesh {text!r}: axis {name!r} is given twice.")
        sizes[name] = int(value)
    if not sizes:
        raise MeshShapeError(f"mesh {text!r}: no axes; write e.g. 'data=2,fsdp=2,tensor=2'.")
    return sizes


def simulate_cpu_devices(n: int) -> None:
    """Makes JAX run on ``n`` simulated CPU devices; call it before any JAX computation.

    Raises ``RuntimeError`` if the backend already started with a different
    count, since the device count is fixed from then on in this process.
    In a fresh process: ``import fsdp_tp; fsdp_tp.simulate_cpu_devices(8)``
    right after the imports. Here the backend already runs 8 devices:

    >>> simulate_cpu_devices(8)   # the count it has: nothing to do
    >>> simulate_cpu_devices(4)
    Traceback (most recent call last):
    ...
    RuntimeError: simulate_cpu_devices(4): the JAX backend already started with 8 cpu device(s), ...
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"simulate_cpu_devices: n must be a positive int, got {n!r}.")
    if _backend_started():  # ask first: jax 0.11 would take the new count and start afresh
        _keep_running_backend(n)
        return
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as err:  # jax 0.10's own refusal, where _backend_started cannot tell
        _keep_running_backend(n, err)


def _backend_started() -> bool:
    """Whether a JAX backend runs in this process. jax has no public query for it: jax 0.10
    refuses ``jax_num_cpu_devices`` once one runs, but jax 0.11 accepts it and later calls
    see a second backend of the new count, beside the arrays on the first one."""
    from jax._src import xla_bridge  # private: its one query; absent, the refusal above decides

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started is not None and started())


def _keep_running_backend(n: int, cause: Exception | None = None) -> None:
    """Nothing to do if the running backend has ``n`` CPU devices; otherwise the error."""
    current = jax.device_count()
    if current == n and jax.default_backend() == "cpu":
        return
    raise RuntimeError(
        f"simulate_cpu_devices({n}): the JAX backend already started with {current} "
        f"{jax.default_backend()} device(s), and the count cannot change in a running process. "
        f"Call simulate_cpu_devices right after `import jax`, before any array is created, "
        f"or start Python with XLA_FLAGS=--xla_force_host_platform_device_count={n} "
        f"JAX_PLATFORMS=cpu."
    ) from cause
