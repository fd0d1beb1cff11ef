"""Hunt of packaging, installation and import: what a user gets from the ways the README installs the
pack (a clone in ``ComfyUI/custom_nodes`` with ``requirements.txt``, ``pip install`` of the
``klein-nodes`` distribution, a built wheel) and from ``import klein_core``.

Looked at, and found sound (the ``Pinned:`` tests keep the parts no other test covers): the wheel
(and the wheel built from the sdist, checked by hand) holds every ``klein_core`` module, the Qwen3
vocabulary files the tokenizer reads through ``importlib.resources`` (also from a zipped wheel),
the LICENSE, and a ``klein-generate`` script that resolves; importing every ``klein_core`` module
from the installed wheel without any optional extra changes no torch, logging, warnings or
environment state, prints nothing, opens no socket and starts no CUDA; every command's ``--help``
works without the extras, and a missing extra is named with its install command only when used
(Ray: tests/test_ray_batch.py; bitsandbytes: tests/test_train_extras.py; a GGUF file given to
``kc.load_transformer``, ``--transformer`` or ``train``: checked by hand, the documented hint); the version agrees between pyproject.toml, ``klein_core.__version__``
(PNG ``Software`` and provenance), the wheel's metadata and CHANGELOG's newest release;
requirements.txt asks for what pyproject.toml does. The root ``__init__.py`` registers the eleven
nodes when ComfyUI 0.3.75's own ``load_custom_node`` loads the pack from a folder named like a GitHub
zip (``klein-nodes-main``) under a path with a dot in it (checked by hand: ComfyUI names the module
after the whole path with dots replaced, and the relative imports hold; about 11 s, so not a test).

Found (``Was a bug:`` tests, failing until fixed, fixed since): ``klein_core`` does not import on Python 3.10, which
pyproject.toml and the README support; ``klein-generate --models-dir`` with a GGUF transformer and
no ``gguf`` package says there is no transformer, or no text encoder for it, instead of the install
command docs/troubleshooting.md promises.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "klein_core"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))

# The optional extras (pyproject's gguf / kernels / ray / train, the parity references) and Triton:
# none of them may be needed to import klein_core or to ask any command for --help.
EXTRAS = ("gguf", "comfy_kitchen", "ray", "bitsandbytes", "transformers", "diffusers", "peft", "accelerate",
          "triton")
GGUF_HINT = "this is a GGUF file; reading it needs the 'gguf' package: pip install gguf"


def _module_names(root: Path) -> list[str]:
    """Every importable module of the ``klein_core`` under ``root`` (not ``__main__``, which runs the CLI)."""
    names = []
    for path in sorted((root / "klein_core").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


def _run(code: str, *args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=str(cwd), capture_output=True, text=True,
                          timeout=240, env=env, check=False)


# ---------------------------------------------------------------------------------------------
# The wheel: built once, from a copy of what it is built from (nothing is written into the repository)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("wheel_src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(CORE, src / "klein_core", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path_factory.mktemp("wheel_dist")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "--disable-pip-version-check", "-w", str(dist), str(src)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    wheels = list(dist.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _dist_info(zf: zipfile.ZipFile, name: str) -> str:
    (path,) = [n for n in zf.namelist() if re.fullmatch(r"klein_nodes-[^/]+\.dist-info/" + re.escape(name), n)]
    return zf.read(path).decode("utf-8")


def test_the_wheel_holds_every_module_the_tokenizer_files_and_the_script(wheel):
    """Pinned: ``pip install klein-nodes`` (or a wheel built from the checkout) installs every file
    ``klein_core`` has (a subpackage without ``__init__.py`` or left out of ``packages.find`` would be
    missing), the Qwen3 vocabulary the tokenizer reads at run time (package data, not code), the
    LICENSE, nothing else at the top level, and its one console script, ``klein-generate`` (that it
    resolves from the installed wheel: the next test)."""
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = _dist_info(zf, "entry_points.txt")
        top_level = _dist_info(zf, "top_level.txt")
    source = {p.relative_to(REPO).as_posix() for p in CORE.rglob("*")
              if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    assert sorted(source - names) == []
    assert {"klein_core/data/qwen3/vocab.json", "klein_core/data/qwen3/merges.txt"} <= names
    assert any(re.fullmatch(r"klein_nodes-[^/]+\.dist-info/licenses/LICENSE", n) for n in names)
    assert sorted(n for n in names if not n.startswith(("klein_core/", "klein_nodes-"))) == []
    assert top_level.split() == ["klein_core"]
    assert PYPROJECT["project"]["scripts"] == {"klein-generate": "klein_core.cli:main"}
    assert entry_points.split() == ["[console_scripts]", "klein-generate", "=", "klein_core.cli:main"]


def test_the_installed_wheel_imports_clean_and_helps_without_the_optional_extras(wheel, tmp_path):
    """Pinned: the wheel as installed (unpacked, first on the path, away from the checkout), none of the
    optional extras importable: every ``klein_core`` module imports; importing them prints nothing,
    logs nothing, opens no socket, starts no CUDA and leaves torch's global settings, the root logger,
    ``klein_core``'s loggers, the warnings filters, the environment, ``sys.path``, the signal handlers
    and the thread count as they were; the tokenizer builds from the installed package data; and
    ``--help`` of the default command and of ``generate``, ``batch``, ``serve`` and ``train`` shows its
    usage and exits 0; the ``klein-generate`` console script, resolved from the installed metadata as
    pip's launcher does, is that same ``main``."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    report = tmp_path / "report.json"
    code = r"""
import contextlib, io, json, logging, os, signal, socket, sys, threading, warnings
report, blocked, modules = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
for name in blocked:
    sys.modules[name] = None  # "import <name>" raises ImportError, as when the extra is not installed
sockets = []
def refuse(*a, **k):
    sockets.append(repr(a[:2]))
    raise OSError("no network in this test")
socket.socket.connect = socket.getaddrinfo = socket.create_connection = refuse
import numpy, PIL.Image, safetensors.torch, tokenizers, torch  # noqa: F401 (the required packages, as they are)

def state():
    cuda, cudnn = torch.backends.cuda, torch.backends.cudnn
    return repr(dict(
        dtype=torch.get_default_dtype(), threads=torch.get_num_threads(), interop=torch.get_num_interop_threads(),
        matmul=torch.get_float32_matmul_precision(), tf32=cuda.matmul.allow_tf32, cudnn_tf32=cudnn.allow_tf32,
        bf16_reduced=cuda.matmul.allow_bf16_reduced_precision_reduction,
        fp16_reduced=cuda.matmul.allow_fp16_reduced_precision_reduction, benchmark=cudnn.benchmark,
        cudnn_det=cudnn.deterministic, deterministic=torch.are_deterministic_algorithms_enabled(),
        sdp=(cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled()),
        grad=torch.is_grad_enabled(), anomaly=torch.is_anomaly_enabled(),
        root=(logging.getLogger().level, list(logging.getLogger().handlers)), disable=logging.root.manager.disable,
        last_resort=logging.lastResort, filters=list(warnings.filters), showwarning=warnings.showwarning,
        env=dict(os.environ), path=list(sys.path), threads_alive=threading.active_count(),
        signals=[signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)], excepthook=sys.excepthook))

before = state()
out, err = io.StringIO(), io.StringIO()
records = []
class Keep(logging.Handler):
    def emit(self, record):
        if record.name.split(".")[0] == "klein_core":
            records.append(f"{record.name}: {record.getMessage()}")
keep = Keep(logging.DEBUG)
logging.getLogger().addHandler(keep)
level = logging.getLogger().level
logging.getLogger().setLevel(logging.DEBUG)
failed = []
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    import importlib
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
logging.getLogger().setLevel(level)
logging.getLogger().removeHandler(keep)
after = state()
import klein_core
ours = {n: (lg.level, [type(h).__name__ for h in lg.handlers if not isinstance(h, logging.NullHandler)])
        for n, lg in logging.root.manager.loggerDict.items()
        if n.split(".")[0] == "klein_core" and isinstance(lg, logging.Logger)}
from klein_core.pipeline.tokenizer import get_tokenizer
vocab = get_tokenizer().get_vocab_size(with_added_tokens=True)
from klein_core.cli import main
from importlib.metadata import distribution
dist = distribution("klein-nodes")
(script,) = [ep for ep in dist.entry_points if ep.group == "console_scripts"]
installed_here = os.path.samefile(dist.locate_file(""), os.path.dirname(os.path.dirname(klein_core.__file__)))
entry = [script.name, script.load() is main, installed_here, dist.version, klein_core.__version__]
helps = {}
for argv in (["--help"], ["generate", "--help"], ["batch", "--help"], ["serve", "--help"], ["train", "--help"]):
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    helps[" ".join(argv)] = [code, text.getvalue()[:7]]
json.dump(dict(failed=failed, changed=[before, after] if before != after else [], out=out.getvalue(),
               err=err.getvalue(), records=records, sockets=sockets, cuda=torch.cuda.is_initialized(),
               file=klein_core.__file__, ours={k: v for k, v in ours.items() if v != (0, [])},
               vocab=vocab, helps=helps, entry=entry), open(report, "w"))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    done = _run(code, str(report), ",".join(EXTRAS), *_module_names(site), cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (done.stdout, done.stderr) == ("", "")
    got = json.loads(report.read_text())
    assert Path(got["file"]).resolve() == (site / "klein_core" / "__init__.py").resolve()  # the wheel, not the checkout
    assert got["failed"] == []
    assert got["changed"] == []
    assert (got["out"], got["err"], got["records"], got["sockets"]) == ("", "", [], [])
    assert got["cuda"] is False
    assert got["ours"] == {}  # no level set, no handler added to klein_core's loggers
    assert got["vocab"] == 151669  # 151,643 BPE tokens and the 26 added ones, from the installed vocab.json
    assert got["helps"] == {k: [0, "usage: "] for k in ("--help", "generate --help", "batch --help", "serve --help",
                                                         "train --help")}
    version = PYPROJECT["project"]["version"]
    assert got["entry"] == ["klein-generate", True, True, version, version]


def test_versions_and_requirements_agree(wheel):
    """Pinned: one version everywhere a user reads it: pyproject.toml, ``klein_core.__version__`` (what
    PNGs' ``Software`` text and the provenance record carry), the built wheel's metadata and the newest
    release heading of CHANGELOG.md; and requirements.txt (what a ComfyUI install runs) asks for
    pyproject's dependencies with the same versions and markers, less torch (the host's) and plus
    the ``gguf`` extra at its version."""
    from packaging.requirements import Requirement

    version = PYPROJECT["project"]["version"]
    (assigned,) = [node.value for node in ast.parse((CORE / "__init__.py").read_text(encoding="utf-8")).body
                   if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__version__"]]
    assert ast.literal_eval(assigned) == version
    with zipfile.ZipFile(wheel) as zf:
        assert re.search(rf"^Version: {re.escape(version)}$", _dist_info(zf, "METADATA"), re.MULTILINE)
    releases = re.findall(r"^## \[([^\]]+)\]", (REPO / "CHANGELOG.md").read_text(encoding="utf-8"), re.MULTILINE)
    assert next(r for r in releases if r != "Unreleased") == version

    def spec(req: Requirement) -> tuple:
        return req.name.lower(), str(req.specifier), str(req.marker) if req.marker else None

    lines = [ln.split("#", 1)[0].strip() for ln in (REPO / "requirements.txt").read_text().splitlines()]
    wanted = sorted(spec(Requirement(ln)) for ln in lines if ln)
    deps = [spec(Requirement(d)) for d in PYPROJECT["project"]["dependencies"]]
    (gguf,) = [spec(Requirement(d)) for d in PYPROJECT["project"]["optional-dependencies"]["gguf"]]
    assert wanted == sorted([d for d in deps if d[0] != "torch"] + [gguf])


# ---------------------------------------------------------------------------------------------
# Python 3.10


def test_klein_core_imports_on_python_3_10_without_typing_self():
    """Was a bug: klein_core/checks.py:19 does ``from typing import NoReturn, Self``; ``typing.Self`` exists
    only from Python 3.11 (the rest of the package takes ``Self`` from ``typing_extensions``, and
    klein_core/distributed/manifest.py:111 says "typing.Self needs Python 3.11; 3.10 is supported").
    pyproject.toml says ``requires-python = ">=3.10"`` and the README "Python 3.10+", but on 3.10
    ``import klein_core`` (every module: the top level imports ``checks`` through ``lora``) fails with
    ``ImportError: cannot import name 'Self' from 'typing'``, so neither the nodes nor the CLI start.
    Should: import on 3.10 (``from typing_extensions import Self``, as lora/apply.py does).

    3.10's ``typing`` is stood in for by one without the names 3.11 added (checked against a real
    3.10.13: ``from typing import NoReturn, Self`` raises there), installed before klein_core imports."""
    code = r"""
