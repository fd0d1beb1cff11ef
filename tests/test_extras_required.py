"""tests/extras.py: a missing test extra fails loudly with the install command, and skips only when
KLEIN_ALLOW_MISSING_TEST_EXTRAS is set; every test extra of pyproject.toml is importable here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from extras import ALLOW_ENV, INSTALL, require

ROOT = Path(__file__).resolve().parents[1]
# pyproject's distribution names -> the modules they install
MODULES = {"comfy-kitchen": "comfy_kitchen", "pytest": "pytest", "hypothesis": "hypothesis", "gguf": "gguf",
           "transformers": "transformers", "diffusers": "diffusers", "accelerate": "accelerate", "peft": "peft", "ray": "ray",
           "aiohttp": "aiohttp", "packaging": "packaging", "bitsandbytes": "bitsandbytes"}


def test_a_missing_extra_fails_naming_the_install_command(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(pytest.fail.Exception, match=re.escape(INSTALL)):
        require("klein_no_such_module_for_this_test")


def test_a_missing_extra_skips_only_when_allowed(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "1")
    with pytest.raises(pytest.skip.Exception, match=ALLOW_ENV):
        require("klein_no_such_module_for_this_test")
    monkeypatch.setenv(ALLOW_ENV, "0")
    with pytest.raises(pytest.fail.Exception):
        require("klein_no_such_module_for_this_test")


def test_every_test_extra_is_installed():
    block = re.search(r"^test = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    assert block, "pyproject.toml has no test extra"
    names = [re.split(r"[<>=!~ ;\[]", spec, maxsplit=1)[0] for spec in re.findall(r'"([^"]+)"', block.group(1))]
    assert "diffusers" in names and "peft" in names
    assert set(names) <= set(MODULES), f"map the new test extra(s) {set(names) - set(MODULES)} to their module"
    for name in names:
        require(MODULES[name])
