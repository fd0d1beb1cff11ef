"""What a loaded LoRA is: one :class:`LoRAPatch` per adapted module, collected in a :class:`LoRA`."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .formats import TEXT_ENCODER, TRANSFORMER, Target

logger = logging.getLogger(__name__)

MODES = ("merge", "branch")  # how apply_loras applies: into the weights, or as a side branch


@dataclass(frozen=True, eq=False)
class LoRAPatch:
    """One adapted core module (or one row block of a fused one); ``tensors`` as stored, any float dtype.

    ``kind``: ``"lora"`` (``A [r, in]``, ``B [out, r]``; delta ``scale * B @ A``), ``"lokr"`` (``lokr_w1
    [a, b]``, ``lokr_w2 [c, d]``, each possibly an ``_a @ _b`` product; delta ``scale * kron(w1, w2)``),
    ``"loha"`` (``hada_w1_a [out, r]``, ``hada_w1_b [r, in]``, same for w2; delta ``scale * (w1_a @ w1_b)
    * (w2_a @ w2_b)``), ``"full"`` (``diff [out, in]``). ``target.part = (i, n)``: the delta covers rows
    ``[i*out, (i+1)*out)`` of a fused ``n*out``-row weight (diffusers q/k/v on ``qkv``);
    ``target.swap_halves``: its row halves are swapped first (diffusers' final layer). ``keys``: the
    source keys used.
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
            (a, b), (c, d) = lokr_factor_shape(t, "1"), lokr_factor_shape(t, "2")
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

    @property
    def dora(self) -> str | None:
        """The convention of this patch's DoRA magnitude, if it has one: ``"comfyui"`` (LyCORIS'
        ``dora_scale``, applied as ComfyUI applies it) or ``"peft"`` (``lora_magnitude_vector``)."""
        if "dora_scale" in self.tensors:
            return "comfyui"
        if "magnitude" in self.tensors:
            return "peft"
        return None

    @property
    def dora_on_rows(self) -> bool:
        """Whether this patch's DoRA magnitude scales the weight's rows (PEFT's always; LyCORIS'
        ``[out, 1]``), so that a branch can apply it to the module's output."""
        if self.dora == "peft":
            return True
        return self.dora == "comfyui" and self.tensors["dora_scale"].shape[0] == self.shape[0]

    def dora_row_scale(self, weight: torch.Tensor, strength: float,
                       delta: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 factor ``c [out]`` by which this patch scales the rows (``dora_on_rows``),
        from the current rows ``weight [out, in]`` (float32) at ``strength``: see :meth:`decompose`.
        ``delta``: :meth:`delta`, if the caller has it already."""
        if self.dora == "peft":
            magnitude = self.tensors["magnitude"].to(device=weight.device, dtype=torch.float32)
            if self.target.swap_halves:
                magnitude = swap_halves(magnitude)
            delta = self.delta(weight.device) if delta is None else delta
            return magnitude / torch.linalg.vector_norm(weight + strength * delta, dim=1)
        if not self.dora_on_rows:
            raise ValueError("dora_row_scale() is defined for DoRA magnitudes on the rows")
        scale = self.tensors["dora_scale"].to(device=weight.device, dtype=torch.float32)[:, 0]
        if self.target.swap_halves:
            scale = swap_halves(scale)
        # ComfyUI's weight_decompose takes the rows' norms before the delta
        return scale / (torch.linalg.vector_norm(weight, dim=1) + torch.finfo(torch.float32).eps)

    def decompose(self, weight: torch.Tensor, strength: float, *, delta: torch.Tensor | None = None,
                  row_scale: torch.Tensor | None = None) -> torch.Tensor:
        """DoRA: the float32 rows ``[out, in]`` this patch makes of the current rows ``weight``
        (float32, this patch's rows of a fused weight) at ``strength``. ``delta`` is :meth:`delta`;
        it and ``row_scale`` (:meth:`dora_row_scale` of the same ``weight``) may be given if the
        caller has them already.

        * ``"comfyui"`` (ComfyUI's ``weight_decompose``): ``calc = weight + delta``, scaled per row
          by ``dora_scale / (|weight| + eps)`` (``[out, 1]``: the norm of each row of ``weight``,
          before the delta, as ComfyUI computes it) or per column by ``dora_scale / (|calc| + eps)``
          (``[1, in]``); then ``weight + strength * (calc - weight)``. Several patches on one
          module apply in turn, each to the weight the one before left.
        * ``"peft"`` (PEFT's DoRA): ``calc = weight + strength * delta``, scaled per row by
          ``magnitude / |calc|``: the strength scales the delta as an adapter weight does in
          diffusers.
        """
        delta = self.delta(weight.device) if delta is None else delta
        if self.dora_on_rows and row_scale is None:
            row_scale = self.dora_row_scale(weight, strength, delta)
        if self.dora == "peft":
            return (weight + strength * delta) * row_scale[:, None]
        if self.dora != "comfyui":
            raise ValueError("decompose() is defined for patches with a DoRA magnitude")
        calc = weight + delta
        if self.dora_on_rows:
            calc = calc * row_scale[:, None]
        else:  # per input column, of the new weight
            scale = self.tensors["dora_scale"].to(device=weight.device, dtype=torch.float32)
            norm = torch.linalg.vector_norm(calc, dim=0, keepdim=True) + torch.finfo(torch.float32).eps
            calc = calc * (scale / norm)
        return calc if strength == 1.0 else weight + strength * (calc - weight)

    def factors(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """LoRA kind only: float32 ``(A [r, in], B [out, r])`` with ``scale`` folded into B and the
        row halves of B swapped when the target asks for it."""
        if self.kind != "lora":
            raise ValueError(f"factors() is defined for LoRA patches, not {self.kind}")
        a = self.tensors["A"].to(device=device, dtype=torch.float32)
        b = self.tensors["B"].to(device=device, dtype=torch.float32) * self.scale
        return a, (swap_halves(b) if self.target.swap_halves else b)

    def kron_factors(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """LoKr kind only: float32 ``(w1 [a, b], w2 [c, d])`` with ``scale`` folded into w1;
        ``delta() == kron(w1, w2)`` (halves not swapped here)."""
        if self.kind != "lokr":
            raise ValueError(f"kron_factors() is defined for LoKr patches, not {self.kind}")
        t = {k: v.to(device=device, dtype=torch.float32) for k, v in self.tensors.items()}
        return lokr_factor(t, "1") * self.scale, lokr_factor(t, "2")

    def delta(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The float32 weight delta ``[out, in]``, scale included, halves swapped if needed."""
        t = {k: v.to(device=device, dtype=torch.float32) for k, v in self.tensors.items()}
        if self.kind == "lora":
            d = (t["B"] @ t["A"]) * self.scale
        elif self.kind == "lokr":
            d = torch.kron(lokr_factor(t, "1"), lokr_factor(t, "2")) * self.scale
        elif self.kind == "loha":
            d = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"]) * self.scale
        else:
            d = t["diff"] * self.scale
        return swap_halves(d) if self.target.swap_halves else d


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
        return {patch_label(p): r for p in self.patches if (r := p.rank) is not None}

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


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    # [2D, ...] (a, b) -> (b, a): diffusers' final-layer (scale, shift) -> BFL (shift, scale).
    a, b = x.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def lokr_factor(t: Mapping[str, torch.Tensor], n: str) -> torch.Tensor:
    full = t.get(f"lokr_w{n}")
    return full if full is not None else t[f"lokr_w{n}_a"] @ t[f"lokr_w{n}_b"]


def lokr_factor_shape(t: Mapping[str, torch.Tensor], n: str) -> tuple[int, int]:
    full = t.get(f"lokr_w{n}")
    if full is not None:
        return full.shape[0], full.shape[1]
    return t[f"lokr_w{n}_a"].shape[0], t[f"lokr_w{n}_b"].shape[1]


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    # Kohya saves linear LoRAs of some models as 1x1 convs ([r, in, 1, 1]); treat them as matrices.
    while t.ndim > 2 and t.shape[-1] == 1:
        t = t[..., 0]
    return t


def patch_label(p: LoRAPatch) -> str:
    part = f"[{p.target.part[0] + 1}/{p.target.part[1]}]" if p.target.part else ""
    return f"{p.component}:{p.module}{part}"


def log_skipped(name: str, skipped: Mapping[str, str], all_names: int = 20) -> None:
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
