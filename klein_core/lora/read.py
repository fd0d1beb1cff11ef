"""LoRA / LyCORIS adapters for FLUX.2 Klein: read, map onto the core's modules, apply, remove.

* :func:`load_lora` reads a ``.safetensors`` LoRA (pickles refused), works out its format (diffusers /
  PEFT, ai-toolkit / BFL, Kohya, LyCORIS LoKr / LoHa, text encoder) and maps it into a :class:`LoRA`:
  one :class:`LoRAPatch` per adapted module, and every key not applied with the reason.
* :func:`apply_loras` merges LoRAs into the weights (float32, written back in the weight dtype) or
  adds them as output branches; :meth:`AppliedLoRAs.remove` restores the model exactly.
* :func:`with_loras` returns a patched copy sharing every tensor with the untouched input.

A LoRA for another model is refused naming both sizes (Klein 9B vs 4B); a FLUX.1 LoRA is named so.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..checks import is_finite
from ..files.safetensors import open_safetensors
from .formats import (
    DORA_ROLES,
    TEXT_ENCODER,
    TRANSFORMER,
    UNSUPPORTED_SUFFIXES,
    Target,
    resolve_module,
    split_key,
    strip_prefixes,
    suffix_role,
)
from .patches import LoRA, LoRAPatch, as_matrix, log_skipped

logger = logging.getLogger(__name__)

_LOKR_ROLES = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
_LOHA_ROLES = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")


def _read_source(
    source: str | os.PathLike | Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
) -> tuple[str, dict[str, torch.Tensor], dict[str, str]]:
    if isinstance(source, Mapping):
        tensors = {}
        for k, v in source.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"<in-memory LoRA>: value for '{k}' is {type(v).__name__}, not a torch.Tensor")
            tensors[str(k)] = v
        _check_finite("<in-memory LoRA>", tensors)
        return "<in-memory LoRA>", tensors, dict(metadata or {})
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"the LoRA source must be a file or folder path (str or Path) or a state dict, got "
                        f"{type(source).__name__}")
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"LoRA file not found: {path}")
    if path.is_dir():  # a diffusers save folder holds one pytorch_lora_weights.safetensors
        files = sorted(path.glob("*.safetensors"))
        if len(files) != 1:
            raise ValueError(f"{path}: expected one .safetensors LoRA file in this folder, found {len(files)}.")
        path = files[0]
    # The one safetensors reader (pickles and other formats are refused by what they are). Not
    # weights.open_weights: it refuses files with quantisation-style keys, which do not apply to
    # LoRA factors (they are read as float32 anyway).
    f = open_safetensors(path, "LoRA")
    tensors = {k: f.read(k) for k in f.tensors}
    file_meta = dict(f.metadata)
    _check_finite(str(path), tensors)
    return str(path), tensors, {**file_meta, **dict(metadata or {})}


def _check_finite(name: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """LoRAs are small: every float tensor is checked once, where it enters, so a NaN is named here
    and not later as a broken image."""
    for key, t in tensors.items():
        if not is_finite(t):
            raise ValueError(f"{name}: tensor '{key}' contains NaN or infinite values; the LoRA file is corrupt. "
                             "Download it again or use another LoRA.")


def _peft_configs(name: str, metadata: Mapping[str, str]) -> dict[str | None, dict[str, Any]]:
    """PEFT ``LoraConfig`` dicts from diffusers' ``lora_adapter_metadata``, per component.

    diffusers prefixes each entry with the component (``"transformer.r"``); PEFT's own
    ``save_pretrained`` does not (key None: applies to every component).
    """
    raw = metadata.get("lora_adapter_metadata")
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}: 'lora_adapter_metadata' is not valid JSON ({exc}).") from None
    if not isinstance(data, dict):
        raise TypeError(f"{name}: 'lora_adapter_metadata' is not a JSON object.")
    out: dict[str | None, dict[str, Any]] = {}
    for key, value in data.items():
        comp, sep, field_ = key.partition(".")
        if sep and comp in (TRANSFORMER, TEXT_ENCODER):
            out.setdefault(comp, {})[field_] = value
        else:
            out.setdefault(None, {})[key] = value
    return out


def _klein_text_encoder_config(name: str, metadata: Mapping[str, str]) -> dict[str, Any] | None:
    """The text encoder's rank and alpha, as a PEFT config, for a LoRA this pack's trainer saved with
    diffusers names before it wrote them into ``lora_adapter_metadata`` (a text-encoder alpha other
    than the rank then read back at scale 1): from ``klein.text_encoder_targets``, which those files
    hold (``{group: {"pattern", "rank", "alpha"}}``). None for any other file."""
    raw = metadata.get("klein.text_encoder_targets")
    if not raw or not str(metadata.get("klein.format", "")).endswith("(diffusers names)"):
        return None  # (no text-encoder part trained: nothing to read)
    try:
        groups = json.loads(raw)
        specs = [(str(g["pattern"]), int(g["rank"]), float(g["alpha"])) for g in groups.values()]
    except (ValueError, TypeError, KeyError, AttributeError):
        logger.warning("%s: its 'klein.text_encoder_targets' cannot be read; the text-encoder part applies at "
                       "scale 1", name)
        return None
    if not specs:
        return None
    return {"r": specs[0][1], "lora_alpha": specs[0][2], "rank_pattern": {p: r for p, r, _ in specs},
            "alpha_pattern": {p: a for p, _, a in specs}}


def _pattern_value(patterns: Mapping[str, Any] | None, module: str, default: Any) -> Any:
    # PEFT's get_pattern_key: a pattern matches a module name suffix at a dot boundary.
    for pat, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pat})$", module):
            return value
    return default


def _scalar(name: str, key: str, t: torch.Tensor) -> float:
    if t.numel() != 1:
        raise ValueError(f"{name}: '{key}' should hold one number (the alpha), it has shape {list(t.shape)}.")
    return float(t.reshape(()).item())


def _build_patch(
    name: str, path: str, target: Target, roles: dict[str, tuple[str, torch.Tensor]],
    peft: Mapping[str | None, dict[str, Any]], skipped: dict[str, str],
    rank_notes: dict[str, tuple[int, int]] | None = None,
) -> LoRAPatch | None:
    """Turn one module's tensors into a patch; keys it cannot use go to ``skipped``; a module whose
    metadata rank differs from its tensors' goes to ``rank_notes`` (path -> (metadata, tensors))."""
    alpha_entry = roles.pop("alpha", None)
    alpha = _scalar(name, alpha_entry[0], alpha_entry[1]) if alpha_entry else None
    cfg = peft.get(target.component) or peft.get(None)
    peft_name = strip_prefixes(path)[0]
    kinds = [k for k, roleset in (("lora", ("A", "B")), ("lokr", _LOKR_ROLES), ("loha", _LOHA_ROLES),
                                  ("full", ("diff",))) if any(r in roles for r in roleset)]
    if len(kinds) != 1:
        reason = f"mixes {' and '.join(kinds)} tensors for one module" if kinds else "no weights for this module"
        for key, _ in roles.values():
            skipped[key] = reason
        if alpha_entry:
            skipped[alpha_entry[0]] = reason
        return None
    kind = kinds[0]
    t = {r: as_matrix(v) for r, (_, v) in roles.items()}
    keys = tuple(k for k, _ in roles.values()) + ((alpha_entry[0],) if alpha_entry else ())

    def incomplete(missing: str) -> None:
        for key in keys:
            skipped[key] = f"incomplete {kind} module: {missing} missing"

    if kind == "lora":
        if "A" not in t or "B" not in t:
            incomplete("lora_B (up)" if "A" in t else "lora_A (down)")
            return None
        a, b = t["A"], t["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{name}: LoRA factors of '{path}' do not fit each other: A (down) "
                             f"{list(a.shape)}, B (up) {list(b.shape)}; expected [r, in] and [out, r].")
        rank = _rank(name, path, a.shape[0])
        if alpha is not None:  # Kohya / ai-toolkit / LyCORIS: scale = alpha / rank
            scale = alpha / rank
        elif cfg:  # diffusers / PEFT: LoraConfig in the metadata
            r = int(_pattern_value(cfg.get("rank_pattern"), peft_name, cfg.get("r", rank)))
            if r != rank and rank_notes is not None:  # said once per file by the caller
                rank_notes[path] = (r, rank)
            lora_alpha = float(_pattern_value(cfg.get("alpha_pattern"), peft_name, cfg.get("lora_alpha", rank)))
            scale = lora_alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
        else:  # diffusers convention without metadata: alpha = rank
            scale = 1.0
    elif kind == "lokr":
        for n in ("1", "2"):
            if f"lokr_w{n}" not in t and not (f"lokr_w{n}_a" in t and f"lokr_w{n}_b" in t):
                incomplete(f"lokr_w{n} (or lokr_w{n}_a and lokr_w{n}_b)")
                return None
        decomposed = [t[k].shape[0] for k in ("lokr_w2_b", "lokr_w1_b") if k in t]
        if cfg and str(cfg.get("peft_type", "")).upper() == "LOKR":  # PEFT LoKr: alpha / r always
            r = _rank(name, path, float(_pattern_value(cfg.get("rank_pattern"), peft_name, cfg.get("r", 1))))
            scale = float(_pattern_value(cfg.get("alpha_pattern"), peft_name, cfg.get("alpha", r))) / r
        elif alpha is not None and decomposed:  # LyCORIS: alpha / rank, only for decomposed factors
            scale = alpha / _rank(name, path, decomposed[0])
        else:  # LyCORIS with two full factors ignores alpha
            scale = 1.0
    elif kind == "loha":
        if any(r not in t for r in _LOHA_ROLES):
            incomplete(", ".join(r for r in _LOHA_ROLES if r not in t))
            return None
        rank = _rank(name, path, t["hada_w1_b"].shape[0])
        if cfg and str(cfg.get("peft_type", "")).upper() == "LOHA":  # PEFT LoHa: alpha / r, as LoKr
            r = _rank(name, path, float(_pattern_value(cfg.get("rank_pattern"), peft_name, cfg.get("r", rank))))
            scale = float(_pattern_value(cfg.get("alpha_pattern"), peft_name, cfg.get("alpha", r))) / r
        else:  # LyCORIS: alpha / rank, 1 without alpha
            scale = alpha / rank if alpha is not None else 1.0
    else:
        scale = 1.0
    if not math.isfinite(scale):
        raise ValueError(f"{name}: the scale of '{path}' is {scale} (alpha {alpha}); the LoRA's alpha or "
                         "metadata is corrupt.")
    patch = LoRAPatch(target, kind, t, scale, keys)
    _check_dora(name, path, patch, roles)
    return patch


