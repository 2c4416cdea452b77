"""The plan finder behind ``tp_rules="auto"`` and ``find_tp_rules``: the one driver both front
ends call (:mod:`.driver`), the axis and mesh it plans on (:mod:`.mesh`), Megatron's regions in a
trace (:mod:`.regions`), where a mixture's experts go (:mod:`.experts`), and the plan it returns
(:mod:`.plan`), and the finding itself (:mod:`.finder`), whose public face is
:mod:`fsdp_tp.tp.auto`.
"""

__all__: list[str] = []
