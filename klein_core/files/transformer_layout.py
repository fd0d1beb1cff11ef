"""FLUX.2 transformer checkpoint layouts: BFL / ComfyUI names (the model's own) and diffusers names.

:func:`plan_transformer` detects the layout of a source (any key prefix, e.g. ComfyUI's
``model.diffusion_model.``), plans it into the model's BFL names and infers the config from the
planned shapes (no data read). :func:`diffusers_to_bfl` and :func:`bfl_to_diffusers` are the two
directions of one table (SPEC §1.5): q/k/v <-> fused qkv, and the final layer's (scale, shift) <->
(shift, scale) halves.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

import torch

from ..models.transformer import TransformerConfig
from ..models.variants import DEV_TEXT_WIDTH
from .identify import what_is
from .key_map import Cat, KeyMap, Op, SwapHalves, Take
from .source import WeightSource

logger = logging.getLogger(__name__)

_BFL_MARKERS = ("double_stream_modulation_img.lin.weight", "single_stream_modulation.lin.weight")
_DIFFUSERS_MARKERS = ("double_stream_modulation_img.linear.weight", "single_stream_modulation.linear.weight")

_DIFFUSERS_GLOBAL = {
    "x_embedder.weight": "img_in.weight",
    "context_embedder.weight": "txt_in.weight",
    "time_guidance_embed.timestep_embedder.linear_1.weight": "time_in.in_layer.weight",
    "time_guidance_embed.timestep_embedder.linear_2.weight": "time_in.out_layer.weight",
    "double_stream_modulation_img.linear.weight": "double_stream_modulation_img.lin.weight",
    "double_stream_modulation_txt.linear.weight": "double_stream_modulation_txt.lin.weight",
    "single_stream_modulation.linear.weight": "single_stream_modulation.lin.weight",
    "proj_out.weight": "final_layer.linear.weight",
}
_DIFFUSERS_DOUBLE = {
    "attn.norm_q.weight": "img_attn.norm.query_norm.scale",
    "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
    "attn.to_out.0.weight": "img_attn.proj.weight",
    "ff.linear_in.weight": "img_mlp.0.weight",
    "ff.linear_out.weight": "img_mlp.2.weight",
    "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
    "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
    "attn.to_add_out.weight": "txt_attn.proj.weight",
    "ff_context.linear_in.weight": "txt_mlp.0.weight",
    "ff_context.linear_out.weight": "txt_mlp.2.weight",
}
_DIFFUSERS_DOUBLE_QKV = {
    "img_attn.qkv.weight": ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight"),
    "txt_attn.qkv.weight": ("attn.add_q_proj.weight", "attn.add_k_proj.weight", "attn.add_v_proj.weight"),
}
_DIFFUSERS_SINGLE = {
    "attn.to_qkv_mlp_proj.weight": "linear1.weight",
    "attn.to_out.weight": "linear2.weight",
    "attn.norm_q.weight": "norm.query_norm.scale",
    "attn.norm_k.weight": "norm.key_norm.scale",
}


def _find_prefix(keys: list[str], markers: tuple[str, ...]) -> str | None:
    for k in keys:
        for m in markers:
            if k.endswith(m):
                return k[: -len(m)]
    return None


def _plan_bfl(src: WeightSource) -> KeyMap:
    return KeyMap(ops={k: Take(k) for k in src.keys()})


def diffusers_to_bfl(src: WeightSource) -> KeyMap:
    """Plan that reads a diffusers ``Flux2Transformer2DModel`` state dict into BFL names.

    q/k/v projections are concatenated into the fused ``qkv``; the final layer's (scale, shift)
    halves are swapped back to BFL's (shift, scale). Keys that fit no rule are ``unexpected``.
    """
    plan = KeyMap()
    used: set[str] = set()

    def add(name: str, op: Op) -> None:
        plan.ops[name] = op
        used.update(op.sources())

    keys = src.keys()
    for d, b in _DIFFUSERS_GLOBAL.items():
        if d in src:
            add(b, Take(d))
    if "norm_out.linear.weight" in src:
        add("final_layer.adaLN_modulation.1.weight", SwapHalves("norm_out.linear.weight"))
    doubles = sorted({int(m.group(1)) for k in keys if (m := re.match(r"transformer_blocks\.(\d+)\.", k))})
    for i in doubles:
        p = f"transformer_blocks.{i}."
        for d, b in _DIFFUSERS_DOUBLE.items():
            if p + d in src:
                add(f"double_blocks.{i}.{b}", Take(p + d))
        for b, parts in _DIFFUSERS_DOUBLE_QKV.items():
            if all(p + x in src for x in parts):
                add(f"double_blocks.{i}.{b}", Cat(tuple(p + x for x in parts)))
    singles = sorted({int(m.group(1)) for k in keys if (m := re.match(r"single_transformer_blocks\.(\d+)\.", k))})
    for i in singles:
        p = f"single_transformer_blocks.{i}."
        for d, b in _DIFFUSERS_SINGLE.items():
            if p + d in src:
                add(f"single_blocks.{i}.{b}", Take(p + d))
    plan.unexpected = [k for k in keys if k not in used]
    return plan


def bfl_to_diffusers(state: Mapping[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """A BFL-layout state dict (this module's names) in ``Flux2Transformer2DModel`` names.

    The exact inverse of :func:`diffusers_to_bfl`, from the same tables: ``qkv`` split into
    q/k/v (row views, no copy) and the final layer's (shift, scale) halves swapped to diffusers'
    (scale, shift). Used to export a model or to feed the same weights to diffusers.
    """
    out = {d: state[b] for d, b in _DIFFUSERS_GLOBAL.items()}
    shift, scale = state["final_layer.adaLN_modulation.1.weight"].chunk(2)
    out["norm_out.linear.weight"] = torch.cat([scale, shift])
    for i in range(config.depth):
        b, d = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        out.update({d + dk: state[b + bk] for dk, bk in _DIFFUSERS_DOUBLE.items()})
        for bk, parts in _DIFFUSERS_DOUBLE_QKV.items():
            out.update(zip((d + x for x in parts), state[b + bk].split(config.hidden_size)))
    for i in range(config.depth_single):
        b, d = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        out.update({d + dk: state[b + bk] for dk, bk in _DIFFUSERS_SINGLE.items()})
    return out


def plan_transformer(src: WeightSource) -> tuple[KeyMap, TransformerConfig, str, WeightSource]:
    """Detect the layout of ``src``, plan it into BFL names and infer the config.

    Returns ``(plan, config, layout, view)``: layout is ``"bfl"`` or ``"diffusers"`` and ``view``
    is ``src`` with any key prefix stripped (the source the plan reads from).
    """
    keys = src.keys()
    prefix = _find_prefix(keys, _BFL_MARKERS)
    if prefix is not None:
        view = src.strip_prefix(prefix)
        plan, layout = _plan_bfl(view), "bfl"
        # Keys outside the prefix (e.g. a VAE or text encoder bundled in an all-in-one
        # checkpoint) are not part of the transformer: report them rather than drop silently.
        others = [k for k in keys if not k.startswith(prefix)]
        if others:
            logger.warning(
                "%s: ignoring %d tensors outside the transformer prefix '%s' (e.g. %s)",
                src.name, len(others), prefix, others[0],
            )
        src = view
    else:
        prefix = _find_prefix(keys, _DIFFUSERS_MARKERS)
        if prefix is None:
            what = what_is(keys, src.shape).sentence("transformer")
            raise ValueError(f"{src.name}: not a FLUX.2 Klein transformer: it looks like {what}. Pick a Klein "
                             "transformer file such as flux-2-klein-4b.safetensors or flux-2-klein-9b.safetensors.")
        src = src.strip_prefix(prefix)
        plan, layout = diffusers_to_bfl(src), "diffusers"
    shapes = {k: op.shape(src) for k, op in plan.ops.items()}
    if any(k.startswith("guidance_in.") for k in shapes) or shapes.get("txt_in.weight", (0, 0))[1] == DEV_TEXT_WIDTH:
        raise ValueError(
            f"{src.name}: this is a FLUX.2 [dev] transformer (guidance embedder, Mistral text width "
            "15360); klein_core runs FLUX.2 Klein 4B/9B. Pick flux-2-klein-4b or flux-2-klein-9b."
        )
    required = ("img_in.weight", "txt_in.weight", "double_blocks.0.img_attn.norm.query_norm.scale",
                "double_blocks.0.img_mlp.0.weight")
    absent = [k for k in required if k not in shapes]
    if absent:
        raise ValueError(f"{src.name}: incomplete FLUX.2 transformer, missing {absent}.")
    try:
        config = TransformerConfig.from_shapes(shapes)
    except ValueError as exc:
        raise ValueError(f"{src.name}: cannot infer the transformer size: {exc}") from None
    return plan, config, layout, src
