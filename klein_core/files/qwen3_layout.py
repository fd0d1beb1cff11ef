"""Qwen3 checkpoint layouts: ComfyUI / Hugging Face files, prefixed all-in-one checkpoints, shards.

Every layout is viewed with Hugging Face ``Qwen3ForCausalLM`` names (``model.layers.N...``) by
:func:`normalise_keys`; :func:`qwen3_key_map` then maps them onto the encoder's names and marks
layers 27 and above, the final norm and ``lm_head`` as ignored, so they are never read.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ..models.qwen3 import LAYER_KEY, OUTPUT_LAYERS
from .identify import what_is
from .key_map import KeyMap, build_key_map
from .source import WeightSource

logger = logging.getLogger(__name__)

COMPONENT = "text encoder"
# The key that identifies a Qwen3 decoder (QK-norm is what sets Qwen3 apart from Qwen2/Llama).
_DETECT_SUFFIX = "layers.0.self_attn.q_norm.weight"
# Keys of a full Qwen3ForCausalLM that Klein never needs; they are planned as ignored, never read.
_UNUSED_KEYS = frozenset({"model.norm.weight", "lm_head.weight", "model.lm_head.weight"})


def _add_prefix(src: WeightSource, prefix: str) -> WeightSource:
    infos = {prefix + k: src.info(k) for k in src.keys()}
    return WeightSource(src.name, infos, lambda k: src.get(k[len(prefix) :]), src.metadata)


def normalise_keys(src: WeightSource) -> WeightSource:
    """A view of ``src`` with Hugging Face ``Qwen3ForCausalLM`` key names (``model.layers.N...``,
    ``lm_head.weight``), whatever checkpoint prefix the file uses."""
    found = sorted(k[: -len(_DETECT_SUFFIX)] for k in src.keys() if k.endswith(_DETECT_SUFFIX))
    if not found:
        raise ValueError(
            f"{src.name}: expected a Qwen3 text encoder (Qwen3-4B for Klein 4B, Qwen3-8B for Klein 9B; "
            f"keys like 'model.{_DETECT_SUFFIX}'), but this looks like "
            f"{what_is(src.keys(), src.shape).sentence('text_encoder')}. Pick the "
            "Qwen3 file, e.g. text_encoders/qwen_3_4b.safetensors."
        )
    if len(found) > 1:
        raise ValueError(
            f"{src.name}: holds several Qwen3 decoders (key prefixes {found}); cannot choose one."
        )
    (prefix,) = found
    if prefix == "model." or prefix.endswith(".model."):
        outer, inner = prefix[: -len("model.")], "model."
    else:  # a bare Qwen3Model export: "layers.N..." without the "model." level
        outer, inner = prefix, ""
    if outer:
        logger.info("%s: reading the Qwen3 text encoder under key prefix '%s'", src.name, outer)
        src = src.strip_prefix(outer)
    return src if inner else _add_prefix(src, "model.")


def _is_unused(key: str) -> bool:
    if key in _UNUSED_KEYS or key.endswith("rotary_emb.inv_freq"):
        return True
    m = LAYER_KEY.match(key)
    return m is not None and int(m.group(1)) >= max(OUTPUT_LAYERS)


def _rename(key: str) -> str | None:
    return key[len("model.") :] if key.startswith("model.") else None


def qwen3_key_map(src: WeightSource) -> KeyMap:
    """Plan for a source with HF keys (``model.embed_tokens.weight``, ``model.layers.N...``): every
    key maps to the same name without ``model.``; layers >= 27, ``model.norm`` and ``lm_head`` go to
    ``plan.ignored`` and are never read."""
    return build_key_map(src, _rename, ignore=_is_unused)


def hf_config_path(folder: Path) -> Path | None:
    """The ``config.json`` that :func:`read_hf_config` reads for ``folder`` (a repo root's
    ``text_encoder/`` one first), or None."""
    for path in (folder / "text_encoder" / "config.json", folder / "config.json"):
        if path.is_file():
            return path
    return None


def read_hf_config(folder: Path) -> dict[str, Any] | None:
    path = hf_config_path(folder)
    if path is None:
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the text encoder config ({exc}).") from None


def checkpoint_shapes(
    hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, vocab: int = 151936,
    *, num_layers: int = 36, lm_head: bool = True,
) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a full Qwen3 checkpoint in the Hugging Face / ComfyUI file layout
    (``model.``-prefixed, all ``num_layers`` layers, final norm, optional ``lm_head``).

    For writing test or benchmark files and meta-device configs with the real key names.
    """
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (intermediate, hidden),
            p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
        }
    if lm_head:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes
