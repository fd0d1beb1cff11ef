"""The test extras (pyproject's ``test`` extra: diffusers, transformers, peft, gguf, comfy-kitchen...)
are the references the parity tests compare with. A missing one must not turn those tests into
skips that a green run hides: :func:`require` imports the module, and when it is missing fails the
test (or the whole module, at module level) with the install command. Setting
``KLEIN_ALLOW_MISSING_TEST_EXTRAS=1`` turns the failure back into a skip, for a deliberately partial
environment.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

ALLOW_ENV = "KLEIN_ALLOW_MISSING_TEST_EXTRAS"
INSTALL = 'pip install -e ".[test]"'


def missing_allowed() -> bool:
    return os.environ.get(ALLOW_ENV, "").strip().lower() not in ("", "0", "false", "no")


def require(module: str) -> ModuleType:
    """``module``, imported; if it cannot be imported, fail naming the install command (or skip
    when :data:`ALLOW_ENV` is set). Works at module level and inside tests and fixtures."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        msg = f"test extra {module!r} cannot be imported ({exc}); install the test extras: {INSTALL}"
    # outside the except block: the report shows the message, not the import's traceback chain
    if missing_allowed():
        pytest.skip(f"{msg} (skipped: {ALLOW_ENV} is set)", allow_module_level=True)
    pytest.fail(f"{msg}. To skip the tests that need it instead, set {ALLOW_ENV}=1.", pytrace=False)