def _check_dora(name: str, path: str, patch: LoRAPatch, roles: dict[str, tuple[str, torch.Tensor]]) -> None:
    """A DoRA magnitude must have the shape its convention gives it: LyCORIS' ``dora_scale`` one
    value per output row (``[out, 1]``) or per input column (``[1, in]``), PEFT's
    ``lora_magnitude_vector`` one per output row (``[out]``, on LoRA factors only)."""
    found = [r for r in DORA_ROLES if r in patch.tensors]
    if not found:
        return
    if patch.kind == "full":
        raise ValueError(f"{name}: '{roles[found[0]][0]}' is a DoRA magnitude on a full weight delta ('diff'), "
                         "which has no DoRA form.")
    out, inp = patch.shape
    if len(found) > 1:
        raise ValueError(f"{name}: '{path}' has both a dora_scale and a lora_magnitude_vector; a module has one "
                         "DoRA magnitude.")
    key, _ = roles[found[0]]
    shape = tuple(patch.tensors[found[0]].shape)
    if found[0] == "dora_scale":
        if shape not in ((out, 1), (1, inp)):
            raise ValueError(f"{name}: '{key}' has shape {list(shape)}; a DoRA scale of this [{out}, {inp}] module is "
                             f"[{out}, 1] (per output row) or [1, {inp}] (per input column).")
    elif patch.kind != "lora" or shape != (out,):
        what = f"shape {list(shape)}" if patch.kind == "lora" else f"{patch.kind} factors"
        raise ValueError(f"{name}: '{key}' is a PEFT DoRA magnitude with {what}; PEFT's DoRA is a [{out}] vector "
                         "over LoRA factors.")


