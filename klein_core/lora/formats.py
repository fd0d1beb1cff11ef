"""LoRA key names: which Klein module a LoRA tensor belongs to, in every naming scheme in use.

A key is ``<module path>.<suffix>``: the suffix says what the tensor is (``lora_A.weight``,
``lora_down.weight``, ``alpha``, ``lokr_w1``, ``hada_w1_a``...), the path names a Linear in a scheme
of SPEC §6: BFL / ai-toolkit / ComfyUI (``diffusion_model.double_blocks.0.img_attn.qkv``, the core's
own names); diffusers / PEFT (``transformer.transformer_blocks.0.attn.to_q``, q/k/v on row thirds of
``qkv``; ``base_model.model.`` for raw PEFT); Kohya / LyCORIS (underscored paths behind ``lora_unet_``,
``lora_transformer_`` or ``lycoris_``); text encoder (``text_encoder.model.layers.0.self_attn.q_proj``,
``lora_te_model_layers_0_...`` or ComfyUI's ``text_encoders.qwen3_4b.transformer.model.layers.0...``).
String work only: :func:`resolve_module` turns a module path into a :class:`Target` (component,
module name, row part, half swap) or says why it is not applied.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..models.qwen3 import OUTPUT_LAYERS

TRANSFORMER = "transformer"
TEXT_ENCODER = "text_encoder"

# Decoder layers the Klein text encoder runs (hidden states 9/18/27 need layers 0..26).
TEXT_LAYERS_RUN = max(OUTPUT_LAYERS)
# No FLUX.2 model has more double blocks than this (Klein 9B and FLUX.2 [dev] have 8); FLUX.1 has 19.
MAX_FLUX2_DOUBLE_BLOCKS = 8

# Suffix (after the module path) -> canonical tensor role. Longest first so "lora_A.default.weight"
# wins over shorter matches; down/up are Kohya's names for A/B.
_SUFFIX_ROLES: dict[str, str] = {
    "lora_A.default.weight": "A",
    "lora_B.default.weight": "B",
    "lora_A.weight": "A",
    "lora_B.weight": "B",
    "lora_down.weight": "A",
    "lora_up.weight": "B",
    "alpha": "alpha",
    "lokr_w1": "lokr_w1",
    "lokr_w1_a": "lokr_w1_a",
    "lokr_w1_b": "lokr_w1_b",
    "lokr_w2": "lokr_w2",
    "lokr_w2_a": "lokr_w2_a",
    "lokr_w2_b": "lokr_w2_b",
    "hada_w1_a": "hada_w1_a",
    "hada_w1_b": "hada_w1_b",
    "hada_w2_a": "hada_w2_a",
    "hada_w2_b": "hada_w2_b",
    "diff": "diff",
    "dora_scale": "dora_scale",  # LyCORIS DoRA, as ComfyUI reads it: [out, 1] or [1, in]
    "lora_magnitude_vector": "magnitude",  # PEFT DoRA: [out]
    "lora_magnitude_vector.default.weight": "magnitude",
    "lora_magnitude_vector.weight": "magnitude",  # SimpleTuner / HF spelling (OneTrainer and InvokeAI read it)
}
#: The roles of a DoRA magnitude (see :attr:`klein_core.lora.patches.LoRAPatch.dora`).
DORA_ROLES = ("dora_scale", "magnitude")
# Suffixes that are recognised but never applied, with the reason reported to the user.
UNSUPPORTED_SUFFIXES: dict[str, str] = {
    "lora_A.bias": "LoRA bias terms are not supported (Klein's linears have no bias)",
    "lora_B.bias": "LoRA bias terms are not supported (Klein's linears have no bias)",
    "diff_b": "bias deltas are not supported (Klein's linears have no bias)",
    "lora_mid.weight": "Tucker-decomposed LoCon (conv layers) is not supported",
    "lokr_t2": "Tucker-decomposed LoKr (conv layers) is not supported",
    "hada_t1": "Tucker-decomposed LoHa (conv layers) is not supported",
    "hada_t2": "Tucker-decomposed LoHa (conv layers) is not supported",
    "lora_embedding_A": "LoRA on the token embedding is not supported",
    "lora_embedding_B": "LoRA on the token embedding is not supported",
}
_ALL_SUFFIXES = sorted([*_SUFFIX_ROLES, *UNSUPPORTED_SUFFIXES], key=len, reverse=True)


def split_key(key: str) -> tuple[str, str] | None:
    """``"a.b.lora_A.weight"`` -> ``("a.b", "lora_A.weight")``; None if no known suffix."""
    for suffix in _ALL_SUFFIXES:
        if key.endswith("." + suffix) and len(key) > len(suffix) + 1:
            return key[: -len(suffix) - 1], suffix
    return None


def suffix_role(suffix: str) -> str | None:
    """Canonical role of a suffix (``"A"``, ``"B"``, ``"alpha"``, ``"lokr_w1"``...) or None if unsupported."""
    return _SUFFIX_ROLES.get(suffix)


@dataclass(frozen=True)
class Target:
    """Where a LoRA module lands in the core.

    ``module``: core module name in ``component`` (``"double_blocks.0.img_attn.qkv"``). ``part``:
    ``(index, count)`` when the LoRA was trained on one of ``count`` equal row blocks of a fused
    core weight (diffusers ``to_k`` -> rows ``[D, 2D)`` of ``qkv``: ``(1, 3)``), else None.
    ``swap_halves``: the LoRA's output rows are in diffusers' final-layer order (scale, shift)
    and must be swapped to BFL's (shift, scale). ``naming``: the scheme the path was written in.
    """

    component: str
    module: str
    part: tuple[int, int] | None = None
    swap_halves: bool = False
    naming: str = "bfl"


@dataclass(frozen=True)
class Resolution:
    """Result of :func:`resolve_module`: a target, or the reason the module is not applied.

    ``kind``: ``"target"``, ``"ignored"`` (known and deliberately unused, e.g. text-encoder layers
    past 26), ``"flux1"`` (a module only FLUX.1 has) or ``"unknown"``.
    """

    kind: str
    target: Target | None = None
    reason: str = ""
    block: tuple[str, int] | None = None  # ("double"|"single", index) for transformer blocks


# (path template, core module template, part, swap halves, naming). "{i}" is a block/layer index.
_TRANSFORMER_NAMES: list[tuple[str, str, tuple[int, int] | None, bool, str]] = [
    # BFL / ai-toolkit / ComfyUI names: the core's own.
    *[(f"double_blocks.{{i}}.{n}", f"double_blocks.{{i}}.{n}", None, False, "bfl")
      for n in ("img_attn.qkv", "img_attn.proj", "img_mlp.0", "img_mlp.2",
                "txt_attn.qkv", "txt_attn.proj", "txt_mlp.0", "txt_mlp.2")],
    ("single_blocks.{i}.linear1", "single_blocks.{i}.linear1", None, False, "bfl"),
    ("single_blocks.{i}.linear2", "single_blocks.{i}.linear2", None, False, "bfl"),
    *[(n, n, None, False, "bfl")
      for n in ("img_in", "txt_in", "time_in.in_layer", "time_in.out_layer", "double_stream_modulation_img.lin",
                "double_stream_modulation_txt.lin", "single_stream_modulation.lin", "final_layer.linear")],
    # BFL-named final layer: BFL row order (shift, scale), the core's own order, so no swap.
    # ai-toolkit trains Flux2 on a BFL-layout model whose LastLayer reads (shift, scale), and
    # Kohya-style names are BFL names too. diffusers' Flux2 converter maps this module to
    # norm_out.linear without swapping (SPEC §6 caveat), i.e. diffusers puts these rows on the
    # wrong halves; this loader does not copy that.
    ("final_layer.adaLN_modulation.1", "final_layer.adaLN_modulation.1", None, False, "bfl"),
    # diffusers / PEFT names.
    ("transformer_blocks.{i}.attn.to_q", "double_blocks.{i}.img_attn.qkv", (0, 3), False, "diffusers"),
    ("transformer_blocks.{i}.attn.to_k", "double_blocks.{i}.img_attn.qkv", (1, 3), False, "diffusers"),
    ("transformer_blocks.{i}.attn.to_v", "double_blocks.{i}.img_attn.qkv", (2, 3), False, "diffusers"),
    ("transformer_blocks.{i}.attn.to_qkv", "double_blocks.{i}.img_attn.qkv", None, False, "diffusers"),
    ("transformer_blocks.{i}.attn.add_q_proj", "double_blocks.{i}.txt_attn.qkv", (0, 3), False, "diffusers"),
    ("transformer_blocks.{i}.attn.add_k_proj", "double_blocks.{i}.txt_attn.qkv", (1, 3), False, "diffusers"),
    ("transformer_blocks.{i}.attn.add_v_proj", "double_blocks.{i}.txt_attn.qkv", (2, 3), False, "diffusers"),
    ("transformer_blocks.{i}.attn.to_added_qkv", "double_blocks.{i}.txt_attn.qkv", None, False, "diffusers"),
    ("transformer_blocks.{i}.attn.to_out.0", "double_blocks.{i}.img_attn.proj", None, False, "diffusers"),
    ("transformer_blocks.{i}.attn.to_add_out", "double_blocks.{i}.txt_attn.proj", None, False, "diffusers"),
    ("transformer_blocks.{i}.ff.linear_in", "double_blocks.{i}.img_mlp.0", None, False, "diffusers"),
    ("transformer_blocks.{i}.ff.linear_out", "double_blocks.{i}.img_mlp.2", None, False, "diffusers"),
    ("transformer_blocks.{i}.ff_context.linear_in", "double_blocks.{i}.txt_mlp.0", None, False, "diffusers"),
    ("transformer_blocks.{i}.ff_context.linear_out", "double_blocks.{i}.txt_mlp.2", None, False, "diffusers"),
    ("single_transformer_blocks.{i}.attn.to_qkv_mlp_proj", "single_blocks.{i}.linear1", None, False, "diffusers"),
    ("single_transformer_blocks.{i}.attn.to_out", "single_blocks.{i}.linear2", None, False, "diffusers"),
    ("x_embedder", "img_in", None, False, "diffusers"),
    ("context_embedder", "txt_in", None, False, "diffusers"),
    ("time_guidance_embed.timestep_embedder.linear_1", "time_in.in_layer", None, False, "diffusers"),
    ("time_guidance_embed.timestep_embedder.linear_2", "time_in.out_layer", None, False, "diffusers"),
    ("double_stream_modulation_img.linear", "double_stream_modulation_img.lin", None, False, "diffusers"),
    ("double_stream_modulation_txt.linear", "double_stream_modulation_txt.lin", None, False, "diffusers"),
    ("single_stream_modulation.linear", "single_stream_modulation.lin", None, False, "diffusers"),
    ("proj_out", "final_layer.linear", None, False, "diffusers"),
    # diffusers stores the final modulation as (scale, shift): swap the LoRA's output halves.
    ("norm_out.linear", "final_layer.adaLN_modulation.1", None, True, "diffusers"),
]
# Known transformer modules that Klein does not have and that are not a sign of another model.
_TRANSFORMER_IGNORED: list[tuple[str, str]] = [
    ("guidance_in.in_layer", "Klein has no guidance embedder (FLUX.2 [dev] / FLUX.1 module)"),
    ("guidance_in.out_layer", "Klein has no guidance embedder (FLUX.2 [dev] / FLUX.1 module)"),
    ("time_guidance_embed.guidance_embedder.linear_1", "Klein has no guidance embedder (FLUX.2 [dev] module)"),
    ("time_guidance_embed.guidance_embedder.linear_2", "Klein has no guidance embedder (FLUX.2 [dev] module)"),
]
# Modules only FLUX.1 has (per-block modulation, the CLIP vector input, diffusers Flux1 single
# blocks with separate q/k/v): their presence identifies a FLUX.1 LoRA.
_FLUX1_ONLY: list[str] = [
    "double_blocks.{i}.img_mod.lin",
    "double_blocks.{i}.txt_mod.lin",
    "single_blocks.{i}.modulation.lin",
    "vector_in.in_layer",
    "vector_in.out_layer",
    "single_transformer_blocks.{i}.attn.to_q",
    "single_transformer_blocks.{i}.attn.to_k",
    "single_transformer_blocks.{i}.attn.to_v",
    "single_transformer_blocks.{i}.proj_mlp",
    "single_transformer_blocks.{i}.proj_out",
    "single_transformer_blocks.{i}.norm.linear",
    "transformer_blocks.{i}.norm1.linear",
    "transformer_blocks.{i}.norm1_context.linear",
    "transformer_blocks.{i}.ff.net.0.proj",
    "transformer_blocks.{i}.ff.net.2",
    "transformer_blocks.{i}.ff_context.net.0.proj",
    "transformer_blocks.{i}.ff_context.net.2",
    "time_text_embed.timestep_embedder.linear_1",
    "time_text_embed.timestep_embedder.linear_2",
    "time_text_embed.text_embedder.linear_1",
    "time_text_embed.text_embedder.linear_2",
]
# Qwen3 decoder linears (HF names, the core's text-encoder names).
_TEXT_NAMES = [f"layers.{{i}}.{n}" for n in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
_TEXT_UNUSED = ("lm_head", "norm")  # the final norm and LM head: Klein stops at layer 27

# Dotted prefixes in front of the module path, with the component they imply (None: either).
_DOTTED_PREFIXES: list[tuple[str, str | None]] = [
    ("base_model.model.", None),
    ("model.diffusion_model.", TRANSFORMER),
    ("diffusion_model.", TRANSFORMER),
    ("transformer.", TRANSFORMER),
    ("text_encoder.", TEXT_ENCODER),
    # ComfyUI's own names for the Klein encoders (its generic text-encoder LoRA keys)
    ("text_encoders.qwen3_4b.transformer.", TEXT_ENCODER),
    ("text_encoders.qwen3_8b.transformer.", TEXT_ENCODER),
    ("te.", TEXT_ENCODER),
]
# Underscore-joined (Kohya / LyCORIS) prefixes.
_UNDERSCORE_PREFIXES: list[tuple[str, str | None]] = [
    ("lora_unet_", TRANSFORMER),
    ("lora_transformer_", TRANSFORMER),
    ("lycoris_", None),
    ("lora_te1_", TEXT_ENCODER),
    ("lora_te_", TEXT_ENCODER),
]


def _regexes(template: str, optional_prefix: str = "") -> tuple[re.Pattern[str], re.Pattern[str]]:
    """Dotted and underscore-joined full-match patterns for a template with an ``{i}`` index."""
    head, sep, tail = template.partition("{i}")
    dotted = re.escape(head) + (r"(\d+)" if sep else "") + re.escape(tail)
    under = re.escape(head.replace(".", "_")) + (r"(\d+)" if sep else "") + re.escape(tail.replace(".", "_"))
    pre_d = f"(?:{re.escape(optional_prefix)}\\.)?" if optional_prefix else ""
    pre_u = f"(?:{re.escape(optional_prefix)}_)?" if optional_prefix else ""
    # Kohya keeps the case of module names, but some tools lowercase them: match either.
    return re.compile(pre_d + dotted), re.compile(pre_u + under, re.IGNORECASE)


_T_PATTERNS = [(_regexes(p), core, part, swap, naming) for p, core, part, swap, naming in _TRANSFORMER_NAMES]
_T_IGNORED = [(_regexes(p), reason) for p, reason in _TRANSFORMER_IGNORED]
_FLUX1_PATTERNS = [_regexes(p) for p in _FLUX1_ONLY]
_TE_PATTERNS = [(_regexes(p, "model"), p) for p in _TEXT_NAMES]
_TE_UNUSED = [_regexes(p, "model") for p in _TEXT_UNUSED]
_TE_EMBED = _regexes("embed_tokens", "model")


def strip_prefixes(path: str) -> tuple[str, str | None, bool]:
    """Remove checkpoint prefixes. Returns ``(rest, component hint, kohya)``; ``kohya`` is True
    when an underscore-style (Kohya / LyCORIS) prefix was removed."""
    hint: str | None = None
    changed = True
    while changed:  # prefixes stack, e.g. "base_model.model." + "transformer."
        changed = False
        for prefix, comp in _DOTTED_PREFIXES:
            if path.startswith(prefix) and len(path) > len(prefix):
                path, hint, changed = path[len(prefix):], comp or hint, True
                break
    for prefix, comp in _UNDERSCORE_PREFIXES:
        if path.startswith(prefix) and len(path) > len(prefix):
            return path[len(prefix):], comp or hint, True
    if path.startswith(("lora_te2_", "lora_te3_")):
        return path, "other_text_encoder", True
    return path, hint, False


def _match(pats: tuple[re.Pattern[str], re.Pattern[str]], rest: str) -> tuple[re.Match[str] | None, bool]:
    """Match the dotted form, else (for a path without dots) the underscore-joined form.
    Returns ``(match, matched_underscored)``."""
    m = pats[0].fullmatch(rest)
    if m is None and "." not in rest:
        m = pats[1].fullmatch(rest)
        return m, m is not None
    return m, False


def _legacy_alias(rest: str) -> str:
    # Some Flux2 exports write "sformer_blocks" for "transformer_blocks" (diffusers normalises it).
    return "tran" + rest if rest.startswith(("sformer_blocks.", "sformer_blocks_")) else rest


def resolve_module(path: str) -> Resolution:
    """Map a LoRA module path (the key without its suffix) to a core :class:`Target`."""
    rest, hint, kohya = strip_prefixes(path)
    if hint == "other_text_encoder":
        return Resolution("unknown", reason="a second text encoder (CLIP/T5); Klein has a single Qwen3 encoder")
    rest = _legacy_alias(rest)
    if hint in (None, TRANSFORMER):
        for pats, core, part, swap, naming in _T_PATTERNS:
            m, underscored = _match(pats, rest)
            if m:
                idx = m.group(1) if m.groups() else None
                module = core.replace("{i}", idx) if idx is not None else core
                block = None
                if idx is not None:
                    block = ("single" if core.startswith("single_") else "double", int(idx))
                    if block[0] == "double" and block[1] >= MAX_FLUX2_DOUBLE_BLOCKS:
                        return Resolution("flux1", reason=f"double block {idx}: FLUX.2 models have at most "
                                          f"{MAX_FLUX2_DOUBLE_BLOCKS} double blocks, FLUX.1 has 19", block=block)
                naming = "kohya" if kohya or underscored else naming
                return Resolution("target", Target(TRANSFORMER, module, part, swap, naming), block=block)
        for pats, reason in _T_IGNORED:
            if _match(pats, rest)[0]:
                return Resolution("ignored", reason=reason)
        for pats in _FLUX1_PATTERNS:
            if _match(pats, rest)[0]:
                return Resolution("flux1", reason="a module only FLUX.1 has")
    if hint in (None, TEXT_ENCODER):
        for pats, core in _TE_PATTERNS:
            m, underscored = _match(pats, rest)
            if m:
                layer = int(m.group(1))
                if layer >= TEXT_LAYERS_RUN:
                    return Resolution("ignored", reason=f"ignored: layer not used by Klein (text encoder layer "
                                      f"{layer}; Klein runs layers 0-{TEXT_LAYERS_RUN - 1})")
                naming = "kohya" if kohya or underscored else "peft"
                return Resolution("target", Target(TEXT_ENCODER, core.replace("{i}", str(layer)), naming=naming))
        for pats in _TE_UNUSED:
            if _match(pats, rest)[0]:
                return Resolution("ignored", reason="ignored: text-encoder module not used by Klein")
        if _match(_TE_EMBED, rest)[0]:
            return Resolution("unknown", reason="LoRA on the token embedding is not supported")
        if rest.startswith(("text_model", "encoder_block", "encoder.block", "shared")):
            return Resolution("unknown", reason="a CLIP/T5 text encoder module (SD / FLUX.1); Klein uses Qwen3")
    return Resolution("unknown", reason="no FLUX.2 Klein module has this name")


def module_hidden(component: str, module: str, out_features: int, in_features: int) -> int:
    """The model width a LoRA module of this shape implies (transformer hidden or Qwen3 hidden).

    Most linears read the hidden state (``in_features`` = hidden); embedders and output
    projections write it (``out_features`` = hidden). Used to name the model a LoRA was made for.
    """
    if component == TEXT_ENCODER:
        writes = module.endswith(("o_proj", "down_proj"))
    else:
        writes = module in ("img_in", "txt_in", "time_in.in_layer") or module.endswith(("mlp.2", "linear2"))
    return out_features if writes else in_features
