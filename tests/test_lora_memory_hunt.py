"""LoRA branches under the memory tools: their factors must travel with their block (streamed),
with their component (staged), and be counted in the planner's sizes.

On the CPU a wrong placement shows with the ``meta`` device: streaming to ``meta`` and then running
on the CPU fails if anything of the LoRA was left on ``meta`` rather than going back home.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from klein_core import testing as demo
from klein_core.lora import apply_loras, load_lora, with_loras
from klein_core.memory.placement import BlockOffloader, StagePlacer
from klein_core.memory.planner import ModelSizes
from klein_core.pipeline.sampling import position_ids, text_position_ids

logger = logging.getLogger(__name__)


def _block_linears(model: nn.Module) -> dict[str, nn.Linear]:
    out = {}
    for list_name, blocks in model.named_children():
        if isinstance(blocks, nn.ModuleList):
            for name, m in blocks.named_modules():
                if isinstance(m, nn.Linear):
                    out[f"{list_name}.{name}"] = m
    return out


def _lora(model: nn.Module, rank: int = 4, seed: int = 0):
    """A LoRA on every block Linear (BFL names); returns it and its factor bytes per block list entry."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, m in _block_linears(model).items():
        o, i = m.weight.shape
        sd[f"diffusion_model.{name}.lora_A.weight"] = torch.randn(rank, i, generator=g) * 0.05
        sd[f"diffusion_model.{name}.lora_B.weight"] = torch.randn(o, rank, generator=g) * 0.05
    return load_lora(sd)


def _inputs(cfg, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([position_ids(3, 4), position_ids(2, 2, t=10)])
    d = dict(img=torch.randn(2, ids.shape[0], cfg.in_channels, generator=g), img_ids=ids,
             txt=torch.randn(2, 5, cfg.context_dim, generator=g), txt_ids=text_position_ids(5),
             timesteps=torch.tensor([1.0, 0.5]))
    return {k: v.to(device) for k, v in d.items()}


def test_streamed_branch_factors_go_back_with_their_block():
    model = demo.tiny_transformer(seed=1)
    copy = with_loras(model, [(_lora(model), 0.8)])
    inputs = _inputs(model.config)
    with torch.no_grad():
        want = copy(**inputs)
        base = model(**inputs)
    # Blocks streamed to "meta": whatever of a block the offloader does not bring back stays there.
    with BlockOffloader(copy, "meta"), torch.no_grad():
        assert copy(**_inputs(model.config, "meta")).is_meta
    with torch.no_grad():
        assert torch.equal(copy(**inputs), want)  # was: "Cannot copy out of meta tensor"
        assert torch.equal(model(**inputs), base)


def test_branch_lora_in_place_streams_and_removes_cleanly():
    model = demo.tiny_transformer(seed=2)
    inputs = _inputs(model.config)
    with torch.no_grad():
        base = model(**inputs)
    handle = apply_loras(model, [(_lora(model, seed=5), 1.0)], mode="branch")
    with torch.no_grad():
        want = model(**inputs)
    assert not torch.equal(want, base)
    with BlockOffloader(model, "meta"), torch.no_grad():
        model(**_inputs(model.config, "meta"))
    with torch.no_grad():
        assert torch.equal(model(**inputs), want)
    handle.remove()
    assert not [n for n, _ in model.named_buffers() if "lora" in n]  # no factor left behind
    with torch.no_grad():
        assert torch.equal(model(**inputs), base)


def test_staged_branch_factors_go_back_with_their_component():
    model = demo.tiny_transformer(seed=3)
    copy = with_loras(model, [(_lora(model, seed=7), 0.5)])
    inputs = _inputs(model.config)
    with torch.no_grad():
        want = copy(**inputs)
    placer = StagePlacer("meta", {"transformer": copy}, {"transformer": "staged"})
    with placer.stage("transformer") as placed, torch.no_grad():
        placed(**_inputs(model.config, "meta"))
    with torch.no_grad():
        assert torch.equal(copy(**inputs), want)


def test_planner_sizes_count_branch_factors():
    model = demo.tiny_transformer(seed=4)
    rank = 128  # a big LoRA on every block: more bytes than the tiny model's blocks themselves
    copy = with_loras(model, [(_lora(model, rank=rank), 1.0)])
    elem = next(model.parameters()).element_size()
    per_block = []
    for blocks in (model.double_blocks, model.single_blocks):
        for b in blocks:
            per_block.append(sum(rank * (m.in_features + m.out_features) * elem
                                 for m in b.modules() if isinstance(m, nn.Linear)))
    base = ModelSizes.from_modules(model).transformer
    got = ModelSizes.from_modules(copy).transformer
    assert got.blocks == tuple(b + extra for b, extra in zip(base.blocks, per_block))
    assert got.nonblock == base.nonblock
    assert got.total == base.total + sum(per_block)
