"""Fixtures for the end-to-end tests against a real ComfyUI 0.3.75 server.

* ``comfy_host_dir``: the prepared host (``.comfy_host``). Not prepared -> skip with the command to run,
  except under CI (``CI`` set and not "0"/"false"), where it fails: CI must never skip the e2e tests.
* ``e2e_models_dir``: the models folder the server sees (``diffusion_models``, ``text_encoders``,
  ``vae``, ``loras``); session-scoped and empty for now; model-making fixtures fill it before the server
  starts, or later (ComfyUI re-lists folders when their mtime changes).
* ``comfy_server``: one ``ComfyServer`` for the whole session.

Every test in this folder is marked ``e2e``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from comfy_host import MODEL_FOLDERS, ComfyServer  # noqa: E402
from setup_host import HOST_DIR, host_problem  # noqa: E402

_HERE = Path(__file__).resolve().parent


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def comfy_host_dir() -> Path:
    problem = host_problem(HOST_DIR)
    if problem is None:
        return HOST_DIR
    cmd = f"{sys.executable} tests/e2e/setup_host.py"
    msg = f"ComfyUI e2e host not ready: {problem}. Prepare it with: {cmd}"
    if _in_ci():
        pytest.fail(msg + "  (CI is set, so a missing host fails instead of skipping)", pytrace=False)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def e2e_models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("e2e_models")
    for sub in MODEL_FOLDERS:
        (root / sub).mkdir()
    return root


@pytest.fixture(scope="session")
def comfy_server(comfy_host_dir, e2e_models_dir):
    # Latent previews on (ComfyUI's default is none), so progress events carry preview images.
    srv = ComfyServer(e2e_models_dir, host_dir=comfy_host_dir, extra_args=["--preview-method", "auto"])
    try:
        srv.start()
    except Exception:
        srv.stop()
        raise
    try:
        yield srv
    finally:
        srv.stop()
