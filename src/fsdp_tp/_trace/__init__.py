"""A traced program and how it is read, framework-free: the foundation the plan check, the plan
finder, the specs and the sharded init stand on. One device's abstract trace of a function under
``jax.shard_map`` (:mod:`.per_device`: its tree, local shapes, specs and jaxpr); then a model's
trace read as the finder and the checker read it: the flat list of operations over numbered
values (:mod:`.graph`), what each JAX primitive does to its operands' dims (:mod:`.relations`),
how an operation treats a block and a partial sum (:mod:`.ops`), the user's line each came from
(:mod:`.sites`), and an operation made again at the model's line (:mod:`.rebind`).

It imports only the foundations (``_tree``, ``_types``, ``_layout``): the finder
(:mod:`fsdp_tp.tp._find`) and the checker (:mod:`fsdp_tp._check`) both stand on it; neither
reads a jaxpr any other way.
"""

__all__: list[str] = []
