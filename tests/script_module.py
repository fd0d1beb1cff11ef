"""Import a script that is not in a package (benchmarks, the workflow generator) as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(name: str, path: Path, package_dir: Path | None = None) -> ModuleType:
    """Execute ``path`` as module ``name`` (registered in sys.modules first: dataclasses need it);
    with ``package_dir``, as the package ``name`` whose submodules are found there."""
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=[str(package_dir)] if package_dir else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
