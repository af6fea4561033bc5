"""The pipeline problems as integer models, with certified bounds: the data of each problem
(chain: :mod:`~solvers.exact.intervals`; graph of convex stages: :mod:`~solvers.exact.graph`;
device order and split together: :mod:`~solvers.exact.joint`, bounded by
:mod:`~solvers.exact.joint_bound`), one model per problem in each backend, under the same
file names (``cpsat/`` for OR-Tools CP-SAT, ``cbc/`` for CBC through PuLP), and one router
(:mod:`~solvers.exact.router`) that picks the problem for both."""

__all__: list[str] = []
