"""The ``fsdp-tp`` command (``python -m fsdp_tp``)."""

from .main import console as console
from .main import main as main

__all__ = ["console", "main"]
