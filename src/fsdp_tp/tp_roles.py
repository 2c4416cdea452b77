"""The roles' module under the name 0.1 and 0.2 wrote, ``fsdp_tp.tp_roles``: the very module
:mod:`fsdp_tp.tp.roles` (one module object under both names, so what one name patches or
registers, the other sees).
"""

import sys

from .tp import roles

sys.modules[__name__] = roles
