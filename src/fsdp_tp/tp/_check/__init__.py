"""The plan check: whether a tensor-parallel plan computes the unsharded model, read from one
device's trace against the unsharded one before the first step. The one driver both front ends
call (:mod:`.driver`), the operation-by-operation reading (:mod:`.blocks`), the wording of its
refusals (:mod:`.refusals`), the layers a refused one is split with (:mod:`.partners`), and an
expert layer's round trips (:mod:`.round_trips`).
"""

__all__: list[str] = []
