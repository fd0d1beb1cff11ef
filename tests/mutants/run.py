"""Mutant check: plant each realistic bug of :mod:`catalog` in a copy of the project and require that
the tests named for it fail.

    python tests/mutants/run.py              # every mutant; exit status 1 if one is not caught
    python tests/mutants/run.py --list       # the catalog
    python tests/mutants/run.py --only NAME  # some of them (repeatable)

How: the project (everything but virtual environments, caches and build outputs) is copied into a
temporary folder, once per worker. The tests named by the catalog first run there unmutated (the
baseline: they must pass, or a "caught" mutant would prove nothing). Then, one mutant at a time per
worker, its exact text edit is applied to the copy, its tests run there with ``pytest -x``, and the
file is restored. ``klein_core`` is imported from the copy (its root is the working directory and
first on ``sys.path``; checked before the first run).

Each run is a fresh pytest process. On Linux it is forked from this process after the heavy
third-party imports (torch, diffusers, transformers, peft...), which are not under test, so a run
costs its tests, not those imports; klein_core and the tests are never imported here. Elsewhere (or
with ``--spawn``) each run is a new interpreter.

An edit must match its file exactly once and leave valid Python; otherwise the mutant is reported
``not applied`` naming the file and the text, so a refactor can never silently retire a mutant:
update its ``old`` text. Outcomes: ``caught`` (a named test failed or errored, or the run hung),
``survived`` (they all passed: a gap in the tests), ``not applied``, ``broken`` (pytest found no
such test, or could not run), ``skipped`` (its tests skipped, e.g. the node tests without the
prepared ComfyUI host: like the suite, a failure under CI). Only ``caught`` and ``skipped`` pass.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from catalog import MUTANTS, Mutant  # noqa: E402

# Top-level entries never copied (and these names anywhere below).
SKIP_TOP = {".git", ".venv", "venv", ".comfy_host", "out", "build", "dist", ".whl"}
SKIP_ANY = ("__pycache__", "*.pyc", "*.egg-info", ".pytest_cache", ".whl_ck*")
# --assert=plain and no unraisableexception plugin: a run only has to pass or fail, and those two cost
# ~1.1 s of every run's ~2.4 s (assertion rewriting of the test modules, which may not cache bytecode
# here, and a full gc.collect of the forked heap at exit).
PYTEST_ARGS = ["-x", "-q", "-p", "no:cacheprovider", "-p", "no:unraisableexception", "--assert=plain", "--no-header",
               "-o", "addopts=-rfEs"]
TIMEOUT_S = 300  # one mutant's tests; a hang counts as caught (the suite would never finish)
# Imported once before forking: third-party only (klein_core and the tests must come from the copy).
WARM = ("numpy", "torch", "PIL.Image", "safetensors.torch", "pytest", "hypothesis", "gguf", "peft",
        "transformers.models.qwen3.modeling_qwen3", "diffusers.models.transformers.transformer_flux2",
        "diffusers.models.autoencoders.autoencoder_kl_flux2", "diffusers.pipelines.flux2.pipeline_flux2_klein",
        "diffusers.pipelines.flux2.pipeline_flux2_klein_inpaint",
        "diffusers.pipelines.flux2.pipeline_flux2_klein_kv")


@dataclass
class Outcome:
    mutant: Mutant
    status: str  # caught | survived | not applied | broken | skipped
    detail: str
    seconds: float


class EditError(Exception):
    pass


def mutated_source(m: Mutant, text: str) -> str:
    """The file text with the mutant's edit, or :class:`EditError` saying why it does not apply."""
    n = text.count(m.old)
    if n != 1:
        raise EditError(f"{m.file}: the text to replace occurs {n} times (must be exactly once): {m.old!r}. "
                        "The code changed: update this mutant's old text (and its tests) to the new code.")
    new = text.replace(m.old, m.new)
    try:
        compile(new, m.file, "exec")
    except SyntaxError as exc:
        raise EditError(f"{m.file}: the mutated file is not valid Python ({exc.msg}, line {exc.lineno})") from None
    return new


def copy_project(dest: Path) -> Path:
    for entry in ROOT.iterdir():
        if entry.name in SKIP_TOP or entry.name.endswith(".egg-info") or entry.name == "__pycache__":
            continue
        target = dest / entry.name
        if entry.is_dir():
            shutil.copytree(entry, target, ignore=shutil.ignore_patterns(*SKIP_ANY), symlinks=True)
        elif entry.is_file():
            shutil.copy2(entry, target)
    return dest


