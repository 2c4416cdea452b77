"""The ``fsdp-tp`` command (``python -m fsdp_tp``).

Not the library's API: the command's insides, whose names may change in any release (the
library is what docs/api.md lists).
"""

from .main import console as console
from .main import main as main

__all__ = ["console", "main"]
