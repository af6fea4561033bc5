"""Rows for ``partitioner bench``: a script that calls :func:`emit` hands its table, as a list
of dicts, to the command that started it (which saves them with the machine, versions and
seeds, and plots them). Run on its own, a script's :func:`emit` does nothing."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ROWS_ENV", "emit"]

# Set by `partitioner bench` to the file the rows go to.
ROWS_ENV = "PARTITIONER_BENCH_ROWS"


def emit(rows: Sequence[Mapping[str, Any]], **meta: Any) -> None:
    """Write ``{"rows": rows, **meta}`` (e.g. ``seeds=...``) to ``$PARTITIONER_BENCH_ROWS``, if set."""
    path = os.environ.get(ROWS_ENV)
    if not path:
        return
    with open(path, "w") as fh:
        json.dump({"rows": [dict(r) for r in rows], **meta}, fh, indent=1, allow_nan=False)
