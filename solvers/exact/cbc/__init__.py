"""The chain, graph and joint models on CBC through PuLP (imported only when asked for);
:mod:`~solvers.exact.cbc.run` runs CBC with its log and reads its bound."""

__all__: list[str] = []