def env_changes(copy: Path, threads: int | None) -> dict[str, str]:
    """What a run's environment differs in (its subprocesses see the copy too)."""
    pythonpath = os.environ.get("PYTHONPATH")
    env = {"PYTHONPATH": os.pathsep.join([str(copy), *([pythonpath] if pythonpath else [])]),
           "PYTHONDONTWRITEBYTECODE": "1"}  # a restored file must never meet a mutant's cached bytecode
    host = ROOT / ".comfy_host"
    if "KLEIN_E2E_HOST_DIR" not in os.environ and host.exists():
        env["KLEIN_E2E_HOST_DIR"] = str(host)  # the node tests find the prepared ComfyUI host
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


@dataclass
class Slot:
    """A worker: its own copy of the project and environment."""

    copy: Path
    env: dict[str, str]
    threads: int | None
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.copy.parent / f"{self.copy.name}.log"


class Run:
    """One pytest run (or import check) in a slot: forked from this process, or a new interpreter."""

    def __init__(self, slot: Slot, tests: tuple[str, ...], fork: bool, check_import: bool = False) -> None:
        self.slot, self.t0 = slot, time.perf_counter()
        sys.stdout.flush()
        sys.stderr.flush()
        if fork:
            self.proc = None
            self.pid = os.fork()
            if self.pid == 0:  # the child never returns
                _child(slot, tests, check_import)
        else:
            with open(slot.log, "w") as out:
                if check_import:
                    args = ["-c", "import klein_core, sys; sys.stdout.write(klein_core.__file__)"]
                else:
                    args = ["-m", "pytest", *PYTEST_ARGS, *tests]
                self.proc = subprocess.Popen([sys.executable, *args], cwd=slot.copy,
                                             env={**os.environ, **slot.env}, stdout=out, stderr=subprocess.STDOUT)

    def poll(self) -> int | None:
        if self.proc is not None:
            return self.proc.poll()
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        return None if pid == 0 else os.waitstatus_to_exitcode(status)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        else:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)

    def wait(self, timeout: float = TIMEOUT_S) -> int | None:
        while (rc := self.poll()) is None:
            if time.perf_counter() - self.t0 > timeout:
                self.kill()
                return None
            time.sleep(0.05)
        return rc

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def output(self) -> str:
        try:
            return self.slot.log.read_text(errors="replace")
        except OSError:
            return ""


