"""Regression tests for LoRA bugs found by hunting: each fails on the code before its fix.

References are independent of the code under test: the expected weights are the test's own
``W + strength * scale * B @ A`` in float32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from klein_core.lora import apply_loras, load_lora, with_loras
from klein_core.testing import tiny_transformer

QKV = "double_blocks.0.img_attn.qkv"
PROJ = "double_blocks.0.img_attn.proj"


def _factors(out: int, inn: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rank, inn, generator=g) * 0.3, torch.randn(out, rank, generator=g) * 0.3


def _bfl_lora(module: str, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    return {f"diffusion_model.{module}.lora_A.weight": a, f"diffusion_model.{module}.lora_B.weight": b}


@pytest.mark.parametrize("mode", ["merge", "branch"])
def test_a_tuple_of_two_loras_applies_both(mode):
    # apply_loras(model, (la, lb)): a tuple is a Sequence[LoRASpec]; it was read as the pair
    # (la, strength=lb) and failed with "float() argument must be ... not 'LoRA'".
    model = tiny_transformer().float()
    w = model.get_submodule(QKV).weight.detach().clone()
    a1, b1 = _factors(w.shape[0], w.shape[1], 2, seed=1)
    a2, b2 = _factors(w.shape[0], w.shape[1], 3, seed=2)
    la, lb = load_lora(_bfl_lora(QKV, a1, b1)), load_lora(_bfl_lora(QKV, a2, b2))
    handle = apply_loras(model, (la, lb), mode=mode)
    assert len(handle.loras) == 2
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(3))
    expected = x @ (w + b1 @ a1 + b2 @ a2).T
    got = model.get_submodule(QKV)(x)
    assert (got - expected).abs().max().item() < 1e-4
    # a tuple of a LoRA and a (LoRA, strength) pair is a sequence of two as well
    copy = with_loras(tiny_transformer().float(), (la, (lb, -0.5)))
    expected = x @ (w + b1 @ a1 - 0.5 * (b2 @ a2)).T
    assert (copy.get_submodule(QKV)(x) - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("second", ["lora_down.weight", "lora_A.default.weight"])
def test_two_spellings_of_one_factor_are_refused_not_dropped(second):
    # "x.lora_A.weight" next to "x.lora_down.weight" (or "x.lora_A.default.weight") for one module:
    # the loader kept the last one and dropped the other without listing it in LoRA.skipped.
    a1, b1 = _factors(64, 64, 2, seed=4)
    a2, _ = _factors(64, 64, 2, seed=5)
    sd = _bfl_lora(PROJ, a1, b1)
    sd[f"diffusion_model.{PROJ}.{second}"] = a2
    with pytest.raises(ValueError, match=r"lora_A\.weight' and .*both the A tensor.*two copies"):
        load_lora(sd)


def test_cli_lora_on_an_nvfp4_transformer_takes_branches(tmp_path):
    """The CLI merged a LoRA unless the transformer had GGUF layers: on an NVFP4 file it stopped with a
    traceback (NVFP4 blocks cannot take a merged LoRA exactly). It now applies branches, as for GGUF:
    the image differs from the one without the LoRA."""
    from test_nvfp4 import _nvfp4_file

    from klein_core import cli
    from klein_core.testing.tiny import tiny_transformer, write_tiny_model_files

    paths = write_tiny_model_files(tmp_path)
    for k in ("klein_base_4b", "klein_9b", "klein_9b_kv"):
        paths[k].unlink()  # one transformer in the folder: the CLI picks it
    model = tiny_transformer().float()
    _nvfp4_file(paths["klein_4b"], model, "comfy_quant")
    name = "double_blocks.0.img_attn.qkv"
    layer = model.get_submodule(name)
    g = torch.Generator().manual_seed(3)
    save_file({f"diffusion_model.{name}.lora_A.weight": torch.randn(4, layer.in_features, generator=g),
               f"diffusion_model.{name}.lora_B.weight": torch.randn(layer.out_features, 4, generator=g)},
              str(tmp_path / "l.safetensors"))
    common = ["--models-dir", str(tmp_path), "--prompt", "x", "--width", "64", "--height", "64", "--steps", "1",
              "-q"]
    assert cli.main([*common, "--out", str(tmp_path / "base.png")]) == 0
    assert cli.main([*common, "--out", str(tmp_path / "lora.png"), "--lora", str(tmp_path / "l.safetensors")]) == 0
    base = np.asarray(Image.open(tmp_path / "base.png"))
    with_lora = np.asarray(Image.open(tmp_path / "lora.png"))
    assert base.shape == with_lora.shape and not np.array_equal(base, with_lora)
