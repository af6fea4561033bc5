"""Subcommands of the ``partitioner`` CLI, one module each (see ``partitioner.cli``)."""
