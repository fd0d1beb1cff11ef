"""How the pack starts inside ComfyUI when something around it is unusual (found by a bug hunt).

Two copies of the pack in ``custom_nodes`` (an old clone left next to a new one): there is one
``klein_core`` per process, so the second copy's nodes would silently run on the first copy's core.
The second copy must register nothing and say so in one line.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A fake ComfyUI with the V3 API: ``comfy_api.latest`` with just what nodes/__init__ imports is
# enough, since the second copy must stop before importing its nodes (and the first copy's nodes
# are never imported here: only klein_core is, as the first copy's nodes would).
CHILD = r"""
import importlib.util, logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
sys.path.insert(0, sys.argv[1])  # the fake host
def load(name, folder):
    spec = importlib.util.spec_from_file_location(name, folder + "/__init__.py", submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
for folder in sys.argv[2:]:
    name = folder.rstrip("/").rsplit("/", 1)[-1]
    if name == "first":  # the first copy as ComfyUI leaves it: its klein_core imported (by its nodes)
        sys.path.insert(0, folder)
        import klein_core
        print("first core", klein_core.__file__)
        continue
    module = load(name, folder)
    print(name, "registered" if hasattr(module, "comfy_entrypoint") else "nothing registered")
"""


def _fake_host(root: Path) -> Path:
    host = root / "host"
    api = host / "comfy_api" / "latest"
    api.mkdir(parents=True)
    (host / "comfy_api" / "__init__.py").write_text("")
    (api / "__init__.py").write_text("class ComfyExtension:\n    pass\n\nclass io:\n    ComfyNode = object\n")
    (host / "folder_paths.py").write_text("")
    (host / "comfy").mkdir()
    (host / "comfy" / "__init__.py").write_text("")
    return host


def _copy_pack(dest: Path) -> Path:
    """The pack's start-up files and core (not its nodes: the check runs before they import)."""
    dest.mkdir(parents=True)
    shutil.copy(REPO / "__init__.py", dest / "__init__.py")
    shutil.copytree(REPO / "klein_core", dest / "klein_core", ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "nodes").mkdir()
    # Importing these nodes fails loudly: a copy that gets this far has not been stopped.
    (dest / "nodes" / "__init__.py").write_text("raise RuntimeError('second copy imported its nodes')\n")
    return dest


def _run(host: Path, *folders: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, str(host), *map(str, folders)], capture_output=True,
                          text=True, timeout=120, cwd=str(host), check=False)


def test_a_second_copy_of_the_pack_registers_nothing_and_names_both_folders(tmp_path):
    host = _fake_host(tmp_path)
    first = _copy_pack(tmp_path / "custom_nodes_a" / "first")
    (first / "nodes" / "__init__.py").write_text("comfy_entrypoint = object()\n")
    second = _copy_pack(tmp_path / "custom_nodes_b" / "klein_second")
    # ComfyUI setups (and the e2e host) link the pack into custom_nodes: the same files through a
    # symlink are the same copy and still register.
    (tmp_path / "custom_nodes_c").mkdir()
    link = tmp_path / "custom_nodes_c" / "klein_linked"
    link.symlink_to(first, target_is_directory=True)
    done = _run(host, first, second, link)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "klein_second nothing registered" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "klein_linked registered" in done.stdout, done.stdout + done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert str(second) in errors[0] and str(first) in errors[0] and "Keep one copy" in errors[0]
