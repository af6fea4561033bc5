"""The ``partitioner`` command: one module per subcommand (``plan.py``, ``train.py``, ...), each
with ``register(subparsers)``; :mod:`partitioner_cli.main` builds the parser and runs one.

The top layer: it imports ``partitioner``, ``solvers`` and ``runtime``, and nothing imports it.
Torch, matplotlib, OR-Tools and PuLP are imported inside the functions that use them, so
``--help``, ``import``, ``plan``, ``simulate`` and ``explain`` never load torch.
"""

__all__: list[str] = []
