"""One pipeline over ordered devices: the exact chain DP (:mod:`~solvers.pipeline.dp`), its
multi-chunk form (:mod:`~solvers.pipeline.chunked`), the choice among candidates by simulation
(:mod:`~solvers.pipeline.ranking`), the device order of one worker (:mod:`~solvers.pipeline.mapping`),
an independent check for identical devices (:mod:`~solvers.pipeline.bisection`), and the solver
named ``dp`` that routes between them (:mod:`~solvers.pipeline.router`)."""

__all__: list[str] = []
