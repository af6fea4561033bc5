"""The chain, graph and joint models on OR-Tools CP-SAT (imported only when asked for)."""

__all__: list[str] = []
