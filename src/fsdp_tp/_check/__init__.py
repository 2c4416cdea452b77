"""The plan check: whether a step's layout (tensor-parallel roles, the sequence split over
``context``) computes the unsharded model, read from one device's trace against the unsharded
one before the first step. Core, above ``tp/`` and ``context/``, below ``train/`` and the front
ends. The one driver both front ends call (:mod:`.driver`), the operation-by-operation reading
(:mod:`.blocks`), the wording of its refusals (:mod:`.refusals`), the layers a refused one is
split with (:mod:`.partners`), and an expert layer's round trips (:mod:`.round_trips`).
"""

__all__: list[str] = []