def _child(slot: Slot, tests: tuple[str, ...], check_import: bool) -> None:
    code = 3
    try:
        fd = os.open(slot.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.chdir(slot.copy)
        os.environ.update(slot.env)
        sys.dont_write_bytecode = True
        sys.path.insert(0, str(slot.copy))
        if slot.threads and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(slot.threads)
        if check_import:
            import klein_core

            sys.stdout.write(klein_core.__file__)
            code = 0
        else:
            import pytest

            code = int(pytest.main([*PYTEST_ARGS, *tests]))
    except BaseException:  # noqa: BLE001 (the child must always exit here)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _first_failure(output: str) -> str:
    m = re.search(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", output, re.M)
    return m.group(1) if m else "(collection error)"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skipped(output: str) -> str | None:
    """The first skip reason when any selected test skipped (a skip can neither catch a mutant nor
    prove the baseline), else None."""
    if not re.search(r"\b\d+ skipped\b", output):
        return None
    m = re.search(r"^SKIPPED .*$", output, re.M)
    return m.group(0) if m else "some selected tests were skipped"


def classify(m: Mutant, rc: int | None, output: str, seconds: float) -> Outcome:
    if rc == 0 and (why := skipped(output)):  # as the suite does: a skip fails only under CI
        return Outcome(m, "broken" if in_ci() else "skipped", f"its tests skipped instead of running: {why}",
                       seconds)
    if rc is None:
        return Outcome(m, "caught", f"the tests hung (killed after {TIMEOUT_S} s)", seconds)
    if rc in (1, 2):  # tests failed, or the mutated code broke collection (an import-time error)
        return Outcome(m, "caught", _first_failure(output), seconds)
    if rc == 0:
        return Outcome(m, "survived", f"{', '.join(m.tests)}: all passed", seconds)
    return Outcome(m, "broken", f"pytest exit status {rc}:\n{output[-3000:]}", seconds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="run only this mutant (repeatable)")
    ap.add_argument("--list", action="store_true", help="print the catalog and exit")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="mutants run at once, each in its own copy (default: 2, or 1 on one core)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the selected tests")
    ap.add_argument("--spawn", action="store_true", help="a new interpreter per run instead of forking")
    args = ap.parse_args(argv)

    names = [m.name for m in MUTANTS]
    dupes = sorted({n for n in names if names.count(n) > 1})
    unknown = sorted(set(args.only) - set(names))
    if dupes or unknown:
        print(f"mutant check: duplicate names in the catalog {dupes}" if dupes else
              f"mutant check: no mutant named {unknown}; see --list")
        return 2
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name}\n  {m.file}: {m.old!r} -> {m.new!r}\n  caught by: {' '.join(m.tests)}\n  {m.why}")
        return 0

    fork = hasattr(os, "fork") and sys.platform.startswith("linux") and not args.spawn
    if fork:
        for name in WARM:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 (a missing extra fails in the tests themselves)
                pass
        if any(n == "klein_core" or n.startswith("klein_core.") for n in sys.modules):
            print("mutant check: klein_core was imported before forking; the runs would not see the mutants")
            return 2
    jobs = max(1, min(args.jobs, len(mutants)))
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="klein_mutants_") as tmp:
        slots = []
        for i in range(jobs):
            copy = copy_project(Path(tmp) / f"copy{i}")
            slots.append(Slot(copy, env_changes(copy, 1 if jobs > 1 else None), 1 if jobs > 1 else None))
        for slot in slots:
            check = Run(slot, (), fork, check_import=True)
            rc, where = check.wait(120), check.output().strip()
            imported = Path(where.splitlines()[-1] if where else "/").resolve()
            if rc != 0 or slot.copy.resolve() not in imported.parents:
                print(f"mutant check: klein_core is not imported from the copy {slot.copy} "
                      f"(got {where[-2000:]!r}); the tests would not see the mutants")
                return 2
        if not args.no_baseline:
            tests = list(dict.fromkeys(t for m in mutants for t in m.tests))
            runs = [Run(slot, tuple(tests[i::jobs]), fork) for i, slot in enumerate(slots) if tests[i::jobs]]
            for run in runs:
                rc = run.wait()
                if rc == 0 and (why := skipped(run.output())):
                    print(f"mutant check: selected tests skip instead of running ({why}); the mutants they "
                          "should catch are reported skipped (under CI: a failure)", flush=True)
                if rc != 0:
                    print(f"mutant check: the selected tests fail WITHOUT any mutant (exit status {rc}, "
                          f"{run.seconds:.0f} s); fix them first.\n{run.output()[-4000:]}")
                    return 1
            print(f"baseline: {len(tests)} test selections pass unmutated "
                  f"({time.perf_counter() - t_start:.1f} s with the copies)", flush=True)

        outcomes: dict[str, Outcome] = {}
        pending, free = list(mutants), list(slots)
        running: list[tuple[Mutant, Run, Path, str]] = []

        def report(o: Outcome) -> None:
            outcomes[o.mutant.name] = o
            first = o.detail.splitlines()[0] if o.detail else ""
            print(f"{o.status:>11}  {o.mutant.name:<36} {o.seconds:5.1f} s  {first}", flush=True)

        while pending or running:
            while pending and free:
                m = pending.pop(0)
                slot = free[-1]
                path = slot.copy / m.file
                try:
                    original = path.read_text()
                    path.write_text(mutated_source(m, original))
                except (OSError, EditError) as exc:
                    report(Outcome(m, "not applied", str(exc), 0.0))
                    continue
                free.pop()
                running.append((m, Run(slot, m.tests, fork), path, original))
            for item in list(running):
                m, run, path, original = item
                rc = run.poll()
                if rc is None and run.seconds <= TIMEOUT_S:
                    continue
                if rc is None:
                    run.kill()
                running.remove(item)
                path.write_text(original)
                free.append(run.slot)
                report(classify(m, rc, run.output(), run.seconds))
            time.sleep(0.05)

    results = [outcomes[m.name] for m in mutants]
    bad = [o for o in results if o.status not in ("caught", "skipped")]
    caught = sum(o.status == "caught" for o in results)
    n_skipped = sum(o.status == "skipped" for o in results)
    print(f"\n{caught} of {len(results)} mutants caught{f', {n_skipped} skipped' if n_skipped else ''} in "
          f"{time.perf_counter() - t_start:.0f} s ({jobs} at a time, {'forked' if fork else 'new interpreters'})")
    for o in bad:
        print(f"\n{o.status.upper()}: {o.mutant.name} ({o.mutant.file})\n"
              f"  edit: {o.mutant.old!r} -> {o.mutant.new!r}\n  tests: {' '.join(o.mutant.tests)}\n  {o.detail}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