def _rank(name: str, path: str, rank: float) -> float:
    if not rank > 0:
        raise ValueError(f"{name}: '{path}' has rank {rank:g} (empty factors); the LoRA is empty or corrupt.")
    return rank


def _format_name(patches: Iterable[LoRAPatch], tensors: Mapping[str, torch.Tensor]) -> str:
    keys = list(tensors)
    if any(k.startswith("lycoris_") for k in keys):
        family = "LyCORIS"
    elif any(k.startswith(("lora_unet_", "lora_te")) for k in keys):
        family = "Kohya"
    elif any(k.startswith("base_model.model.") for k in keys):
        family = "PEFT"
    else:
        family = ""
    names = {"bfl": "ai-toolkit/BFL", "diffusers": "diffusers/PEFT", "kohya": "Kohya", "peft": "PEFT"}
    kinds = {"lora": "LoRA", "lokr": "LoKr", "loha": "LoHa", "full": "full-delta"}
    labels = set()
    for p in patches:
        naming = family or names[p.target.naming]
        where = " (text encoder)" if p.component == TEXT_ENCODER else ""
        kind = "DoRA" if p.dora and p.kind == "lora" else kinds[p.kind] + (" with DoRA" if p.dora else "")
        labels.add(f"{naming} {kind}{where}")
    return " + ".join(sorted(labels))


