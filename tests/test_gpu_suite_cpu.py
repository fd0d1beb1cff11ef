"""The GPU suite's own logic on the CPU, in every CI run: ``tests/gpu`` is skipped without CUDA,
so its assertions, helpers and fixtures would otherwise only ever run in a GPU session (a rare,
short one). ``KLEIN_GPU_TESTS_DEVICE=cpu`` runs them with the tiny models in float32 (see
tests/gpu/conftest.py); the tests that need CUDA by nature skip there, naming why."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_suite_passes_in_cpu_mode():
    env = {**os.environ, "KLEIN_GPU_TESTS_DEVICE": "cpu", "KLEIN_GPU_TESTS_FULL": "0"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "tests/gpu"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail  # no test failed or errored
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 30, tail  # 31 when this was written; 11 skip (CUDA, full size)
