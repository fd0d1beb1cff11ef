"""LoRA / LyCORIS adapters for FLUX.2 Klein: read, map onto the core's modules, apply, remove.

* :func:`load_lora` reads a ``.safetensors`` LoRA (pickles are refused), works out its format
  (diffusers/PEFT, ai-toolkit/BFL, Kohya, LyCORIS LoKr/LoHa, text-encoder LoRAs) and maps every
  tensor onto a core module (:mod:`klein_core.lora_formats`). The result, a :class:`LoRA`, holds
  one :class:`LoRAPatch` per adapted module and, by name, every key that is not applied and why.
* :func:`apply_loras` applies several LoRAs with strengths to a loaded transformer and/or text
  encoder, either merged into the weights (``W += strength * delta`` in float32, written back in
  the weight dtype) or as a branch added to the module output; the returned
  :class:`AppliedLoRAs` handle's :meth:`~AppliedLoRAs.remove` restores the model exactly.
* :func:`with_loras` returns a patched copy that shares every tensor with the input model and
  leaves it untouched (for graph UIs where one base model feeds several graphs).

A LoRA made for another model is refused with a sentence naming both sizes (Klein 9B vs 4B), and
a FLUX.1 LoRA is named as such.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import Self

from .lora_formats import (
    TEXT_ENCODER,
    TRANSFORMER,
    UNSUPPORTED_SUFFIXES,
    Target,
    module_hidden,
    resolve_module,
    split_key,
    strip_prefixes,
    suffix_role,
)
from .qwen3 import Qwen3TextEncoder
from .transformer import Flux2Transformer
from .weights import WeightFormatError, read_safetensors_header

logger = logging.getLogger(__name__)

_PICKLE_SUFFIXES = {".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle"}
_FLOAT8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
           if hasattr(torch, n)}
# Known model widths, for naming the model a LoRA was made for.
_TRANSFORMER_SIZES = {3072: "Klein 4B", 4096: "Klein 9B", 6144: "FLUX.2 [dev]"}
_TEXT_SIZES = {2560: "Qwen3-4B (Klein 4B)", 4096: "Qwen3-8B (Klein 9B)"}
_LOKR_ROLES = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
_LOHA_ROLES = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
_MODES = ("merge", "branch")


# ---------------------------------------------------------------------------------------------
# Data


@dataclass(frozen=True, eq=False)
class LoRAPatch:
    """One adapted core module (or one row block of a fused one).

    ``kind`` and ``tensors`` (as stored, any float dtype):

    * ``"lora"``: ``A`` ``[r, in]``, ``B`` ``[out, r]``; delta = ``scale * B @ A``.
    * ``"lokr"``: ``lokr_w1`` ``[a, b]`` (or ``lokr_w1_a @ lokr_w1_b``) and ``lokr_w2`` ``[c, d]``
      (or ``lokr_w2_a @ lokr_w2_b``); delta = ``scale * kron(w1, w2)``, ``[a*c, b*d]``.
    * ``"loha"``: ``hada_w1_a`` ``[out, r]``, ``hada_w1_b`` ``[r, in]``, same for w2; delta =
      ``scale * (w1_a @ w1_b) * (w2_a @ w2_b)`` (element-wise).
    * ``"full"``: ``diff`` ``[out, in]``; delta = ``diff``.

    ``target.part = (i, n)``: the delta covers rows ``[i*out, (i+1)*out)`` of a fused weight with
    ``n*out`` rows (diffusers q/k/v on ``qkv``). ``target.swap_halves``: the delta's two row halves
    are swapped before use (diffusers' final-layer order). ``keys``: the source keys used.
    """

    target: Target
    kind: str
    tensors: Mapping[str, torch.Tensor]
    scale: float
    keys: tuple[str, ...]

    @property
    def component(self) -> str:
        return self.target.component

    @property
    def module(self) -> str:
        return self.target.module

    @property
    def shape(self) -> tuple[int, int]:
        """``(out, in)`` of this patch's delta (before placing it in a fused weight)."""
        t = self.tensors
        if self.kind == "lora":
            return t["B"].shape[0], t["A"].shape[1]
        if self.kind == "lokr":
            (a, b), (c, d) = _lokr_factor_shape(t, "1"), _lokr_factor_shape(t, "2")
            return a * c, b * d
        if self.kind == "loha":
            return t["hada_w1_a"].shape[0], t["hada_w1_b"].shape[1]
        return tuple(t["diff"].shape)  # type: ignore[return-value]

    @property
    def rank(self) -> int | None:
        """Rank of the low-rank factors (None for full LoKr factors and full deltas)."""
        t = self.tensors
        if self.kind == "lora":
            return t["A"].shape[0]
        if self.kind == "loha":
            return t["hada_w1_b"].shape[0]
        if self.kind == "lokr":
            for k in ("lokr_w2_b", "lokr_w1_b"):
                if k in t:
                    return t[k].shape[0]
        return None

    def factors(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """LoRA kind only: float32 ``(A [r, in], B [out, r])`` with ``scale`` folded into B and the
        row halves of B swapped when the target asks for it."""
        if self.kind != "lora":
            raise ValueError(f"factors() is defined for LoRA patches, not {self.kind}")
        a = self.tensors["A"].to(device=device, dtype=torch.float32)
        b = self.tensors["B"].to(device=device, dtype=torch.float32) * self.scale
        return a, (_swap_halves(b) if self.target.swap_halves else b)

    def kron_factors(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """LoKr kind only: float32 ``(w1 [a, b], w2 [c, d])`` with ``scale`` folded into w1;
        ``delta() == kron(w1, w2)`` (halves not swapped here)."""
        if self.kind != "lokr":
            raise ValueError(f"kron_factors() is defined for LoKr patches, not {self.kind}")
        t = {k: v.to(device=device, dtype=torch.float32) for k, v in self.tensors.items()}
        return _lokr_factor(t, "1") * self.scale, _lokr_factor(t, "2")

    def delta(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The float32 weight delta ``[out, in]``, scale included, halves swapped if needed."""
        t = {k: v.to(device=device, dtype=torch.float32) for k, v in self.tensors.items()}
        if self.kind == "lora":
            d = (t["B"] @ t["A"]) * self.scale
        elif self.kind == "lokr":
            d = torch.kron(_lokr_factor(t, "1"), _lokr_factor(t, "2")) * self.scale
        elif self.kind == "loha":
            d = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"]) * self.scale
        else:
            d = t["diff"] * self.scale
        return _swap_halves(d) if self.target.swap_halves else d


@dataclass
class LoRA:
    """A LoRA file mapped onto the core's module names (see :func:`load_lora`).

    ``format``: human-readable format(s), e.g. ``"Kohya LoRA"``, ``"diffusers/PEFT LoRA"``,
    ``"LyCORIS LoKr"``. ``patches``: what is applied. ``skipped``: every source key that is not
    applied, with the reason (unknown names, text-encoder layers Klein does not run, DoRA
    magnitudes...). ``metadata``: the file's safetensors metadata.
    """

    name: str
    format: str
    patches: list[LoRAPatch]
    skipped: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def targets(self) -> tuple[str, ...]:
        """The components it adapts: ``("transformer",)``, ``("text_encoder",)`` or both."""
        return tuple(c for c in (TRANSFORMER, TEXT_ENCODER) if any(p.component == c for p in self.patches))

    @property
    def ranks(self) -> dict[str, int]:
        """Rank per adapted module (``"transformer:double_blocks.0.img_attn.qkv[1/3]"`` -> 16)."""
        return {_label(p): r for p in self.patches if (r := p.rank) is not None}

    @property
    def rank(self) -> int | None:
        """The most common rank (None when no patch is low-rank)."""
        ranks = list(self.ranks.values())
        return max(set(ranks), key=ranks.count) if ranks else None

    def summary(self) -> str:
        """One line: format, targets, module count, rank and skipped-key count."""
        ranks = sorted(set(self.ranks.values()))
        rank = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}" if ranks else "full-rank"
        return (f"{self.name}: {self.format}, {len(self.patches)} modules of {'+'.join(self.targets)}, "
                f"{rank}, {len(self.skipped)} keys not applied")


# ---------------------------------------------------------------------------------------------
# Tensor helpers


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    # [2D, ...] (a, b) -> (b, a): diffusers' final-layer (scale, shift) -> BFL (shift, scale).
    a, b = x.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def _lokr_factor(t: Mapping[str, torch.Tensor], n: str) -> torch.Tensor:
    full = t.get(f"lokr_w{n}")
    return full if full is not None else t[f"lokr_w{n}_a"] @ t[f"lokr_w{n}_b"]


def _lokr_factor_shape(t: Mapping[str, torch.Tensor], n: str) -> tuple[int, int]:
    full = t.get(f"lokr_w{n}")
    if full is not None:
        return full.shape[0], full.shape[1]
    return t[f"lokr_w{n}_a"].shape[0], t[f"lokr_w{n}_b"].shape[1]


def _as_matrix(t: torch.Tensor) -> torch.Tensor:
    # Kohya saves linear LoRAs of some models as 1x1 convs ([r, in, 1, 1]); treat them as matrices.
    while t.ndim > 2 and t.shape[-1] == 1:
        t = t[..., 0]
    return t


def _label(p: LoRAPatch) -> str:
    part = f"[{p.target.part[0] + 1}/{p.target.part[1]}]" if p.target.part else ""
    return f"{p.component}:{p.module}{part}"


# ---------------------------------------------------------------------------------------------
# Reading


def _read_source(
    source: str | os.PathLike | Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
) -> tuple[str, dict[str, torch.Tensor], dict[str, str]]:
    if isinstance(source, Mapping):
        tensors = {}
        for k, v in source.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"<in-memory LoRA>: value for '{k}' is {type(v).__name__}, not a torch.Tensor")
            tensors[str(k)] = v
        return "<in-memory LoRA>", tensors, dict(metadata or {})
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"LoRA file not found: {path}")
    if path.is_dir():  # a diffusers save folder holds one pytorch_lora_weights.safetensors
        files = sorted(path.glob("*.safetensors"))
        if len(files) != 1:
            raise ValueError(f"{path}: expected one .safetensors LoRA file in this folder, found {len(files)}.")
        path = files[0]
    suffix = path.suffix.lower()
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if suffix in _PICKLE_SUFFIXES or magic[:2] == b"PK" or magic[:1] == b"\x80":
        raise WeightFormatError(
            f"{path}: this LoRA is a Python pickle, which can run arbitrary code when loaded; klein_core "
            "never unpickles. Use a .safetensors LoRA."
        )
    # The header is validated here; weights.open_weights is not used because it refuses files with
    # quantisation-style keys, which do not apply to LoRA factors (they are read as float32 anyway).
    infos, file_meta = read_safetensors_header(path)
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            tensors = {k: fh.get_tensor(k) for k in infos}
    except Exception as exc:  # safetensors raises its own error types
        raise WeightFormatError(f"{path}: cannot read as safetensors ({exc}).") from exc
    return str(path), tensors, {**file_meta, **dict(metadata or {})}


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
) -> LoRAPatch | None:
    """Turn one module's tensors into a patch; keys it cannot use go to ``skipped``."""
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
    t = {r: _as_matrix(v) for r, (_, v) in roles.items()}
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
        rank = a.shape[0]
        if alpha is not None:  # Kohya / ai-toolkit / LyCORIS: scale = alpha / rank
            scale = alpha / rank
        elif cfg:  # diffusers / PEFT: LoraConfig in the metadata
            r = int(_pattern_value(cfg.get("rank_pattern"), peft_name, cfg.get("r", rank)))
            if r != rank:
                logger.warning("%s: metadata gives rank %d for '%s', the tensors have %d; using %d",
                               name, r, path, rank, rank)
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
            r = float(_pattern_value(cfg.get("rank_pattern"), peft_name, cfg.get("r", 1)))
            scale = float(_pattern_value(cfg.get("alpha_pattern"), peft_name, cfg.get("alpha", r))) / r
        elif alpha is not None and decomposed:  # LyCORIS: alpha / rank, only for decomposed factors
            scale = alpha / decomposed[0]
        else:  # LyCORIS with two full factors ignores alpha
            scale = 1.0
    elif kind == "loha":
        if any(r not in t for r in _LOHA_ROLES):
            incomplete(", ".join(r for r in _LOHA_ROLES if r not in t))
            return None
        scale = alpha / t["hada_w1_b"].shape[0] if alpha is not None else 1.0
    else:
        scale = 1.0
    return LoRAPatch(target, kind, t, scale, keys)


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
        labels.add(f"{naming} {kinds[p.kind]}{where}")
    return " + ".join(sorted(labels))


def load_lora(
    source: str | os.PathLike | Mapping[str, torch.Tensor],
    *,
    metadata: Mapping[str, str] | None = None,
) -> LoRA:
    """Read a LoRA and map it onto the core's module names.

    Args:
        source: a ``.safetensors`` file (or a folder holding exactly one), or an in-memory state
            dict. Pickled checkpoints (``.pt``, ``.ckpt``, ``.bin``...) are refused.
        metadata: safetensors-style metadata for a state dict (e.g. diffusers'
            ``{"lora_adapter_metadata": json}``); merged over the file's own for a file.

    Returns:
        A :class:`LoRA`. Keys that are not applied are listed in ``LoRA.skipped`` with the reason,
        and logged as one warning.

    Raises:
        ValueError: the file is a FLUX.1 LoRA, holds no LoRA tensors, maps onto no Klein module,
            or has factors that do not fit each other (the message names the file and keys).
        WeightFormatError: the file is a pickle or not valid safetensors.
    """
    name, tensors, meta = _read_source(source, metadata)
    peft = _peft_configs(name, meta)
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
        groups.setdefault(path, {})[role] = (key, value)
    if not groups:
        raise ValueError(
            f"{name}: not a LoRA: none of its {len(tensors)} tensors is a LoRA factor (lora_A/lora_B, "
            f"lora_down/lora_up, lokr_*, hada_*); first keys: {list(tensors)[:3]}."
        )
    flux1: list[str] = []
    patches: list[LoRAPatch] = []
    seen: dict[tuple[str, str, tuple[int, int] | None], str] = {}
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
        patch = _build_patch(name, path, res.target, roles, peft, skipped)
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
    lora = LoRA(name, _format_name(patches, tensors), patches, skipped, meta)
    logger.info("%s", lora.summary())
    _log_skipped(name, skipped)
    return lora


def _log_skipped(name: str, skipped: Mapping[str, str], all_names: int = 20) -> None:
    """Log keys not applied, grouped by reason: a warning, or info when every reason is a
    deliberate "ignored: ..." (e.g. text-encoder layers Klein never runs). Every key is named
    when there are at most ``all_names`` of them; beyond that 3 per reason (the full list is
    ``LoRA.skipped`` / ``AppliedLoRAs.skipped``)."""
    if not skipped:
        return
    by_reason: dict[str, list[str]] = {}
    for key, reason in skipped.items():
        by_reason.setdefault(reason, []).append(key)
    show = len(skipped) if len(skipped) <= all_names else 3
    parts = []
    for reason, keys in by_reason.items():
        more = f" and {len(keys) - show} more" if len(keys) > show else ""
        names = ", ".join(f"'{k}'" for k in keys[:show]) + more
        parts.append(f"{reason}: {names}")
    level = logging.INFO if all(r.startswith("ignored") for r in by_reason) else logging.WARNING
    logger.log(level, "%s: %d keys not applied. %s", name, len(skipped), " | ".join(parts))


# ---------------------------------------------------------------------------------------------
# Planning: which patches go to which module, checked against the model


LoRASpec = LoRA | tuple[LoRA, float]


def _components(models: nn.Module | Sequence[nn.Module] | Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    items = list(models.values()) if isinstance(models, Mapping) else (
        [models] if isinstance(models, nn.Module) else list(models))
    out: dict[str, nn.Module] = {}
    for m in items:
        if m is None:
            continue
        if isinstance(m, Flux2Transformer):
            comp = TRANSFORMER
        elif isinstance(m, Qwen3TextEncoder):
            comp = TEXT_ENCODER
        else:
            raise TypeError(f"LoRAs apply to a Flux2Transformer or a Qwen3TextEncoder, not {type(m).__name__}.")
        if comp in out:
            raise ValueError(f"two {comp} models given; pass one of each at most.")
        out[comp] = m
    return out


def _normalise(loras: LoRASpec | Sequence[LoRASpec]) -> list[tuple[LoRA, float]]:
    pair = isinstance(loras, tuple) and len(loras) == 2 and isinstance(loras[0], LoRA)
    single = isinstance(loras, LoRA) or pair
    items = [loras] if single else list(loras)  # type: ignore[arg-type]
    out = []
    for item in items:
        lora, strength = (item, 1.0) if isinstance(item, LoRA) else item
        if not isinstance(lora, LoRA):
            raise TypeError(f"expected a LoRA from load_lora() or (LoRA, strength), got {type(lora).__name__}")
        strength = float(strength)
        if not math.isfinite(strength):
            raise ValueError(f"{lora.name}: strength must be a finite number, got {strength}.")
        out.append((lora, strength))
    return out


def _describe_transformer(hidden: int) -> str:
    return _TRANSFORMER_SIZES.get(hidden, "a Flux2 transformer")


def _misfit(lora: LoRA, patch: LoRAPatch, model: nn.Module, weight_shape: tuple[int, ...]) -> ValueError:
    """The error for a patch whose shape does not fit its module: names both model sizes."""
    out, inn = patch.shape
    n = patch.target.part[1] if patch.target.part else 1
    lora_hidden = module_hidden(patch.component, patch.module, out * n, inn)
    cfg = model.config  # type: ignore[attr-defined]
    if lora_hidden != cfg.hidden_size:
        variant = cfg.variant
        model_side = variant if "hidden" in variant else f"{variant} (hidden {cfg.hidden_size})"
        if patch.component == TRANSFORMER:
            return ValueError(
                f"{lora.name}: this LoRA was trained for {_describe_transformer(lora_hidden)} (hidden "
                f"{lora_hidden}); the loaded model is {model_side}. Use a LoRA made for {variant}."
            )
        made_for = _TEXT_SIZES.get(lora_hidden, "another Qwen3 text encoder")
        return ValueError(
            f"{lora.name}: this LoRA's text-encoder part was trained for {made_for} (hidden {lora_hidden}); "
            f"the loaded text encoder is {model_side}."
        )
    want = (weight_shape[0] // n, weight_shape[1])
    return ValueError(
        f"{lora.name}: '{patch.keys[0]}' gives a {list(patch.shape)} delta, but {patch.component} module "
        f"{patch.module} needs {list(want)}; the LoRA does not fit this {cfg.variant} model."
    )


def _missing_module(lora: LoRA, patch: LoRAPatch, model: nn.Module) -> ValueError:
    cfg = model.config  # type: ignore[attr-defined]
    if patch.component == TRANSFORMER:
        have = f"it has {cfg.depth} double and {cfg.depth_single} single blocks"
    else:
        have = f"it runs {len(getattr(model, 'layers', []))} layers"
    return ValueError(
        f"{lora.name}: '{patch.keys[0]}' adapts {patch.module}, which the loaded {cfg.variant} "
        f"{'transformer' if patch.component == TRANSFORMER else 'text encoder'} does not have ({have}); "
        "the LoRA was made for a bigger model."
    )


@dataclass
class _ModulePlan:
    component: str
    name: str
    module: nn.Module
    items: list[tuple[LoRAPatch, float]] = field(default_factory=list)


def _plan(
    components: Mapping[str, nn.Module], loras: list[tuple[LoRA, float]]
) -> tuple[dict[tuple[str, str], _ModulePlan], dict[str, str]]:
    """Group patches by core module, check every shape, and list what cannot be applied."""
    plans: dict[tuple[str, str], _ModulePlan] = {}
    skipped: dict[str, str] = {}
    tables = {c: dict(m.named_modules()) for c, m in components.items()}
    for lora, strength in loras:
        if strength == 0.0:  # exactly no LoRA: touch nothing
            continue
        for patch in lora.patches:
            model = components.get(patch.component)
            if model is None:
                what = "text encoder" if patch.component == TEXT_ENCODER else "transformer"
                for key in patch.keys:
                    skipped[key] = f"not applied: no {what} was given to apply it to"
                continue
            module = tables[patch.component].get(patch.module)
            weight = getattr(module, "weight", None)
            if module is None or not isinstance(weight, torch.Tensor):
                raise _missing_module(lora, patch, model)
            n = patch.target.part[1] if patch.target.part else 1
            if weight.ndim != 2 or weight.shape[0] % n or patch.shape != (weight.shape[0] // n, weight.shape[1]):
                raise _misfit(lora, patch, model, tuple(weight.shape))
            if weight.dtype in _FLOAT8 and getattr(module, "weight_scale", None) is None:
                raise NotImplementedError(
                    f"{lora.name}: {patch.component} module {patch.module} has {weight.dtype} weights without a "
                    "scale (not an FP8Linear); load the model through klein_core's loaders to apply LoRAs."
                )
            key = (patch.component, patch.module)
            if key not in plans:
                plans[key] = _ModulePlan(patch.component, patch.module, module)
            plans[key].items.append((patch, strength))
    _log_skipped("LoRA", skipped)
    return plans, skipped


def _rows(patch: LoRAPatch, total: int) -> slice:
    if patch.target.part is None:
        return slice(0, total)
    i, n = patch.target.part
    size = total // n
    return slice(i * size, (i + 1) * size)


def _merge_fp8(plan: _ModulePlan, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge into an FP8Linear: dequantise, add the deltas in float32, re-quantise with a new
    absmax scale (per tensor, or per row when the layer has per-row scales). Returns the original
    (weight, scale) on the CPU for an exact restore."""
    module = plan.module
    scale = module.weight_scale
    fmax = float(torch.finfo(q.dtype).max)
    s = scale.float().reshape(-1, 1) if scale.ndim == 1 else scale.float()
    merged = q.float() * s + _summed_delta(plan, q)
    amax = merged.abs().amax(dim=1, keepdim=True) if scale.ndim == 1 else merged.abs().amax()
    new_scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    module.weight.data = (merged / new_scale).clamp(-fmax, fmax).to(q.dtype)
    module.weight_scale = new_scale.reshape(scale.shape).to(scale.dtype)
    return q.to("cpu"), scale.to("cpu")


def _summed_delta(plan: _ModulePlan, weight: torch.Tensor) -> torch.Tensor:
    """float32 sum of ``strength * delta`` over the module's patches, on the weight's device."""
    delta = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for patch, strength in plan.items:
        delta[_rows(patch, weight.shape[0])] += strength * patch.delta(weight.device)
    return delta


# ---------------------------------------------------------------------------------------------
# Branch mode: a forward hook adding the adapter's output to the module's


class LoRABranch:
    """Forward hook adding the LoRAs' output to one Linear's: ``out + x @ A.T @ B.T + ...``.

    * Low-rank patches: ``A`` ``[R, in]`` and ``B`` ``[out, R]`` concatenate them all (strength
      and scale folded into B, q/k/v parts zero-padded to the fused rows, halves swapped).
    * LoKr patches stay factored: ``kron(w1, w2) @ x`` is ``w1 @ X @ w2.T`` with ``x`` viewed as
      ``X [b, d]``, so a Kronecker delta never has to exist as a full ``[out, in]`` matrix.
    * LoHa and full deltas have no such form: their sum ``D`` ``[out, in]`` is kept dense (as
      large as the weight).

    Factors are kept in the weight dtype and follow the input to its device.
    """

    def __init__(self, plan: _ModulePlan, weight: torch.Tensor) -> None:
        out_features = weight.shape[0]
        # fp8 layers compute in their activation dtype; keep the factors in bf16 for them
        dtype = torch.bfloat16 if weight.dtype in _FLOAT8 else weight.dtype
        device = weight.device
        self.out_features = out_features
        a_parts, b_parts = [], []
        self.kron: list[tuple[torch.Tensor, torch.Tensor, slice, bool]] = []
        dense: torch.Tensor | None = None
        for patch, strength in plan.items:
            rows = _rows(patch, out_features)
            if patch.kind == "lora":
                a, b = patch.factors(device)
                b_full = torch.zeros(out_features, b.shape[1], dtype=torch.float32, device=device)
                b_full[rows] = b * strength
                a_parts.append(a)
                b_parts.append(b_full)
            elif patch.kind == "lokr":
                w1, w2 = patch.kron_factors(device)
                self.kron.append(((w1 * strength).to(dtype), w2.to(dtype), rows, patch.target.swap_halves))
            else:
                if dense is None:
                    dense = torch.zeros(weight.shape, dtype=torch.float32, device=device)
                dense[rows] += strength * patch.delta(device)
        self.a = torch.cat(a_parts).to(dtype) if a_parts else None
        self.b = torch.cat(b_parts, dim=1).to(dtype) if b_parts else None
        self.dense = dense.to(dtype) if dense is not None else None

    def _to(self, device: torch.device) -> None:
        for name in ("a", "b", "dense"):
            t = getattr(self, name)
            if t is not None and t.device != device:
                setattr(self, name, t.to(device))
        if self.kron and self.kron[0][0].device != device:
            self.kron = [(w1.to(device), w2.to(device), rows, swap) for w1, w2, rows, swap in self.kron]

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        self._to(x.device)
        extra = None
        if self.a is not None and self.b is not None:
            extra = F.linear(F.linear(x.to(self.a.dtype), self.a), self.b)
        if self.dense is not None:
            d = F.linear(x.to(self.dense.dtype), self.dense)
            extra = d if extra is None else extra + d
        if self.kron:
            lead = x.shape[:-1]
            if extra is None:
                extra = x.new_zeros(*lead, self.out_features, dtype=self.kron[0][0].dtype)
            for w1, w2, rows, swap in self.kron:
                xr = x.to(w1.dtype).reshape(*lead, w1.shape[1], w2.shape[1])  # [..., b, d]
                y = torch.einsum("ab,...bd,cd->...ac", w1, xr, w2).reshape(*lead, -1)  # [..., a*c]
                if swap:  # diffusers' final-layer rows: swap the output halves
                    first, second = y.chunk(2, dim=-1)
                    y = torch.cat([second, first], dim=-1)
                extra[..., rows] = extra[..., rows] + y.to(extra.dtype)
        return output if extra is None else output + extra.to(output.dtype)


# ---------------------------------------------------------------------------------------------
# Applying


# Active merge handles per model, oldest first: merged weights must be restored last-in first-out.
_MERGED: weakref.WeakKeyDictionary[nn.Module, list[AppliedLoRAs]] = weakref.WeakKeyDictionary()


class AppliedLoRAs:
    """Handle for LoRAs applied by :func:`apply_loras`; :meth:`remove` undoes them exactly.

    Merge mode keeps the original weight tensor of every touched module, on the CPU (for a CPU
    model the very tensor the model had, no copy; for a GPU model a host copy) and puts it back on
    removal: bit-exact, which re-subtracting a delta in bf16 is not, at the cost of host memory
    equal to the touched weights. Branch mode keeps nothing: removal drops the hooks.
    ``modules``: the touched core modules (``"transformer:single_blocks.0.linear1"``);
    ``skipped``: source keys not applied in this call, with reasons (plus each LoRA's own
    ``LoRA.skipped``).
    """

    def __init__(self, mode: str, loras: list[tuple[LoRA, float]], skipped: dict[str, str]) -> None:
        self.mode = mode
        self.loras = [(lora.name, strength) for lora, strength in loras]
        self.skipped = skipped
        self.modules: list[str] = []
        self._backups: list[tuple[nn.Module, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._models: list[nn.Module] = []
        self.active = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"AppliedLoRAs({self.mode}, {len(self.modules)} modules, {state}, loras={self.loras})"

    def remove(self) -> None:
        """Restore the model: original weights (merge) or no hooks (branch). Idempotent."""
        if not self.active:
            return
        if self.mode == "merge":
            touched = {id(m) for m, _ in self._backups}
            for model in self._models:
                stack = _MERGED.get(model, [])
                later = stack[stack.index(self) + 1:] if self in stack else []
                if any(touched & {id(m) for m, _ in h._backups} for h in later):
                    raise ValueError(
                        "remove merged LoRAs in reverse order of applying them: a LoRA applied later "
                        "changed the same weights. Remove that one first."
                    )
            for module, original in self._backups:
                weight = module.weight
                if isinstance(original, tuple):  # fp8: the weight and its scale
                    original, scale = original
                    module.weight_scale = scale.to(module.weight_scale.device)
                weight.data = original.to(weight.device)
            for model in self._models:
                stack = _MERGED.get(model, [])
                if self in stack:
                    stack.remove(self)
            self._backups.clear()
        else:
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
        self.active = False
        logger.info("removed LoRAs %s (%s mode)", self.loras, self.mode)


def apply_loras(
    models: nn.Module | Sequence[nn.Module] | Mapping[str, nn.Module],
    loras: LoRASpec | Sequence[LoRASpec],
    *,
    mode: str = "merge",
) -> AppliedLoRAs:
    """Apply LoRAs to a transformer and/or text encoder, in place.

    Args:
        models: a :class:`Flux2Transformer`, a :class:`Qwen3TextEncoder`, or several of them (a
            sequence or a mapping). Patches for a component not given are reported, not applied.
        loras: ``[(lora, strength), ...]`` (a bare :class:`LoRA` means strength 1). Any finite
            strength works, negative included; strength 0 leaves the model untouched.
        mode: ``"merge"``: ``W += sum(strength * delta)`` computed in float32 and written back in
            the weight dtype (no runtime cost; the order of LoRAs within one call does not matter).
            ``"branch"``: a forward hook adds ``strength * scale * x @ A.T @ B.T`` to the module
            output (weights untouched; cheap to add and remove).

    Returns:
        An :class:`AppliedLoRAs` handle; ``remove()`` restores the model bit-exactly.

    Raises:
        ValueError: a LoRA does not fit the model (the message names both model sizes).
        NotImplementedError: a target weight is float8 without a scale (not an FP8Linear).
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    components = _components(models)
    items = _normalise(loras)
    plans, skipped = _plan(components, items)
    handle = AppliedLoRAs(mode, items, skipped)
    handle._models = list(components.values())
    for (comp, name), plan in plans.items():
        weight = plan.module.weight
        if mode == "merge":
            original = weight.detach()
            if original.dtype in _FLOAT8:
                handle._backups.append((plan.module, _merge_fp8(plan, original)))
                handle.modules.append(f"{comp}:{name}")
                continue
            merged = (original.float() + _summed_delta(plan, weight)).to(original.dtype)
            # The merged weight is a new tensor: the original storage is never written, so it is
            # the exact backup (on the CPU: no copy at all) and any state dict the model was
            # loaded from, which may share that storage, stays intact.
            weight.data = merged
            handle._backups.append((plan.module, original.to("cpu")))
        else:
            handle._hooks.append(plan.module.register_forward_hook(LoRABranch(plan, weight)))
        handle.modules.append(f"{comp}:{name}")
    if mode == "merge":
        for model in handle._models:
            _MERGED.setdefault(model, []).append(handle)
    logger.info("applied %s to %d modules (%s mode)", handle.loras, len(handle.modules), mode)
    return handle


def check_loras(
    models: nn.Module | Sequence[nn.Module] | Mapping[str, nn.Module],
    loras: LoRASpec | Sequence[LoRASpec],
) -> dict[str, str]:
    """Check that LoRAs fit ``models`` without changing anything; returns the keys that would not
    be applied (with reasons). Works on meta-device models, so a config alone is enough:
    ``with torch.device("meta"): check_loras(Flux2Transformer(config), loras)``.

    Raises the same errors as :func:`apply_loras`.
    """
    _, skipped = _plan(_components(models), _normalise(loras))
    return skipped


def _shallow_copy(m: nn.Module) -> nn.Module:
    """A new module object sharing all tensors with ``m`` but with its own child/param/hook dicts."""
    c = copy.copy(m)
    for k, v in vars(m).items():
        if isinstance(v, (dict, set)):  # _modules, _parameters, _buffers, hook dicts...
            c.__dict__[k] = copy.copy(v)
    return c


def with_loras(model: nn.Module, loras: LoRASpec | Sequence[LoRASpec]) -> nn.Module:
    """A copy of ``model`` with LoRAs applied as branches; ``model`` itself is not changed.

    The copy shares every parameter tensor with ``model``. Only the touched Linear modules and
    their parents are new objects (shallow copies) carrying :class:`LoRABranch` hooks, so the
    copy costs the LoRA factors, not the weights. Chaining works: ``with_loras(with_loras(m, a), b)``.
    Patches for another component (text-encoder parts when ``model`` is the transformer) are
    reported in a warning. Strength 0 returns ``model`` itself.
    """
    components = _components(model)
    items = _normalise(loras)
    plans, _ = _plan(components, items)
    if not plans:
        return model
    root = _shallow_copy(model)
    copies: dict[str, nn.Module] = {"": root}
    for (_, name), plan in plans.items():
        parent, path = root, ""
        for part in name.split("."):
            path = f"{path}.{part}" if path else part
            if path not in copies:
                copies[path] = _shallow_copy(parent._modules[part])  # type: ignore[arg-type]
                parent._modules[part] = copies[path]
            parent = copies[path]
        parent.register_forward_hook(LoRABranch(plan, parent.weight))  # type: ignore[arg-type]
    logger.info("patched copy with %s: %d modules", [(lora.name, s) for lora, s in items], len(plans))
    return root
