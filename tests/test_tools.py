"""tools/installed.py: what `make install` checks before running pip."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import installed


def test_pyproject_read_without_tomllib_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    with_toml = installed.requirements()
    monkeypatch.setitem(sys.modules, "tomllib", None)  # as on Python 3.10
    assert installed.requirements() == with_toml
    assert any(r.startswith("torch") for r in with_toml) and any(r.startswith("pytest") for r in with_toml)


def test_missing_names_absent_and_too_old_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(installed, "requirements", lambda extra="dev": ["numpy>=1", "numpy>=999",
                                                                        "no-such-package-here>=1"])
    gaps = [g for g in installed.missing() if not g.endswith(f"not {installed.ROOT}")]
    assert len(gaps) == 2
    assert gaps[0].startswith("numpy ") and "does not satisfy >=999" in gaps[0]
    assert gaps[1] == "no-such-package-here is not installed"
