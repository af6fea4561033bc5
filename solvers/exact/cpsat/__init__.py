"""The chain, graph and joint models on OR-Tools CP-SAT (imported only when asked for);
:mod:`~solvers.exact.cpsat.run` runs CP-SAT and reads its status and bound."""

__all__: list[str] = []
