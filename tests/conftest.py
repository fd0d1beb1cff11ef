"""Suite-wide fixtures and the two test tiers.

* ``parity`` records measured max-abs diffs. ``KLEIN_PARITY_TABLE=1`` (or ``-v``) prints them as a
  table at the end of the run; ``KLEIN_PARITY_JSON=path`` writes them as JSON. Otherwise one line
  says how many were recorded.
* Tiers: ``python -m pytest -q`` runs the default tier. The tests named in ``FULL_TIER`` (the slowest
  parity and robustness tests, measured with ``--durations``) are marked ``full`` and left out of it;
  ``python -m pytest -q -m full`` runs them alone (CI runs the default tier; this one before landing),
  ``--full`` runs everything.
  A test file or node id named on the command line always runs, whatever its tier (tests/mutants
  runs its tests that way).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from script_module import load_script

_RESULTS: dict[str, float] = {}

_TABLE_ENV = "KLEIN_PARITY_TABLE"
_JSON_ENV = "KLEIN_PARITY_JSON"


@pytest.fixture
def parity():
    """Call ``parity(name, value)`` to report a measured difference in the end-of-run table."""

    def record(name: str, value: float) -> float:
        _RESULTS[name] = float(value)
        return float(value)

    return record


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module of tiny-model tests (``pytestmark = pytest.mark.usefixtures(
    "one_torch_thread")``): tiny matrices gain nothing from threads, which contend on 2 cores."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _table_wanted(config: pytest.Config) -> bool:
    asked = os.environ.get(_TABLE_ENV, "").strip().lower()
    if asked:
        return asked not in ("0", "false", "no")
    return config.getoption("verbose") > 0


# ---------------------------------------------------------------------------------------------
# The tiers

# Node ids relative to the repository root: a module, a test (all its parameters), or one case.
# Chosen from `--durations` on a 2-core CPU; tests/gpu is never listed (it skips without CUDA).
FULL_TIER: tuple[str, ...] = (
    # the docs' python blocks at their own sizes (1024², a 50-step base run): 60-80 s on 2 cores;
    # the README's (4 s) stays in the default tier
    "tests/test_docs_snippets.py::test_python_blocks_of_the_docs_run_and_do_what_they_say[docs/python.md]",
    "tests/test_docs_snippets.py::test_python_blocks_of_the_docs_run_and_do_what_they_say[docs/inpaint.md]",
    "tests/test_docs_snippets.py::test_python_blocks_of_the_docs_run_and_do_what_they_say[docs/speed.md]",
    # the training benchmark's self-tests: every case on the CPU with the diffusers peer, and the phase
    "tests/test_train_benchmark.py::test_tiny_run_with_the_diffusers_peer",
    "tests/test_train_benchmark.py::test_gpu_session_dry_run_train",
    # training at speed compile (dynamo's eager backend), resident and streamed, against plain: 30 s
    "tests/test_train_cli.py::test_train_cli_speed_compile_with_streamed_blocks",
    # text-encoder LoRA: resume bit-exact, and the Kohya naming (the diffusers naming stays in the default tier)
    "tests/test_train_text_encoder.py::test_resume_with_a_text_encoder_lora_is_bit_exact",
    "tests/test_train_text_encoder.py::test_saved_text_encoder_lora_loads_with_the_trained_effect[kohya]",
    "tests/test_train_text_encoder.py::test_saved_text_encoder_lora_loads_with_the_trained_effect[comfyui]",
    # robustness: every bad argument, every corrupt tensor, files changed under a loaded model
    "tests/test_robustness.py::test_generate_arguments_fail_cleanly",
    "tests/test_robustness.py::test_non_finite_weights_are_named",
    "tests/test_robustness.py::test_non_finite_inputs_are_named_where_they_enter",
    "tests/test_robustness.py::test_a_loaded_model_does_not_depend_on_its_file",
    "tests/test_robustness.py::test_prompt_cache_entries_own_their_memory",
    "tests/test_robustness.py::test_cut_image_files_are_named_or_work",
    "tests/test_reliability.py::test_generate_inputs_property",
    "tests/test_reliability.py::test_fuzz_header_reader",
    # the GPU suite's assertions run on the CPU (tests/gpu itself is untouched)
    "tests/test_gpu_suite_cpu.py",
    # the opt-in step cache combined with everything else
    "tests/test_step_cache.py::test_cfg_with_two_forwards_keeps_one_state_per_pass",
    "tests/test_step_cache.py::test_composes_with_block_streaming",
    "tests/test_step_cache.py::test_composes_with_fast_paths",
    # exactness at the edges (grids, timesteps, dtypes, prompt strings) against diffusers / transformers: 18 s
    "tests/test_exactness_hunt.py",
    # slow parity of memory modes and of a full-size file header
    "tests/test_memory_wiring.py::test_generate_memory_modes_equal",
    "tests/test_real_layouts.py::test_the_official_fp8_file_starts_like_a_pickle",
    # the benchmark scripts' CPU self-tests
    "tests/test_benchmark_scripts.py",
    "tests/test_fast.py::test_speed_benchmark_tiny_cpu",
    "tests/test_planner.py::test_memory_benchmark_tiny_cpu",
    "tests/test_planner.py::test_memory_benchmark_uncapped_resident_tiny_cpu",
    # a local Ray cluster and a Ray Serve deployment (tens of seconds to start), and one replica's own tests
    "tests/test_ray_batch.py",
    "tests/test_ray_serve.py",
    "tests/test_serve_replica.py",
    # two training processes (gloo), and cache folders that cannot be written in every way
    "tests/test_train_ddp.py",
    # torch.compile (inductor, on the CPU) of the bridged native MODEL
    "tests/test_native_model.py::test_torch_compile_model_patch_runs_and_matches",
    "tests/test_prompt_cache_hostile.py::test_a_folder_that_cannot_be_written_is_one_warning",
    # the slowest of the default tier on a 2-core AMD EPYC CI machine (--durations, 2026-11-28): every
    # module imported in a fresh interpreter (21 s), compile with many models and on bridged packed
    # layers (18 s, 11 s + 7 s), tiled decodes of batches and of a pinned tile (10 s, 8 s)
    "tests/test_structure.py::test_every_module_imports_alone_in_a_fresh_interpreter_without_cuda",
    "tests/test_compile_interactions.py::test_many_models_in_one_process_all_stay_compiled",
    "tests/test_native_lora_packed.py::test_comfyui_lora_on_a_compiled_bridged_model",
    "tests/test_vae_hunt.py::test_tiled_decode_keeps_batch_images_apart_and_the_decoder_dtype",
    "tests/test_memory_wiring.py::test_a_pinned_vae_tile_decodes_in_those_tiles_and_the_result_says_which",
    # the mutant check (issue #33: "a small mutant check that the full test tier runs"): 238 mutants took
    # 281 s of a 23-minute default run on the 2-core CI machine (--durations, 2026-11-28), which left CI
    # about a minute of its 20
    "tests/test_mutants.py",
)

_TIER_STATE: dict[str, int] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true", default=False,
                     help="run the full tier too (the tests of tests/conftest.py's FULL_TIER)")


def _in_full_tier(nodeid: str) -> str | None:
    for entry in FULL_TIER:
        if nodeid == entry or nodeid.startswith(entry + "::") or nodeid.startswith(entry + "["):
            return entry
    return None


def _named_files(config: pytest.Config) -> set[Path]:
    """Files named on the command line (``tests/test_x.py`` or ``tests/test_x.py::test_y``)."""
    base = Path(config.invocation_params.dir)
    named = set()
    for arg in config.args:
        path = (base / arg.split("::", 1)[0]).resolve()
        if path.is_file():
            named.add(path)
    return named


@pytest.hookimpl(tryfirst=True)  # before -m filters on the marker added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    used: set[str] = set()
    in_full = []
    for item in items:
        entry = _in_full_tier(item.nodeid)
        if entry is not None:
            used.add(entry)
            item.add_marker(pytest.mark.full)
            in_full.append(item)
    # A whole-suite collection sees every entry; one it does not see was renamed or removed (a renamed
    # test then runs in the default tier), and the summary says so.
    suite = (config.rootpath / "tests").resolve()
    if all((Path(config.invocation_params.dir) / a).resolve() == suite for a in config.args):
        _TIER_STATE["unknown"] = [e for e in FULL_TIER if e not in used]
    if config.getoption("full") or re.search(r"\bfull\b", config.getoption("markexpr") or ""):
        return
    named = _named_files(config)
    drop = [item for item in in_full if Path(str(item.path)).resolve() not in named]
    if drop:
        dropped = set(map(id, drop))
        items[:] = [item for item in items if id(item) not in dropped]
        config.hook.pytest_deselected(items=drop)
        _TIER_STATE["left_out"] = len(drop)


def pytest_terminal_summary(terminalreporter, config):
    out = os.environ.get(_JSON_ENV)
    if out and _RESULTS:
        with open(out, "w") as fh:
            json.dump(_RESULTS, fh, indent=1, sort_keys=True)
    if _RESULTS and _table_wanted(config):
        title = "measured parity (max abs diff vs the reference unless the row names another measure)"
        terminalreporter.section(title)
        width = max(len(k) for k in _RESULTS)
        for name in sorted(_RESULTS):
            terminalreporter.write_line(f"{name:<{width}}  {_RESULTS[name]:.3e}")
    elif _RESULTS:
        where = f"written to {out}" if out else f"{_JSON_ENV}=path writes them"
        count = f"{len(_RESULTS)} value" + ("s" if len(_RESULTS) != 1 else "")
        terminalreporter.write_line(f"measured parity: {count} ({_TABLE_ENV}=1 or -v prints them; {where})")
    unknown = _TIER_STATE.get("unknown")
    if unknown:
        terminalreporter.write_line(f"tests/conftest.py FULL_TIER names tests that were not collected: "
                                    f"{unknown}", red=True)
    left_out = _TIER_STATE.get("left_out")
    if left_out:
        terminalreporter.write_line(f"full tier: {left_out} slower tests left out; "
                                    "python -m pytest -q -m full runs them, --full runs everything")


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
