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

import json
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .lora_formats import (
    TEXT_ENCODER,
    TRANSFORMER,
    UNSUPPORTED_SUFFIXES,
    Target,
    resolve_module,
    split_key,
    strip_prefixes,
    suffix_role,
)
from .errors import WeightFormatError
from .files.safetensors import open_safetensors

logger = logging.getLogger(__name__)

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
    # The one safetensors reader (pickles and other formats are refused by what they are). Not
    # weights.open_weights: it refuses files with quantisation-style keys, which do not apply to
    # LoRA factors (they are read as float32 anyway).
    f = open_safetensors(path, "LoRA")
    tensors = {k: f.read(k) for k in f.tensors}
    file_meta = dict(f.metadata)
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


# The applying half (kept in its own module); re-exported so ``klein_core.lora`` stays the one
# place to import LoRA support from. Imported last: lora_apply imports the names above.
from .lora_apply import (  # noqa: E402, F401
    AppliedLoRAs,
    LoRABranch,
    LoRASpec,
    apply_loras,
    check_loras,
    with_loras,
)
