"""The mutant check of the full tier (tests/conftest.py: FULL_TIER; run before each landing): each
realistic bug of tests/mutants/catalog.py, planted in a copy of the project, must make the tests named
for it fail (tests/mutants/run.py). A survivor is a gap in the tests; an edit that no longer applies
means the code moved: update the mutant, never drop it. ``-m "not mutants"`` leaves it out of a
quick local full run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.mutants, pytest.mark.slow]


def test_every_mutant_is_caught():
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "mutants" / "run.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=1500, check=False)
    report = proc.stdout[-12000:] + proc.stderr[-3000:]
    print(report)
    assert proc.returncode == 0, report