import importlib, sys, traceback, types, typing
import numpy, PIL.Image, safetensors.torch, tokenizers, torch, typing_extensions  # noqa: F401 (as they are)
ADDED_IN_3_11 = {"LiteralString", "Never", "NotRequired", "Required", "Self", "TypeVarTuple", "Unpack",
                 "assert_never", "assert_type", "clear_overloads", "dataclass_transform", "get_overloads",
                 "reveal_type"}
py310 = types.ModuleType("typing")
py310.__dict__.update({k: v for k, v in vars(typing).items() if k not in ADDED_IN_3_11})
sys.modules["typing"] = py310
failed = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        failed.append(f"{name}: {type(exc).__name__}: {exc} ({where.filename}:{where.lineno})")
print("\n".join(failed) or "ok")
"""
    done = _run(code, *_module_names(REPO), cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    failed = done.stdout.strip().splitlines()
    assert failed == ["ok"], f"{len(failed)} modules do not import on Python 3.10; the first: {failed[0]}"


# ---------------------------------------------------------------------------------------------
# A GGUF model without the gguf package


def test_models_dir_gguf_transformer_without_gguf_names_the_install(tmp_path):
    """Was a bug: klein_core/cli.py ``resolve_files`` / ``_pick`` classify the files of ``--models-dir`` with
    ``files.identify.probe``, which reads a GGUF header through the ``gguf`` package and, when that
    is missing, swallows the loader's install hint (a ``WeightFormatError``) and calls the file
    "unreadable or not safetensors / GGUF". So ``klein-generate --models-dir M --model x.gguf`` (the
    README's command with a GGUF file, in a plain ``pip install klein-nodes`` without the ``[gguf]``
    extra) ends in ``error: no text encoder in M/text_encoders fits x.gguf (unreadable or not
    safetensors / GGUF); it needs one with text width None``, and without ``--model`` in ``no
    transformer in M/diffusion_models (it has x.gguf)``: both false (the matching encoder is there,
    and the file is a Klein transformer), and the fix is not named. docs/troubleshooting.md promises
    for "a GGUF file without the gguf package (plain Python installs)": "this is a GGUF file; reading
    it needs the 'gguf' package: pip install gguf" (what ``--transformer x.gguf`` and
    ``kc.load_transformer`` do say). Should: exit 2 with that hint naming the file, before anything
    loads (e.g. let ``probe``'s caller raise the loader's hint for a GGUF file when ``gguf`` cannot be
    imported, instead of treating it as not a model)."""
    models = tmp_path / "models"
    gguf_file = models / "diffusion_models" / "flux-2-klein-4b-F16.gguf"
    out = tmp_path / "out.png"
    common = ["--prompt", "a fox", "--width", "64", "--height", "64", "--steps", "1", "--device", "cpu",
              "--out", str(out), "-q"]
    named = ["--models-dir", str(models), "--model", gguf_file.name, *common]
    default = ["--models-dir", str(models), *common]
    code = r"""
