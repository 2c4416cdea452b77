"""``python -m fsdp_tp``: the ``fsdp-tp`` command."""

import sys

from .cli import main

sys.exit(main())
