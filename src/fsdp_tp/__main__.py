"""``python -m fsdp_tp``: the ``fsdp-tp`` command."""

from .cli import console

console()