import contextlib, io, json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])  # tests/, for gguf_files
import torch
from gguf_files import write_gguf
from klein_core import cli
from klein_core.testing import tiny_transformer
from klein_core.testing.tiny import write_tiny_model_files
models, gguf_file, argvs = Path(sys.argv[2]), Path(sys.argv[3]), json.loads(sys.argv[4])
write_tiny_model_files(models)
for f in (models / "diffusion_models").glob("*.safetensors"):
    f.unlink()
state = tiny_transformer().state_dict()
write_gguf(gguf_file, {k: (v.to(torch.float32).numpy(), "F32" if v.ndim == 1 else "F16") for k, v in state.items()},
           None)
# Control, with gguf installed: the file is the Klein transformer and pairs with qwen_3_4b.
control = []
for argv in argvs:
    tr, te, _ = cli.resolve_files(cli.build_parser().parse_args(argv))
    control.append([tr.name, te.name])
sys.modules["gguf"] = None  # from here on "import gguf" fails, as in an install without the [gguf] extra
runs = []
for argv in argvs:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(argv)
    runs.append([code, err.getvalue().strip()])
print(json.dumps([control, runs]))
"""
    done = _run(code, str(REPO / "tests"), str(models), str(gguf_file), json.dumps([named, default]), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    control, runs = json.loads(done.stdout)
    assert control == [[gguf_file.name, "qwen_3_4b.safetensors"]] * 2
    wrong = [f"{argv}: exit {code}, {err!r}"
             for argv, (code, err) in zip(("--model " + gguf_file.name, "no --model"), runs, strict=True)
             if not (code == 2 and GGUF_HINT in err and gguf_file.name in err)]
    assert wrong == [], f"klein-generate --models-dir with a GGUF model and no gguf package: {wrong}"
    assert not out.exists()
