"""Writing a trained LoRA: diffusers/PEFT names (what ``klein_core.load_lora`` and diffusers'
``load_lora_weights`` read) or Kohya names, with the training facts in the metadata.

A double block's ``qkv`` LoRA is stored as diffusers' ``to_q``/``to_k``/``to_v`` (one factor pair
each, :class:`~klein_core.train.adapters.LoRALayer` parts); every other module maps one to one.
Kohya names are kohya's FLUX ones (``lora_unet_double_blocks_0_img_attn_qkv``, a fused ``qkv`` as
one pair), which diffusers' and ComfyUI's Kohya readers map.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..files.atomic import atomic_path
from ..models.variants import encoder_name
from .adapters import LoRALayer, LoRASet

logger = logging.getLogger(__name__)

FORMATS: tuple[str, ...] = ("diffusers", "kohya", "comfyui")
_DOUBLE = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "img_attn.proj": ("attn.to_out.0",), "txt_attn.proj": ("attn.to_add_out",),
    "img_mlp.0": ("ff.linear_in",), "img_mlp.2": ("ff.linear_out",),
    "txt_mlp.0": ("ff_context.linear_in",), "txt_mlp.2": ("ff_context.linear_out",),
}
_SINGLE = {"linear1": ("attn.to_qkv_mlp_proj",), "linear2": ("attn.to_out",)}


def diffusers_names(core: str, parts: int) -> tuple[str, ...]:
    """diffusers module paths of one core module's parts (``double_blocks.0.img_attn.qkv``, 3 ->
    ``transformer_blocks.0.attn.to_q``, ``...to_k``, ``...to_v``)."""
    m = re.fullmatch(r"(double|single)_blocks\.(\d+)\.(.+)", core)
    table = _DOUBLE if m and m.group(1) == "double" else _SINGLE
    if m is None or m.group(3) not in table:
        raise ValueError(f"no diffusers name for core module {core!r}")
    names = table[m.group(3)]
    if len(names) != parts:
        raise ValueError(f"{core}: {parts} LoRA parts, diffusers has {len(names)} modules for it")
    prefix = "transformer_blocks" if m.group(1) == "double" else "single_transformer_blocks"
    return tuple(f"{prefix}.{m.group(2)}.{n}" for n in names)


def check_format_names(lora: LoRASet, fmt: str) -> None:
    """Raise ValueError if ``fmt`` has no key names for a module ``lora`` adapts (diffusers' names
    cover the double and single blocks' linears only): called before training, not when saving."""
    if fmt != "diffusers":
        return
    for core, layer in lora.items():
        try:
            diffusers_names(core, layer.parts)
        except ValueError as exc:
            raise ValueError(f"{exc}: the diffusers naming holds the double and single blocks' linears only; save "
                             f"in the kohya or comfyui naming (--format / fmt), or leave {core} out of the "
                             "targets") from None


# (dotted prefix, Kohya prefix) of each component's keys
_PREFIXES = {"transformer": ("transformer.", "lora_unet_"), "text_encoder": ("text_encoder.", "lora_te_")}


def _put_pair(out: dict[str, torch.Tensor], component: str, path: str, layer: LoRALayer, part: int, fmt: str,
              dtype: torch.dtype) -> None:
    """Factor pair ``part`` of ``layer`` under module ``path``: ``<prefix><path>.lora_A/B.weight``
    (diffusers) or ``<kohya prefix><path with _>.lora_down/lora_up.weight`` and ``.alpha`` (Kohya)."""
    a = layer.down[part].detach().to("cpu", dtype).contiguous()
    b = layer.up[part].detach().to("cpu", dtype).contiguous()
    dotted, kohya = _PREFIXES[component]
    if fmt == "diffusers":
        out[f"{dotted}{path}.lora_A.weight"] = a
        out[f"{dotted}{path}.lora_B.weight"] = b
    else:
        key = kohya + path.replace(".", "_")
        out[f"{key}.lora_down.weight"] = a
        out[f"{key}.lora_up.weight"] = b
        out[f"{key}.alpha"] = torch.tensor(layer.scale * layer.rank, dtype=torch.float32)


def _put_kohya_fused(out: dict[str, torch.Tensor], core: str, layer: LoRALayer, dtype: torch.dtype) -> None:
    """The transformer module ``core`` under Kohya's FLUX names, ``lora_unet_<core module with _>``
    (``lora_unet_double_blocks_0_img_attn_qkv``): what kohya's FLUX LoRAs, diffusers' Flux2 Kohya
    reader and ComfyUI's ``lora_unet_`` key map use. Underscored diffusers paths
    (``lora_unet_transformer_blocks_0_attn_to_q``) are read by neither, so a file in them loaded
    nothing outside this pack. A fused ``qkv``'s q/k/v pairs become one pair (A stacked, B
    block-diagonal, rank 3r) with alpha = scale * 3r, the same delta; diffusers splits it back."""
    key = "lora_unet_" + core.replace(".", "_")
    down = layer.down.detach().reshape(-1, layer.down.shape[-1])
    up = torch.block_diag(*layer.up.detach().unbind(0))
    out[f"{key}.lora_down.weight"] = down.to("cpu", dtype).contiguous()
    out[f"{key}.lora_up.weight"] = up.to("cpu", dtype).contiguous()
    out[f"{key}.alpha"] = torch.tensor(layer.scale * down.shape[0], dtype=torch.float32)


def _comfyui_tensors(lora: LoRASet, text_lora: LoRASet | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """BFL / ComfyUI names: ``diffusion_model.<core module>.lora_A/B.weight`` (the scale in B), and
    ``text_encoders.qwen3_4b.transformer.model.<core module>...`` (``qwen3_8b`` for Qwen3-8B): the keys
    ComfyUI's own LoRA loaders map to its FLUX.2 model and Klein text encoders. A double block's
    q/k/v factor pairs become one pair for the fused ``qkv`` (A stacked, B block-diagonal: rank 3r,
    the same delta)."""
    out: dict[str, torch.Tensor] = {}

    def put(key: str, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        # No alpha keys (diffusers' reader of these names refuses them): the scale is folded into B,
        # and every reader takes a missing alpha as scale 1.
        out[f"{key}.lora_A.weight"] = a.detach().to("cpu", dtype).contiguous()
        out[f"{key}.lora_B.weight"] = (b.detach().float() * scale).to("cpu", dtype).contiguous()

    for core, layer in lora.items():
        put(f"diffusion_model.{core}", layer.down.reshape(-1, layer.down.shape[-1]),
            torch.block_diag(*layer.up.unbind(0)), layer.scale)
    if text_lora is not None:
        # ComfyUI names the encoder by size: the hidden size is the input width of q/k/v, gate and up
        hidden = next((layer.down.shape[-1] for core, layer in text_lora.items()
                       if core.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))), 0)
        clip = "qwen3_8b" if encoder_name(hidden) == "Qwen3-8B" else "qwen3_4b"
        for core, layer in text_lora.items():
            put(f"text_encoders.{clip}.transformer.model.{core}", layer.down[0], layer.up[0], layer.scale)
    return out


def lora_state_dict(lora: LoRASet, fmt: str = "diffusers", dtype: torch.dtype = torch.float32, *,
                    text_lora: LoRASet | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, extra metadata)`` of the LoRA in ``fmt`` (:data:`FORMATS`). diffusers: ``transformer.
    <path>.lora_A/B.weight`` and a PEFT ``lora_adapter_metadata`` (r, lora_alpha, rank/alpha
    patterns); Kohya: ``lora_unet_<core module with _>.lora_down/lora_up.weight`` and ``.alpha``
    (:func:`_put_kohya_fused`).
    ComfyUI: BFL names (:func:`_comfyui_tensors`), which ComfyUI's own LoRA loaders, diffusers and
    the pack read. ``text_lora``: a text-encoder LoRA stored beside it (``text_encoder.model.layers...``,
    ``lora_te_model_layers_...`` or ``text_encoders.qwen3_4b.transformer.model.layers...``; diffusers'
    Flux2 pipelines load the transformer part only)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if fmt == "comfyui":
        return _comfyui_tensors(lora, text_lora, dtype), {}
    tensors: dict[str, torch.Tensor] = {}
    te_ranks: dict[str, int] = {}
    te_alphas: dict[str, float] = {}
    for core, layer in text_lora.items() if text_lora is not None else ():
        if layer.parts != 1:
            raise ValueError(f"text encoder module {core}: {layer.parts} LoRA parts, expected 1")
        _put_pair(tensors, "text_encoder", f"model.{core}", layer, 0, fmt, dtype)  # transformers' module path
        te_ranks[f"model.{core}"], te_alphas[f"model.{core}"] = layer.rank, layer.scale * layer.rank
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    if fmt == "kohya":
        for core, layer in lora.items():
            _put_kohya_fused(tensors, core, layer, dtype)
        return tensors, {}
    for core, layer in lora.items():
        for p, path in enumerate(diffusers_names(core, layer.parts)):
            ranks[path], alphas[path] = layer.rank, layer.scale * layer.rank
            _put_pair(tensors, "transformer", path, layer, p, fmt, dtype)
    meta: dict[str, str] = {}
    if fmt == "diffusers":
        # One PEFT config per component, prefixed as diffusers' save_lora_weights does ("transformer.r",
        # "text_encoder.r"). The text encoder's is needed too: its keys carry no alpha, so without it a
        # text-encoder alpha other than its rank was read back at scale 1.
        config = {f"transformer.{k}": v for k, v in _peft_config(ranks, alphas).items()}
        if te_ranks:
            config.update({f"text_encoder.{k}": v for k, v in _peft_config(te_ranks, te_alphas).items()})
        meta["lora_adapter_metadata"] = json.dumps(config)
    return tensors, meta


def _peft_config(ranks: Mapping[str, int], alphas: Mapping[str, float]) -> dict[str, object]:
    """A PEFT ``LoraConfig`` dict for modules with these ranks and alphas: the most common of each as
    ``r`` / ``lora_alpha``, the others as full-path rank / alpha patterns."""
    r = max(set(ranks.values()), key=list(ranks.values()).count)
    alpha = max(set(alphas.values()), key=list(alphas.values()).count)
    return {"r": r, "lora_alpha": alpha, "target_modules": sorted(ranks), "peft_type": "LORA",
            "rank_pattern": {k: v for k, v in ranks.items() if v != r},
            "alpha_pattern": {k: v for k, v in alphas.items() if v != alpha},
            "use_rslora": False, "use_dora": False, "lora_dropout": 0.0, "bias": "none",
            "init_lora_weights": True}


def save_lora(path: str | os.PathLike, lora: LoRASet, *, fmt: str = "diffusers",
              metadata: Mapping[str, object] | None = None, dtype: torch.dtype = torch.float32,
              text_lora: LoRASet | None = None) -> Path:
    """Write the LoRA (and ``text_lora``, a text-encoder LoRA, if given) to ``path`` (a
    ``.safetensors`` file, written to a temporary name then moved). ``metadata``: training facts
    (base model identity, steps, dataset hash...), stored as ``klein.<key>`` strings along with the
    ranks and targets of every group."""
    path = Path(path)
    tensors, meta = lora_state_dict(lora, fmt, dtype, text_lora=text_lora)
    meta["klein.format"] = f"klein-lora/1 ({fmt} names)"
    meta["klein.targets"] = json.dumps(lora.config.description)
    meta["klein.ranks"] = json.dumps({name: layer.rank for name, layer in lora.items()})
    if text_lora is not None:
        meta["klein.text_encoder_targets"] = json.dumps(text_lora.config.description)
        meta["klein.text_encoder_ranks"] = json.dumps({name: layer.rank for name, layer in text_lora.items()})
    for k, v in (metadata or {}).items():
        meta[f"klein.{k}"] = v if isinstance(v, str) else json.dumps(v)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:  # an interrupted or failed write keeps the file that was there
        save_file(tensors, str(tmp), metadata=meta)
    logger.info("saved LoRA (%d tensors, %s names) to %s", len(tensors), fmt, path)
    return path
