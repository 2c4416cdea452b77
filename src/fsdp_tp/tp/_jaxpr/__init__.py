"""A model's trace as the plan finder and the plan check read it, framework-free: the flat list
of operations over numbered values (:mod:`.graph`), what each JAX primitive does to its
operands' dims (:mod:`.relations`), how an operation treats a block and a partial sum
(:mod:`.ops`), and the user's line each came from (:mod:`.sites`).

The finder (:mod:`fsdp_tp.tp._find`) and the checker (:mod:`fsdp_tp.tp._check`) both stand on
these; neither reads a jaxpr any other way.
"""

__all__: list[str] = []
