"""The public API is deliberate: ``klein_core.__all__`` is frozen here and described in docs/api.md.

Adding a name to the top level means adding it to ``PUBLIC`` below and a line to docs/api.md; anything
else is imported from the module that defines it.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import klein_core

REPO = Path(__file__).resolve().parents[1]
API_DOC = REPO / "docs" / "api.md"

PUBLIC = [
    "COMFYUI_TEXT",
    "Conditioning",
    "DiskPromptCache",
    "Engine",
    "Flux2Transformer",
    "Flux2VAE",
    "GenerationCancelled",
    "GenerationRequest",
    "GenerationResult",
    "KleinOutOfMemory",
    "LoRA",
    "NonFiniteWeights",
    "PromptCache",
    "Qwen3Config",
    "Qwen3TextEncoder",
    "Settings",
    "TextOptions",
    "TransformerConfig",
    "VAEConfig",
    "WeightFormatError",
    "apply_loras",
    "generate",
    "load_lora",
    "load_text_encoder",
    "load_transformer",
    "load_vae",
    "with_loras",
]


def test_public_names_are_frozen():
    assert PUBLIC == sorted(PUBLIC)
    assert sorted(klein_core.__all__) == PUBLIC, "a change to klein_core.__all__ must be deliberate: update PUBLIC"
    assert len(set(klein_core.__all__)) == len(klein_core.__all__)


def test_every_public_name_resolves():
    namespace: dict[str, object] = {}
    exec("from klein_core import *", namespace)  # what a star import gives is exactly __all__
    assert sorted(n for n in namespace if n != "__builtins__") == PUBLIC
    for name in PUBLIC:
        assert getattr(klein_core, name) is namespace[name]


def test_public_names_come_from_their_modules():
    """Each public object is the one its module holds under the same name (the top level only re-exports)."""
    for name in PUBLIC:
        obj = getattr(klein_core, name)
        module = obj.__module__  # COMFYUI_TEXT, an instance, gives its class's module, which also holds it
        assert module.startswith("klein_core."), (name, module)
        assert getattr(importlib.import_module(module), name) is obj, (name, module)


@pytest.mark.parametrize("alias", ["resolve_settings", "TEXT_ENCODER_FOR_WIDTH"])
def test_removed_aliases_are_gone(alias):
    assert not hasattr(klein_core, alias)


def test_klein_core_fast_is_gone():
    code = ("import importlib, sys\n"
            "try:\n"
            "    importlib.import_module('klein_core.fast')\n"
            "except ModuleNotFoundError as exc:\n"
            "    print('gone', exc.name)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "gone klein_core.fast"
    assert not (REPO / "klein_core" / "fast.py").exists()


def test_the_removed_aliases_have_their_replacements():
    from klein_core.accel import enable_fast_paths
    from klein_core.models.variants import VARIANTS, encoder_for_text_width
    from klein_core.pipeline.request import resolve

    assert callable(resolve) and callable(enable_fast_paths)
    assert all(encoder_for_text_width(v.text_width) for v in VARIANTS)


def test_every_public_name_is_documented():
    text = API_DOC.read_text()
    documented = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)[`(]", text))
    missing = [name for name in PUBLIC if name not in documented]
    assert missing == [], f"describe these in docs/api.md: {missing}"
