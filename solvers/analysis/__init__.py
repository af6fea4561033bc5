"""Judging plans, above the front door (:func:`solvers.solve`): every solver, grouping policy and
baseline on the same inputs (:mod:`~solvers.analysis.compare`), and why a plan is as fast as it
is (:mod:`~solvers.analysis.explain`)."""

__all__: list[str] = []
