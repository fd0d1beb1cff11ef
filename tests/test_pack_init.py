"""The pack's top-level ``__init__``: silent outside ComfyUI, one clear line in a ComfyUI too old."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import importlib.util, logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
sys.path.insert(0, sys.argv[2])  # a fake host: folder_paths and comfy, but no comfy_api
spec = importlib.util.spec_from_file_location("klein_pack", sys.argv[1] + "/__init__.py",
                                              submodule_search_locations=[sys.argv[1]])
module = importlib.util.module_from_spec(spec)
sys.modules["klein_pack"] = module
spec.loader.exec_module(module)
print("registered" if hasattr(module, "comfy_entrypoint") else "nothing registered")
"""


def _import_pack(host: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, str(REPO), str(host)], capture_output=True, text=True,
                          timeout=120)


def test_outside_comfyui_the_pack_is_silent(tmp_path):
    done = _import_pack(tmp_path)  # nothing of ComfyUI on the path
    assert done.returncode == 0 and done.stdout.strip() == "nothing registered" and "ERROR" not in done.stderr


def test_a_comfyui_without_the_v3_api_is_named_once(tmp_path):
    (tmp_path / "folder_paths.py").write_text("")
    (tmp_path / "comfy").mkdir()
    (tmp_path / "comfy" / "__init__.py").write_text("")
    done = _import_pack(tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "nothing registered"
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and "need ComfyUI 0.3.75 or newer" in errors[0] and "Update ComfyUI" in errors[0]
