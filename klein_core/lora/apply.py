"""Applying loaded LoRAs: fit checks against the model, merge into weights (bf16/fp32 and
FP8Linear, exact removal), side-branch hooks, and non-mutating patched copies.

Reading and format detection live in :mod:`klein_core.lora.read`; :mod:`klein_core.lora` exports both.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import Self

from ..checks import is_finite
from ..models.qwen3 import Qwen3TextEncoder
from ..models.transformer import Flux2Transformer
from ..models.variants import encoder_model, model_for_hidden
from ..quant.fp8 import FLOAT8_DTYPES
from ..quant.ggml import GGMLLinear
from ..quant.nvfp4 import NVFP4Linear
from .formats import TEXT_ENCODER, TRANSFORMER, module_hidden
from .patches import MODES, LoRA, LoRAPatch, log_skipped

logger = logging.getLogger(__name__)


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
    # A (LoRA, strength) pair, not a two-LoRA sequence: a tuple (la, lb) is a Sequence[LoRASpec] too,
    # and reading lb as a strength failed with "float() argument must be ... not 'LoRA'".
    pair = (isinstance(loras, tuple) and len(loras) == 2 and isinstance(loras[0], LoRA)
            and not isinstance(loras[1], (LoRA, tuple)))
    single = isinstance(loras, LoRA) or pair
    if isinstance(loras, (str, os.PathLike)):  # else each character would be read as a (LoRA, strength)
        _refuse_lora_item(loras)
    items = [loras] if single else list(loras)  # type: ignore[arg-type]
    out = []
    for item in items:
        if isinstance(item, LoRA):
            item = (item, 1.0)
        if not (isinstance(item, Sequence) and not isinstance(item, str) and len(item) == 2
                and isinstance(item[0], LoRA)):
            _refuse_lora_item(item)
        lora, strength = item
        try:
            strength = float(strength)
        except (TypeError, ValueError, RuntimeError) as exc:  # RuntimeError: a tensor of several values
            kind = TypeError if isinstance(exc, TypeError) else ValueError
            raise kind(f"{lora.name}: strength must be a finite number, got {strength!r}.") from None
        if not math.isfinite(strength):
            raise ValueError(f"{lora.name}: strength must be a finite number, got {strength}.")
        out.append((lora, strength))
    return out


def _refuse_lora_item(item: object) -> NoReturn:
    """The error for what is neither a LoRA nor a (LoRA, strength) pair; a path says to load it."""
    first = item[0] if isinstance(item, Sequence) and not isinstance(item, str) and len(item) == 2 else item
    if isinstance(first, (str, os.PathLike)):
        raise TypeError(f"expected a loaded LoRA, got the path {os.fspath(first)!r}: load it first with "
                        "kc.load_lora(path)")
    raise TypeError(f"expected a LoRA from load_lora() or (LoRA, strength), got {type(first).__name__}")


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
                f"{lora.name}: this LoRA was trained for {model_for_hidden(lora_hidden)} (hidden "
                f"{lora_hidden}); the loaded model is {model_side}. Use a LoRA made for {variant}."
            )
        made_for = encoder_model(lora_hidden)
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
    lora_of: dict[int, str] = field(default_factory=dict)  # id(patch) -> the name of its LoRA (its file)


def _plan(
    components: Mapping[str, nn.Module], loras: list[tuple[LoRA, float]]
) -> tuple[dict[tuple[str, str], _ModulePlan], dict[str, str]]:
    """Group patches by core module, check every shape, and list what cannot be applied: the keys,
    each as ``"<LoRA name>: <key>"`` when several LoRAs are applied together (two files often share
    key names), logged once per LoRA, naming it."""
    plans: dict[tuple[str, str], _ModulePlan] = {}
    skipped: dict[str, str] = {}
    tables = {c: dict(m.named_modules()) for c, m in components.items()}
    active = [(lora, strength) for lora, strength in loras if strength != 0.0]  # 0: exactly no LoRA, touch nothing
    for lora, strength in active:
        own: dict[str, str] = {}
        for patch in lora.patches:
            model = components.get(patch.component)
            if model is None:
                what = "text encoder" if patch.component == TEXT_ENCODER else "transformer"
                for key in patch.keys:
                    own[key] = f"not applied: no {what} was given to apply it to"
                continue
            module = tables[patch.component].get(patch.module)
            weight = _weight_of(module)
            if module is None or not isinstance(weight, torch.Tensor):
                raise _missing_module(lora, patch, model)
            n = patch.target.part[1] if patch.target.part else 1
            if weight.ndim != 2 or weight.shape[0] % n or patch.shape != (weight.shape[0] // n, weight.shape[1]):
                raise _misfit(lora, patch, model, tuple(weight.shape))
            if weight.dtype in FLOAT8_DTYPES and getattr(module, "weight_scale", None) is None:
                raise NotImplementedError(
                    f"{lora.name}: {patch.component} module {patch.module} has {weight.dtype} weights without a "
                    "scale (not an FP8Linear); load the model through klein_core's loaders to apply LoRAs."
                )
            key = (patch.component, patch.module)
            if key not in plans:
                plans[key] = _ModulePlan(patch.component, patch.module, module)
            plans[key].items.append((patch, strength))
            plans[key].lora_of[id(patch)] = lora.name
        log_skipped(lora.name, own)
        skipped.update({f"{lora.name}: {k}" if len(active) > 1 else k: why for k, why in own.items()})
    return plans, skipped


# Linears that keep packed blocks (no float weight to merge into): LoRAs apply to them as branches.
_PACKED = (GGMLLinear, NVFP4Linear)


def _weight_of(module: nn.Module | None) -> torch.Tensor | None:
    """A module's weight, or for a packed Linear (GGML blocks, NVFP4) a meta_model stand-in with
    its shape and compute dtype (on the meta device: branches work, merging is refused)."""
    if isinstance(module, _PACKED):
        return torch.empty((module.out_features, module.in_features), dtype=module.compute_dtype, device="meta")
    return getattr(module, "weight", None)


def _rows(patch: LoRAPatch, total: int) -> slice:
    if patch.target.part is None:
        return slice(0, total)
    i, n = patch.target.part
    size = total // n
    return slice(i * size, (i + 1) * size)


def _merge_fp8(plan: _ModulePlan, q: torch.Tensor) -> None:
    """Merge into an FP8Linear: dequantise, add the deltas in float32, re-quantise with a new
    absmax scale (per tensor, or per row when the layer has per-row scales). New tensors replace
    the codes and the scale: the originals (the caller's backup) are never written."""
    module = plan.module
    scale = module.weight_scale
    fmax = float(torch.finfo(q.dtype).max)
    base = _float_weight(module)
    delta = _summed_delta(plan, base)
    merged = base + delta
    _check_delta(plan, torch.float32, q, delta, merged)
    amax = merged.abs().amax(dim=1, keepdim=True) if scale.ndim == 1 else merged.abs().amax()
    new_scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    codes = (merged / new_scale).clamp(-fmax, fmax).to(q.dtype)
    new_scale = new_scale.reshape(scale.shape).to(scale.dtype)
    if scale.ndim == 1:
        # Rows no patch changes (k and v of a fused qkv under a LoRA on q) keep their codes and scale:
        # quantised again they would move by up to half a step.
        kept = ~(delta != 0).any(dim=1)
        codes.view(torch.uint8)[kept] = q.view(torch.uint8)[kept]
        new_scale[kept] = scale[kept]
    module.weight.data = codes
    module.weight_scale = new_scale


def _has_dora(plan: _ModulePlan) -> bool:
    return any(patch.dora is not None for patch, _ in plan.items)


def _summed_delta(plan: _ModulePlan, base: torch.Tensor) -> torch.Tensor:
    """The float32 change the module's patches make to its weight, on the weight's device:
    the sum of ``strength * delta``, or, where a patch has a DoRA magnitude, the patches applied in
    turn (as ComfyUI does) to ``base``, the current weight in float32 (only read then)."""
    if _has_dora(plan):
        weight = base.float().clone()
        for _ in _apply_in_turn(plan, weight):
            pass
        return weight - base
    delta = torch.zeros(base.shape, dtype=torch.float32, device=base.device)
    for patch, strength in plan.items:
        delta[_rows(patch, base.shape[0])] += strength * patch.delta(base.device)
    return delta


def _apply_in_turn(plan: _ModulePlan, weight: torch.Tensor
                   ) -> Iterator[tuple[LoRAPatch, float, slice, torch.Tensor | None]]:
    """Apply the module's patches to ``weight`` (float32 ``[out, in]``, changed in place) one after
    the other, as ComfyUI applies its patches; yields each patch with its strength, its rows and,
    for a DoRA patch that scales rows, its row factor ``c [out]`` (from the rows as the patches
    before it left them; else None) before the weight moves on."""
    for patch, strength in plan.items:
        rows = _rows(patch, weight.shape[0])
        if patch.dora is None:
            weight[rows] += strength * patch.delta(weight.device)
            yield patch, strength, rows, None
            continue
        delta = patch.delta(weight.device)  # computed once for both
        c = patch.dora_row_scale(weight[rows], strength, delta) if patch.dora_on_rows else None
        weight[rows] = patch.decompose(weight[rows], strength, delta=delta, row_scale=c)
        yield patch, strength, rows, c


def _float_weight(module: nn.Module) -> torch.Tensor:
    """A module's weight ``[out, in]`` in float32 as it computes with it: float8 times its scale,
    GGUF and NVFP4 blocks unpacked. A float32 weight is returned as it is (not a copy): read only."""
    if isinstance(module, _PACKED):
        return module.dequantized(torch.float32)
    weight = module.weight.detach()
    if weight.dtype in FLOAT8_DTYPES:
        return module.dequantized_weight(torch.float32)
    return weight.float()


def _overflow(plan: _ModulePlan, dtype: torch.dtype, how: str) -> ValueError:
    """The error for LoRAs whose finite factors make a non-finite delta (``1e30`` up and down
    factors: ``up @ down`` is ``1e60``) or one that does not fit ``dtype``: names the LoRA(s) (their
    files) and the module. Each patch is tried alone to find the culprit; if every one fits alone,
    their sum is what overflows and all are named."""
    names = []
    for patch, strength in plan.items:
        d = strength * patch.delta("cpu")
        if not is_finite(d) or not is_finite(d.to(dtype)):
            names.append(plan.lora_of.get(id(patch), "a LoRA"))
    together = not names
    if together:
        names = [plan.lora_of.get(id(p), "a LoRA") for p, _ in plan.items]
    names = list(dict.fromkeys(names))
    who = ", ".join(names)
    what = "their summed delta" if together else "its delta (up @ down, times scale and strength)"
    return ValueError(
        f"{who}: {what} for {plan.component} module {plan.name} is not finite in {str(dtype).removeprefix('torch.')} "
        f"({how}): the LoRA's factors are too large, so the LoRA is corrupt or its strength far too high. "
        "It was not applied; the model is unchanged.")


def _check_delta(plan: _ModulePlan, dtype: torch.dtype, original: torch.Tensor, delta: torch.Tensor,
                 merged: torch.Tensor) -> None:
    """Merge mode: refuse a delta that is not finite, or a merged weight that is not although the
    original was (an overflow in the weight dtype), before anything is written."""
    if not is_finite(delta):
        raise _overflow(plan, dtype, "the merge overflows float32")
    if not is_finite(merged) and is_finite(original):
        raise _overflow(plan, dtype, "the merged weight overflows")


def _check_branch_factors(plan: _ModulePlan, dtype: torch.dtype, rank: int, up: torch.Tensor,
                          down: torch.Tensor, product: Callable[[], torch.Tensor]) -> None:
    """Branch mode: the factors must fit ``dtype`` and so must the delta they multiply to. A cheap
    bound decides for almost every LoRA (``|delta| <= rank * max|up| * max|down|``); only where it
    does not is the delta formed (``product``) and checked."""
    if not (is_finite(up.to(dtype)) and is_finite(down.to(dtype))):
        raise _overflow(plan, dtype, "its factors overflow in the dtype the branch computes in")
    bound = rank * float(up.abs().amax()) * float(down.abs().amax()) if up.numel() and down.numel() else 0.0
    if bound < torch.finfo(dtype).max:
        return
    d = product()
    if not (is_finite(d) and is_finite(d.to(dtype))):
        raise _overflow(plan, dtype, "up @ down overflows")


# ---------------------------------------------------------------------------------------------
# Branch mode: a forward hook adding the adapter's output to the module's


def _kron_apply(w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, swap: bool) -> torch.Tensor:
    """``x @ kron(w1, w2).T`` without forming the Kronecker product: ``w1 @ X @ w2.T`` with ``x``
    viewed as ``X [b, d]``; ``swap``: the output halves swapped (diffusers' final-layer rows)."""
    lead = x.shape[:-1]
    xr = x.to(w1.dtype).reshape(*lead, w1.shape[1], w2.shape[1])  # [..., b, d]
    y = torch.einsum("ab,...bd,cd->...ac", w1, xr, w2).reshape(*lead, w1.shape[0] * w2.shape[0])  # [..., a*c]
    if swap:
        first, second = y.chunk(2, dim=-1)
        y = torch.cat([second, first], dim=-1)
    return y


@dataclass(frozen=True)
class _Step:
    """One patch of a module whose DoRA patches all scale rows, applied in turn on the output.

    ``tensors``: the patch's factors (``a``/``b``, ``w1``/``w2``, or a dense ``d``), times the
    strength except for ComfyUI's DoRA (which interpolates by it afterwards), and for a DoRA patch
    its row factor ``c [out]`` and ``cm1 = c - 1`` (kept apart: in bf16 ``c`` rounds to 1 where
    ``c - 1`` keeps its digits). With ``y`` the rows' output so far and ``d`` the patch's delta
    applied to ``x``: plain ``y + d``; PEFT ``c * (y + d)``; ComfyUI ``y + s * (c * (y + d) - y)``.
    """

    rows: slice
    dora: str | None
    strength: float
    tensors: dict[str, torch.Tensor | None]
    swap: bool = False


def _row_steps(plan: _ModulePlan, out_features: int, dtype: torch.dtype, device: torch.device) -> list[_Step]:
    """The module's patches as :class:`_Step` s: each DoRA patch's row factor is computed from the
    weight as the patches before it left it (the weight unpacked once, then dropped)."""
    running = _float_weight(plan.module).to(device, copy=True)  # changed in turn: never the model's own tensor
    steps = []
    for patch, strength, rows, c in _apply_in_turn(plan, running):
        fold = 1.0 if patch.dora == "comfyui" else strength
        t: dict[str, torch.Tensor] = {}
        if patch.kind == "lora":
            a, b = patch.factors(device)
            _check_branch_factors(plan, dtype, a.shape[0], b * fold, a, lambda a=a, b=b, f=fold: f * b @ a)
            t = {"a": a, "b": b * fold}
        elif patch.kind == "lokr":
            w1, w2 = patch.kron_factors(device)
            _check_branch_factors(plan, dtype, 1, w1 * fold, w2,
                                  lambda w1=w1, w2=w2, f=fold: f * torch.kron(w1, w2))
            t = {"w1": w1 * fold, "w2": w2}
        else:
            t = {"d": patch.delta(device) * fold}
        if c is not None:
            if not is_finite(c):
                raise _overflow(plan, dtype, "its DoRA magnitude divides by a weight row of norm zero")
            t.update(c=c, cm1=c - 1)
        kept: dict[str, torch.Tensor | None] = {n: v.to(dtype) for n, v in t.items()}
        steps.append(_Step(rows, patch.dora, strength, kept, swap=patch.kind == "lokr" and patch.target.swap_halves))
    return steps


class LoRABranch:
    """Forward hook adding the LoRAs' output to one Linear's: ``out + x @ A.T @ B.T + ...``.

    * Low-rank patches: ``A`` ``[R, in]`` and ``B`` ``[out, R]`` concatenate them all (strength
      and scale folded into B, q/k/v parts zero-padded to the fused rows, halves swapped).
    * LoKr patches stay factored: ``kron(w1, w2) @ x`` is ``w1 @ X @ w2.T`` with ``x`` viewed as
      ``X [b, d]``, so a Kronecker delta never has to exist as a full ``[out, in]`` matrix.
    * LoHa and full deltas have no such form: their sum ``D`` ``[out, in]`` is kept dense (as
      large as the weight).
    * A module with DoRA patches that scale rows (PEFT's, LyCORIS' ``[out, 1]``) runs its patches
      in turn on the output (:class:`_Step`: the factors and two row vectors); one with a scale
      per input column keeps its whole change dense (``D = W' - W``, from its weight unpacked once).

    Factors are kept in the weight dtype and follow the input to its device.
    """

    def __init__(self, plan: _ModulePlan, weight: torch.Tensor) -> None:
        out_features = weight.shape[0]
        # fp8 layers compute in their activation dtype; keep the factors in bf16 for them
        dtype = torch.bfloat16 if weight.dtype in FLOAT8_DTYPES else weight.dtype
        device = weight.device if weight.device.type != "meta" else torch.device("cpu")  # moved on first call
        self.out_features = out_features
        a_parts, b_parts = [], []
        self.kron: list[tuple[torch.Tensor, torch.Tensor, slice, bool]] = []
        dense: torch.Tensor | None = None
        self.steps: list[_Step] = []
        dora = _has_dora(plan)
        if dora and all(patch.dora is None or patch.dora_on_rows for patch, _ in plan.items):
            self.steps = _row_steps(plan, out_features, dtype, device)
        elif dora:
            # A DoRA magnitude on the input columns rescales what enters the weight, which no
            # branch on the output expresses: the module's whole change is kept dense, computed
            # from its weight (unpacked once).
            base = _float_weight(plan.module).to(device)
            dense = _summed_delta(plan, base)
            del base
        for patch, strength in ([] if dora else plan.items):
            rows = _rows(patch, out_features)
            if patch.kind == "lora":
                a, b = patch.factors(device)
                b = b * strength
                _check_branch_factors(plan, dtype, a.shape[0], b, a, lambda a=a, b=b: b @ a)
                b_full = torch.zeros(out_features, b.shape[1], dtype=torch.float32, device=device)
                b_full[rows] = b
                a_parts.append(a)
                b_parts.append(b_full)
            elif patch.kind == "lokr":
                w1, w2 = patch.kron_factors(device)
                w1 = w1 * strength
                _check_branch_factors(plan, dtype, 1, w1, w2, lambda w1=w1, w2=w2: torch.kron(w1, w2))
                self.kron.append((w1.to(dtype), w2.to(dtype), rows, patch.target.swap_halves))
            else:
                if dense is None:
                    dense = torch.zeros(weight.shape, dtype=torch.float32, device=device)
                dense[rows] += strength * patch.delta(device)
        self.a = torch.cat(a_parts).to(dtype) if a_parts else None
        self.b = torch.cat(b_parts, dim=1).to(dtype) if b_parts else None
        if dense is not None and not (is_finite(dense) and is_finite(dense.to(dtype))):
            raise _overflow(plan, dtype, "the delta overflows")
        self.dense = dense.to(dtype) if dense is not None else None
        self._names: dict[str, str] = {}  # factor -> buffer name on the hooked module, once attached

    def _factor_items(self) -> list[tuple[str, torch.Tensor]]:
        items = [(n, t) for n, t in (("a", self.a), ("b", self.b), ("dense", self.dense)) if t is not None]
        for k, (w1, w2, _, _) in enumerate(self.kron):
            items += [(f"kron{k}_1", w1), (f"kron{k}_2", w2)]
        for k, step in enumerate(self.steps):
            items += [(f"step{k}_{n}", t) for n, t in step.tensors.items()]
        return items

    def attach(self, module: nn.Module) -> list[str]:
        """Keep the factors as non-persistent buffers of ``module`` (returns their names).

        Why buffers rather than attributes of the hook: every memory tool sees a module's buffers.
        A block streamed by the BlockOffloader (or a component staged by ``on_device``) then
        brings its LoRA factors to the device with its weights and takes them back with them,
        and ``module_bytes`` (the planner's sizes) counts them. Kept as plain attributes, the
        factors were moved to the compute device on the first call and left there: every block's
        factors piled up on the GPU during a streamed run and stayed after it, uncounted.
        Non-persistent: a state dict of the model stays that of the base weights.
        """
        # The first free index on this module, not a global counter: a copy made again the same
        # way gets the same names, so a compiled block's graph (guarded on them) is reused.
        k = 0
        while any(n.startswith(f"klein_lora{k}_") for n in module._buffers):
            k += 1
        base = f"klein_lora{k}_"
        # A packed layer's factors were made on the CPU (its weight stand-in is on meta): give them
        # the module's device, or a resident GPU model would copy them in on every call.
        home = next((t.device for t in module.parameters(recurse=False) if t.device.type != "meta"),
                    next((t.device for t in module.buffers(recurse=False) if t.device.type != "meta"), None))
        for name, t in self._factor_items():
            t = t if home is None else t.to(home)
            buffer = base + name
            module.register_buffer(buffer, t, persistent=False)
            self._names[name] = buffer
        # The module holds the factors now; the hook reads them from it at each call.
        self.a = self.b = self.dense = None
        self.steps = [replace(step, tensors=dict.fromkeys(step.tensors)) for step in self.steps]
        self.kron = [(None, None, rows, swap) for _, _, rows, swap in self.kron]  # type: ignore[misc]
        return list(self._names.values())

    def detach(self, module: nn.Module) -> None:
        """Drop the factor buffers :meth:`attach` put on ``module``."""
        for buffer in self._names.values():
            module._buffers.pop(buffer, None)

    def _factors(self, module: nn.Module, device: torch.device) -> tuple[Any, Any, Any, list[Any]]:
        """The factors on ``device``: read from ``module``'s buffers (wherever the memory tools put
        them). One not on ``device`` (a packed layer's, made on the CPU, or a module moved without
        its buffers) is copied for this call only, never stored: the module keeps its home copy."""
        def get(name: str, own: torch.Tensor | None) -> torch.Tensor | None:
            t = module._buffers.get(self._names[name]) if name in self._names else own
            return t if t is None or t.device == device else t.to(device)

        kron = []
        for k, (w1, w2, rows, swap) in enumerate(self.kron):
            kron.append((get(f"kron{k}_1", w1), get(f"kron{k}_2", w2), rows, swap))
        return get("a", self.a), get("b", self.b), get("dense", self.dense), kron

    def _run_steps(self, module: nn.Module, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """A module with row-scaling DoRA patches: its patches in turn on the output (see :class:`_Step`)."""
        # The module's output is a fresh tensor that nothing else holds yet: changed in place, unless
        # autograd needs it as it was.
        out = output.clone() if torch.is_grad_enabled() and output.requires_grad else output
        for k, step in enumerate(self.steps):
            t = {n: self._buffer(module, f"step{k}_{n}", x.device) for n in step.tensors}
            if "a" in t:
                d = F.linear(F.linear(x.to(t["a"].dtype), t["a"]), t["b"])
            elif "w1" in t:
                d = _kron_apply(t["w1"], t["w2"], x, step.swap)
            else:
                d = F.linear(x.to(t["d"].dtype), t["d"])
            d = d.to(out.dtype)  # a new tensor: changed in place below
            y = out[..., step.rows]  # a view: the rows' output so far
            if step.dora is not None:  # d becomes c * d + (c - 1) * y
                d.mul_(t["c"].to(out.dtype)).addcmul_(y, t["cm1"].to(out.dtype))
            # PEFT: c * (y + s * delta x) (s folded into d); ComfyUI: y + s * (c * (y + delta x) - y)
            y.add_(d, alpha=step.strength if step.dora == "comfyui" else 1.0)
        return out

    def _buffer(self, module: nn.Module, name: str, device: torch.device) -> torch.Tensor:
        t = module._buffers[self._names[name]] if name in self._names else None
        if t is None:
            raise RuntimeError(f"the LoRA branch's {name} is not on the module; attach() the branch first")
        return t if t.device == device else t.to(device)

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        if self.steps:
            return self._run_steps(module, x, output)
        a, b, dense, kron = self._factors(module, x.device)
        # The module's output is a fresh tensor that nothing else holds yet: the LoRAs are added into it
        # in place, unless autograd needs it as it was. Added out of place, each branched Linear held
        # two output-sized temporaries beside its output (a tiny transformer's forward peaked 41 %
        # higher than with the LoRA merged, above the planner's estimate).
        if not (torch.is_grad_enabled() and output.requires_grad) and output.is_contiguous():
            return self._add_into(output, x, a, b, dense, kron)
        extra = None
        if a is not None and b is not None:
            extra = F.linear(F.linear(x.to(a.dtype), a), b)
        if dense is not None:
            d = F.linear(x.to(dense.dtype), dense)
            extra = d if extra is None else extra + d
        if kron:
            lead = x.shape[:-1]
            if extra is None:
                extra = x.new_zeros(*lead, self.out_features, dtype=kron[0][0].dtype)
            for w1, w2, rows, swap in kron:
                extra[..., rows] = extra[..., rows] + _kron_apply(w1, w2, x, swap).to(extra.dtype)
        return output if extra is None else output + extra.to(output.dtype)

    def _add_into(self, output: torch.Tensor, x: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor | None,
                  dense: torch.Tensor | None, kron: list[tuple[torch.Tensor, torch.Tensor, slice, bool]]) -> torch.Tensor:
        """``output`` plus the LoRAs, computed into ``output`` (no output-sized temporaries where the
        factors share its dtype: one ``addmm_`` per part)."""
        out2d = output.view(-1, self.out_features)

        def add(inputs: torch.Tensor, weight: torch.Tensor) -> None:  # out2d += inputs @ weight.T
            inputs = inputs.reshape(-1, weight.shape[1])
            if weight.dtype == output.dtype:
                out2d.addmm_(inputs, weight.t())
            else:
                out2d.add_(F.linear(inputs, weight).to(output.dtype))

        if a is not None and b is not None:
            add(F.linear(x.to(a.dtype), a), b)
        if dense is not None:
            add(x.to(dense.dtype), dense)
        for w1, w2, rows, swap in kron:
            output[..., rows] += _kron_apply(w1, w2, x, swap).to(output.dtype)
        return output


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
    ``skipped``: source keys not applied in this call, with reasons, each as ``"<LoRA name>: <key>"``
    when several LoRAs were applied together (plus each LoRA's own ``LoRA.skipped``).
    """

    def __init__(self, mode: str, loras: list[tuple[LoRA, float]], skipped: dict[str, str]) -> None:
        self.mode = mode
        self.loras = [(lora.name, strength) for lora, strength in loras]
        self.skipped = skipped
        self.modules: list[str] = []
        self._backups: list[tuple[nn.Module, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._branches: list[tuple[nn.Module, LoRABranch]] = []
        # Weak: the handle sits in _MERGED under each model, and a strong reference from the value to
        # its own key would keep the model (and its backups) alive after its owner let both go.
        self._model_refs: list[weakref.ref[nn.Module]] = []
        self.active = True

    @property
    def _models(self) -> list[nn.Module]:
        """The models the LoRAs were applied to that are still alive."""
        return [m for ref in self._model_refs if (m := ref()) is not None]

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
            for module, branch in self._branches:  # the factors, kept as the modules' buffers
                branch.detach(module)
            self._branches.clear()
        self.active = False
        logger.info("removed LoRAs %s (%s mode)", self.loras, self.mode)


def apply_loras(
    models: nn.Module | Sequence[nn.Module] | Mapping[str, nn.Module],
    loras: LoRASpec | Sequence[LoRASpec],
    *,
    mode: str = "merge",
) -> AppliedLoRAs:
    """Apply LoRAs to a transformer and/or text encoder in place -> :class:`AppliedLoRAs` (``remove()``
    restores the model bit-exactly).

    Args:
        models: a :class:`Flux2Transformer`, :class:`Qwen3TextEncoder` or several; others are reported.
        loras: ``[(lora, strength), ...]`` (a bare :class:`LoRA`: strength 1); any finite strength.
        mode: ``"merge"``: ``W += sum(strength * delta)`` in float32, written back in the weight dtype
            (order-independent; a module with a DoRA patch takes its patches in turn, see
            :meth:`LoRAPatch.decompose`); ``"branch"``: a forward hook adds ``strength * scale * x @ A.T
            @ B.T`` (a DoRA module: its output rows scaled, see :class:`LoRABranch`).

    Raises ValueError (a LoRA for another model size), NotImplementedError (float8 weight, no scale).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    components = _components(models)
    items = _normalise(loras)
    plans, skipped = _plan(components, items)
    handle = AppliedLoRAs(mode, items, skipped)
    handle._model_refs = [weakref.ref(m) for m in components.values()]
    try:
        _apply_plans(handle, plans, mode)
    except BaseException:
        handle.remove()  # nothing half-applied: the modules done so far are restored (or unhooked)
        raise
    if mode == "merge":
        for model in handle._models:
            _MERGED.setdefault(model, []).append(handle)
    logger.info("applied %s to %d modules (%s mode)", handle.loras, len(handle.modules), mode)
    return handle


def _apply_plans(handle: AppliedLoRAs, plans: dict[tuple[str, str], _ModulePlan], mode: str) -> None:
    for (comp, name), plan in plans.items():
        weight = _weight_of(plan.module)
        if mode == "merge" and isinstance(plan.module, _PACKED):
            blocks = f"GGUF {plan.module.qtype.name}" if isinstance(plan.module, GGMLLinear) else "NVFP4"
            raise NotImplementedError(
                f"{comp} module {name} holds {blocks} blocks, which a LoRA cannot be merged "
                "into exactly; apply the LoRA as a branch (mode='branch', what the LoRA node does).")
        if mode == "merge":
            original = weight.detach()
            if original.dtype in FLOAT8_DTYPES:
                # The backup first: an interrupted copy (Ctrl+C, host memory short) then leaves this
                # module as it was, and the modules done so far are restored.
                handle._backups.append((plan.module, (original.to("cpu"), plan.module.weight_scale.to("cpu"))))
                _merge_fp8(plan, original)
                handle.modules.append(f"{comp}:{name}")
                continue
            base = original.float()
            delta = _summed_delta(plan, base)
            merged = (base + delta).to(original.dtype)
            _check_delta(plan, original.dtype, original, delta, merged)
            # The merged weight is a new tensor: the original storage is never written, so it is
            # the exact backup (on the CPU: no copy at all) and any state dict the model was
            # loaded from, which may share that storage, stays intact. The backup is taken before
            # the weight changes (see above).
            handle._backups.append((plan.module, original.to("cpu")))
            weight.data = merged
        else:
            branch = LoRABranch(plan, weight)
            branch.attach(plan.module)
            handle._branches.append((plan.module, branch))
            handle._hooks.append(plan.module.register_forward_hook(branch))
        handle.modules.append(f"{comp}:{name}")


def exact_mode(*models: nn.Module | None) -> str:
    """The mode :func:`apply_loras` can apply exactly to ``models`` (None entries ignored): ``"merge"``,
    or ``"branch"`` when any holds packed blocks (GGUF, NVFP4), which a merged LoRA cannot be written
    into exactly (a small cost per step instead)."""
    packed = any(isinstance(m, _PACKED) for model in models if model is not None for m in model.modules())
    return "branch" if packed else "merge"


def has_loras(model: nn.Module) -> bool:
    """Whether ``model`` computes with LoRAs now: merged into its weights, or as branch hooks
    (:func:`apply_loras` in either mode, or a :func:`with_loras` copy). Caches of its outputs
    keyed by the model's file would be stale."""
    if _MERGED.get(model):
        return True
    return any(isinstance(hook, LoRABranch) for m in model.modules() for hook in m._forward_hooks.values())


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
    """A new module object sharing all tensors with ``m`` but with its own child/param/hook dicts.

    An instance attribute bound to ``m`` that knows how to bind itself to a copy (``klein_rebind``:
    a compiled ``forward`` of klein_core.accel) is bound anew, so the copy runs its own children,
    LoRA branches included, not ``m``'s.
    """
    c = copy.copy(m)
    for k, v in vars(m).items():
        if isinstance(v, (dict, set)):  # _modules, _parameters, _buffers, hook dicts...
            c.__dict__[k] = copy.copy(v)
        elif callable(getattr(v, "klein_rebind", None)):
            c.__dict__[k] = v.klein_rebind(c)
    return c


def with_loras(model: nn.Module, loras: LoRASpec | Sequence[LoRASpec]) -> nn.Module:
    """A copy of ``model`` with LoRAs applied as branches; ``model`` itself is not changed.

    The copy shares every parameter tensor with ``model``. Only the touched Linear modules, their
    parents and the repeated blocks are new objects (shallow copies; the touched Linears carry
    :class:`LoRABranch` hooks), so the copy costs the LoRA factors, not the weights, and switching
    its speed (klein_core.accel) leaves ``model``'s blocks as they are. Chaining works: ``with_loras(with_loras(m, a), b)``.
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

    def copied(name: str) -> nn.Module:
        """The copy at ``name``, copying each module on the way that is not a copy yet."""
        parent, path = root, ""
        for part in name.split("."):
            path = f"{path}.{part}" if path else part
            if path not in copies:
                copies[path] = _shallow_copy(parent._modules[part])  # type: ignore[arg-type]
                parent._modules[part] = copies[path]
            parent = copies[path]
        return parent

    for (_, name), plan in plans.items():
        module = copied(name)
        branch = LoRABranch(plan, _weight_of(module))  # type: ignore[arg-type]
        branch.attach(module)  # on the copy's own buffer dict: the input model gains nothing
        module.register_forward_hook(branch)
    # Every repeated block is copied too, adapted or not (objects only; the tensors stay shared):
    # switching the copy's speed then compiles or uncompiles the copy's blocks, never the model's.
    for list_name, blocks in model.named_children():
        if isinstance(blocks, nn.ModuleList):
            for i in range(len(blocks)):
                copied(f"{list_name}.{i}")
    logger.info("patched copy with %s: %d modules", [(lora.name, s) for lora, s in items], len(plans))
    return root