def load_lora(
    source: str | os.PathLike | Mapping[str, torch.Tensor],
    *,
    metadata: Mapping[str, str] | None = None,
) -> LoRA:
    """Read a LoRA and map it onto the core's module names; returns a :class:`LoRA`.

    Args:
        source: a ``.safetensors`` file (or a folder holding exactly one), or a state dict; pickled
            checkpoints (``.pt``, ``.ckpt``, ``.bin``...) are refused.
        metadata: safetensors-style metadata for a state dict; merged over a file's own.

    Keys not applied are listed in ``LoRA.skipped`` with the reason and logged as one warning. Raises
    WeightFormatError for a pickle or invalid safetensors; ValueError for a FLUX.1 LoRA, no LoRA tensors,
    no Klein module matched, or factors that do not fit (naming the file and keys).
    """
    name, tensors, meta = _read_source(source, metadata)
    peft = _peft_configs(name, meta)
    if TEXT_ENCODER not in peft and None not in peft and (old := _klein_text_encoder_config(name, meta)):
        peft[TEXT_ENCODER] = old
    skipped: dict[str, str] = {}
    groups: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for key, value in tensors.items():
        split = split_key(key)
        if split is None:
            skipped[key] = "not a LoRA tensor (unknown suffix)"
            continue
        path, suffix = split
        role = suffix_role(suffix)
        if role is None:
            skipped[key] = UNSUPPORTED_SUFFIXES[suffix]
            continue
        group = groups.setdefault(path, {})
        if role in group:
            # Two spellings of one tensor ("x.lora_A.weight" and "x.lora_down.weight", or "x.lora_A.weight"
            # and "x.lora_A.default.weight"): keeping the last one dropped the other without a word.
            raise ValueError(
                f"{name}: '{group[role][0]}' and '{key}' are both the {role} tensor of module '{path}'; the file "
                "holds two copies of one module and it is unclear which to use."
            )
        group[role] = (key, value)
    if not groups:
        raise ValueError(
            f"{name}: not a LoRA: none of its {len(tensors)} tensors is a LoRA factor (lora_A/lora_B, "
            f"lora_down/lora_up, lokr_*, hada_*); first keys: {list(tensors)[:3]}."
        )
    flux1: list[str] = []
    patches: list[LoRAPatch] = []
    seen: dict[tuple[str, str, tuple[int, int] | None], str] = {}
    rank_notes: dict[str, tuple[int, int]] = {}
    for path, roles in groups.items():
        res = resolve_module(path)
        if res.kind == "flux1":
            flux1.append(next(iter(roles.values()))[0])
            continue
        if res.kind != "target" or res.target is None:
            reason = res.reason if res.kind == "ignored" else f"not applied: {res.reason}"
            for key, _ in roles.values():
                skipped[key] = reason
            continue
        patch = _build_patch(name, path, res.target, roles, peft, skipped, rank_notes)
        if patch is None:
            continue
        slot = (patch.component, patch.module, patch.target.part)
        if slot in seen:
            raise ValueError(
                f"{name}: '{seen[slot]}' and '{patch.keys[0]}' both adapt {patch.component} module "
                f"{patch.module}; the file holds two copies of one module and it is unclear which to use."
            )
        seen[slot] = patch.keys[0]
        patches.append(patch)
    if flux1:
        raise ValueError(
            f"{name}: this is a FLUX.1 LoRA; it does not apply to FLUX.2 Klein (it has keys such as "
            f"'{flux1[0]}', which FLUX.2 models do not have)."
        )
    if not patches:
        first = list(skipped.items())[:3]
        raise ValueError(
            f"{name}: none of its {len(tensors)} LoRA keys adapts a FLUX.2 Klein module, so it is "
            f"probably for another model; e.g. " + "; ".join(f"'{k}': {r}" for k, r in first) + "."
        )
    if rank_notes:  # one cause (the file's metadata, e.g. a resized LoRA that kept it): one warning
        first, (r, rank) = next(iter(rank_notes.items()))
        logger.warning("%s: its metadata gives another rank than the tensors for %d module(s) (e.g. '%s': %d, "
                       "the tensors %d); the tensors' ranks are used", name, len(rank_notes), first, r, rank)
    lora = LoRA(name, _format_name(patches, tensors), patches, skipped, meta)
    logger.info("%s", lora.summary())
    log_skipped(name, skipped)
    return lora
