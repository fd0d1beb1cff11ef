"""Suite-wide fixtures. ``parity`` records measured max-abs diffs; the run ends with a table."""

from __future__ import annotations

import json
import os

import pytest

_RESULTS: dict[str, float] = {}


@pytest.fixture
def parity():
    """Call ``parity(name, value)`` to report a measured difference in the end-of-run table."""

    def record(name: str, value: float) -> float:
        _RESULTS[name] = float(value)
        return float(value)

    return record


def pytest_terminal_summary(terminalreporter):
    if not _RESULTS:
        return
    terminalreporter.section("measured parity (max abs diff vs reference)")
    width = max(len(k) for k in _RESULTS)
    for name in sorted(_RESULTS):
        terminalreporter.write_line(f"{name:<{width}}  {_RESULTS[name]:.3e}")
    out = os.environ.get("KLEIN_PARITY_JSON")
    if out:
        with open(out, "w") as fh:
            json.dump(_RESULTS, fh, indent=1, sort_keys=True)
