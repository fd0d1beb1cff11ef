"""Suite-wide fixtures. ``parity`` records measured max-abs diffs; the run ends with a table."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from script_module import load_script

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
    terminalreporter.section("measured parity (max abs diff vs the reference unless the row names another measure)")
    width = max(len(k) for k in _RESULTS)
    for name in sorted(_RESULTS):
        terminalreporter.write_line(f"{name:<{width}}  {_RESULTS[name]:.3e}")
    out = os.environ.get("KLEIN_PARITY_JSON")
    if out:
        with open(out, "w") as fh:
            json.dump(_RESULTS, fh, indent=1, sort_keys=True)


# ---------------------------------------------------------------------------------------------
# The pack's nodes inside the prepared ComfyUI host, in this process (unit tests of the nodes)

PACK = "klein_pack_nodes"  # never the top-level name ``nodes``: ComfyUI has its own ``nodes`` module
_REPO = Path(__file__).resolve().parents[1]


_load_by_path = load_script  # tests/script_module.py


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def comfy_pack():
    """``nodes/`` imported as ``klein_pack_nodes`` with ComfyUI 0.3.75's modules (``--cpu``).

    Without the prepared host (``python tests/e2e/setup_host.py``) the tests skip, except under CI,
    where they fail. sys.path is restored at the end of the session.
    """
    setup = _load_by_path("klein_unit_setup_host", _REPO / "tests" / "e2e" / "setup_host.py")
    problem = setup.host_problem(setup.HOST_DIR)
    if problem is not None:
        msg = f"ComfyUI host not ready: {problem}. Prepare it with: {sys.executable} tests/e2e/setup_host.py"
        if _in_ci():
            pytest.fail(msg + "  (CI is set, so a missing host fails instead of skipping)", pytrace=False)
        pytest.skip(msg)
    paths = setup.host_paths(setup.HOST_DIR)
    host_dir = str(paths["comfyui"])
    # The torchvision stub, as the e2e server has it on PYTHONPATH: comfy.model_patcher's imports
    # reach modules that import torchvision (used only by models the pack never touches).
    stub = str(paths["stub"])
    added = [p for p in (str(_REPO), host_dir, stub) if p not in sys.path]
    sys.path.extend(added)  # appended: nothing of the repo is shadowed
    argv = sys.argv
    try:
        sys.argv = [argv[0], "--cpu"]  # before any comfy import, or model_management probes CUDA
        import comfy.options

        comfy.options.enable_args_parsing()
        import comfy.cli_args
        import comfy.model_management
        import comfy.utils
        import folder_paths
    finally:
        sys.argv = argv
    pack = sys.modules.get(PACK) or _load_by_path(PACK, _REPO / "nodes" / "__init__.py", _REPO / "nodes")
    try:
        yield SimpleNamespace(pack=pack, mm=comfy.model_management, utils=comfy.utils, args=comfy.cli_args,
                              folder_paths=folder_paths)
    finally:
        for p in added:
            sys.path.remove(p)
