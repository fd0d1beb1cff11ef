"""The package's shape: every module imports on its own, no import cycles, no private names across modules.

Imports are read from the source (every ``import`` statement, including those inside functions,
which is how cycles used to be hidden), so a cycle fails here even when it happens to work at run
time. The nodes use klein_core's public names only: the top level's, or a module's own public names.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "klein_core"


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(CORE.rglob("*.py"))}


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """Absolute name of a (possibly relative) import target."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports(name: str, path: Path, known: set[str]) -> list[tuple[str, list[str], int]]:
    """``(imported module, names taken from it, line)`` for every klein_core import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("klein_core"):
                    out.append((alias.name, [], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_package, node.level, node.module)
            if not base.startswith("klein_core"):
                continue
            names = [a.name for a in node.names]
            # "from . import x" may import a submodule x.
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
            if subs:
                out += [(s, [], node.lineno) for s in subs]
                names = [n for n in names if f"{base}.{n}" not in known]
            if names or not subs:
                out.append((base, names, node.lineno))
    return out


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    mods = _modules()
    known = set(mods)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    private = []
    for name, path in mods.items():
        for target, names, line in _imports(name, path, known):
            if target not in known:
                continue
            if target != name:
                graph[name].add(target)
            same_package = target.rsplit(".", 1)[0] == name.rsplit(".", 1)[0] or target.startswith(name + ".")
            for n in names:
                if n.startswith("_") and not n.startswith("__") and not same_package:
                    private.append(f"{name} (line {line}) imports private '{n}' from {target}")
    return graph, private


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph, _ = _graph()
    assert _cycles(graph) == []


def test_the_cycle_detector_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_private_names_across_modules():
    _, private = _graph()
    assert private == []


def test_nodes_use_only_public_names():
    """``kc.<name>`` only for names in ``klein_core.__all__``; anything else from the module that has it
    (``from klein_core.<module> import <name>``), never a private name."""
    import importlib
    import inspect

    import klein_core

    offenders = []
    for path in sorted((REPO / "nodes").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            where = f"{path.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("klein_core"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if alias.name.startswith("_"):
                        offenders.append(f"{where} imports the private name {alias.name} from {node.module}")
                    elif not hasattr(module, alias.name):
                        offenders.append(f"{where} {node.module} has no {alias.name}")
                    elif (node.module == "klein_core" and alias.name not in klein_core.__all__
                          and not inspect.ismodule(getattr(module, alias.name))):
                        offenders.append(f"{where} {alias.name} is not in klein_core.__all__")
            elif isinstance(node, ast.Import):
                offenders += [f"{where} import {a.name} (use from {a.name} import ...)" for a in node.names
                              if a.name.startswith("klein_core.")]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "kc":
                if node.attr not in klein_core.__all__ and node.attr != "__version__":
                    offenders.append(f"{where} kc.{node.attr} is not in klein_core.__all__")
    assert offenders == []


def test_every_module_imports_alone_in_a_fresh_interpreter_without_cuda():
    """Each module imported with no other klein_core module loaded (so no import order hides a
    problem), in a fresh interpreter, and importing never
    initialises CUDA."""
    names = [m for m in _modules() if not m.endswith("__main__")]
    code = (
        "import importlib, sys, torch\n"
        "for name in sys.argv[1:]:\n"
        "    for loaded in [m for m in sys.modules if m.startswith('klein_core')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
        "    assert not torch.cuda.is_initialized(), name\n"
        "print('ok', len(sys.argv) - 1)\n"
    )
    # Two interpreters, each importing every other module (~0.3 s each, most of it the chain below
    # it): the whole list in one took 25-30 s on 2 cores.
    halves = [names[0::2], names[1::2]]
    runs = [subprocess.Popen([sys.executable, "-c", code, *half], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for half in halves]
    for half, run in zip(halves, runs, strict=True):
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        assert out.strip() == f"ok {len(half)}"
