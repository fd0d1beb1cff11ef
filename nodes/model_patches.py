"""ComfyUI's FLUX model patches, run on the Klein transformer behind Klein Model to MODEL.

ComfyUI's own FLUX model reads these from ``transformer_options`` while it runs, and core nodes rely
on them (SkipLayerGuidanceDiT, NAGuidance in current ComfyUI, ControlNets):

* ``patches_replace["dit"][("double_block", i)]`` / ``[("single_block", i)]``: called instead of
  block ``i`` with the block's inputs (``img``, ``txt``, ``vec``, ``pe``, ``attn_mask``,
  ``transformer_options``) and ``{"original_block": ...}``;
* ``patches["attn1_output_patch"]``: functions ``(out, extra_options) -> out`` on every block's joint
  attention output ``[B, L, H*D]`` (text tokens first; ``extra_options["img_slice"]`` = [text
  tokens, L]), as current ComfyUI's FLUX blocks apply them (0.3.75's do not apply them at all);
* ``control``: ControlNet residuals added to the image tokens after each block.

:class:`FluxPatches` runs one forward's blocks with them (klein_core's ``blocks_runner``), in the
same places and order as ComfyUI's FLUX, and sets ``block_type`` / ``block_index`` /
``total_blocks`` / ``img_slice`` in ``transformer_options`` as it does. ``vec`` and ``pe`` are
klein_core's: ``(image modulation, text modulation)`` for a double block and the single-stream
modulation for a single one, and ``(cos, sin)`` RoPE tables. A patch that passes them on or replaces a
block outright (skips it, changes its output) works; one that computes with ComfyUI's own layouts of
them fails, and its error names the patch.

:func:`check_patches` refuses, before a step runs, the patches ComfyUI's FLUX applies where the
Klein model has nothing equivalent (``attn1_patch``: queries and keys before RoPE in ComfyUI's layout;
``post_input``), and says once which patches it leaves alone: kinds ComfyUI's FLUX ignores too (UNet
patches), block replacements for blocks the model does not have, and ComfyUI's attention override.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from klein_core.models.transformer import BlockStack
from klein_core.pipeline.oom import is_out_of_memory

logger = logging.getLogger(__name__)

NODE = "Klein Model to MODEL"
APPLIED = ("attn1_output_patch",)  # transformer_options["patches"] kinds run here
# The kinds ComfyUI's FLUX applies at places klein_core's blocks do not expose: refused, never dropped.
REFUSED = {
    "attn1_patch": "changes the queries and keys before RoPE in ComfyUI's own FLUX layout, which the "
                   "Klein model computes fused (QK norm and RoPE in one step)",
    "post_input": "changes the embedded tokens and their position ids before the first block, which the "
                  "Klein model does not expose",
}
_PATCH_ERRORS = (TypeError, AttributeError, KeyError, IndexError, ValueError, RuntimeError)


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def check_patches(options: dict, depth: int, depth_single: int, model_name: str,
                  warned: set[str]) -> None:
    """Refuse the patches in ``options`` the Klein model cannot apply; warn once (per ``warned``) about
    the ones it leaves alone as ComfyUI's FLUX would, or cannot honour without changing the result."""
    patches = options.get("patches") or {}
    refused = [k for k in REFUSED if patches.get(k)]
    if refused:
        what = "; ".join(f"'{k}' ({', '.join(_name(p) for p in patches[k])}) {REFUSED[k]}" for k in refused)
        raise ValueError(f"{NODE}: the model {model_name} carries a ComfyUI model patch it cannot apply: {what}. "
                         f"Remove the node that adds it, or run it on a model from ComfyUI's own FLUX.2 loader.")
    notes = []
    ignored = sorted(k for k, v in patches.items() if v and k not in APPLIED)
    if ignored:
        notes.append(f"model patches {', '.join(ignored)} have no effect: FLUX models do not read them (ComfyUI's "
                     "own FLUX ignores them too)")
    replaces = options.get("patches_replace") or {}
    other = sorted(k for k, v in replaces.items() if v and k != "dit")
    if other:
        notes.append(f"replacement patches '{', '.join(other)}' have no effect: FLUX models read only 'dit' ones")
    have = {"double_block": depth, "single_block": depth_single}
    missing = sorted(f"{key[0]} {key[1]}" for key in (replaces.get("dit") or {})
                     if not (isinstance(key, tuple) and len(key) == 2 and key[0] in have
                             and isinstance(key[1], int) and 0 <= key[1] < have[key[0]]))
    if missing:
        notes.append(f"block patches have no effect on blocks this model does not have: {', '.join(missing)} (it "
                     f"has double_block 0-{depth - 1} and single_block 0-{depth_single - 1})")
    if options.get("optimized_attention_override") is not None:
        notes.append("ComfyUI's attention override (a patch node's attention function) has no effect: the "
                     "Klein model runs its own attention backend")
    for note in notes:
        if note not in warned:
            warned.add(note)
            logger.warning("%s (%s): %s.", NODE, model_name, note)


class _OutputPatchedOps:
    """The blocks' ops with ``attn1_output_patch`` applied to every attention output; everything else is
    the wrapped ops' own (the fast kernels stay)."""

    def __init__(self, inner: Any, run: FluxPatches) -> None:
        self._inner = inner
        self._run = run

    def bind(self, device: torch.device, dtype: torch.dtype) -> _OutputPatchedOps:
        return _OutputPatchedOps(self._inner.bind(device, dtype), self._run)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self._inner.attention(q, k, v)
        return self._run.patch_attention(out)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class FluxPatches:
    """One forward's ComfyUI patches, run as klein_core's ``blocks_runner`` (see the module docstring).

    ``options``: the forward's ``transformer_options`` (updated with the block being run, as ComfyUI's
    FLUX does); ``control``: ControlNet residuals ``{"input": [...], "output": [...]}`` or None. Build
    it with :meth:`of`, which gives None when the forward has nothing to patch."""

    def __init__(self, options: dict, control: Any, model_name: str) -> None:
        self.options = options
        self.control = control or {}
        self.model_name = model_name
        self.replace: dict = (options.get("patches_replace") or {}).get("dit") or {}
        self.output_patches: list[Callable] = list((options.get("patches") or {}).get("attn1_output_patch") or ())
        self.text_tokens = 0  # L, the text tokens first in the joint sequence: set when the blocks run

    @classmethod
    def of(cls, options: dict, control: Any, model_name: str) -> FluxPatches | None:
        """The runner for a forward with ``options`` / ``control``, or None when there is nothing to run."""
        patches = cls(options, control, model_name)
        return patches if patches.replace or patches.output_patches or patches.control else None

    def patch_attention(self, out: torch.Tensor) -> torch.Tensor:
        """``attn1_output_patch`` on one block's attention output ``[B, L, H*D]``."""
        extra = dict(self.options)
        extra["img_slice"] = [self.text_tokens, out.shape[1]]
        for p in self.output_patches:
            out = p(out, extra)
        return out

    def __call__(self, blocks: BlockStack, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        if self.output_patches:
            blocks = replace(blocks, ops=_OutputPatchedOps(blocks.ops, self))
        opts = self.options
        self.text_tokens = c.shape[1]
        n_double, n_single = len(blocks.model.double_blocks), len(blocks.model.single_blocks)
        opts["total_blocks"], opts["block_type"] = n_double, "double"
        for i in range(n_double):
            opts["block_index"] = i
            key = ("double_block", i)
            x, c = blocks.double(i, x, c) if key not in self.replace else self._double(blocks, i, x, c)
            x = self._add_control("input", i, x, 0)
        n_txt = c.shape[1]
        h = torch.cat([c, x], dim=1)
        opts["total_blocks"], opts["block_type"] = n_single, "single"
        opts["img_slice"] = [n_txt, h.shape[1]]
        for i in range(n_single):
            opts["block_index"] = i
            h = blocks.single(i, h) if ("single_block", i) not in self.replace else self._single(blocks, i, h)
            h = self._add_control("output", i, h, n_txt)
        return h[:, n_txt:]

    def _double(self, blocks: BlockStack, i: int, x: torch.Tensor,
                c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def original_block(args: dict) -> dict:
            (cos, sin), (mod_img, mod_txt) = args["pe"], args["vec"]
            img, txt = replace(blocks, cos=cos, sin=sin, mod_img=mod_img, mod_txt=mod_txt).double(
                i, args["img"], args["txt"])
            return {"img": img, "txt": txt}

        args = {"img": x, "txt": c, "vec": (blocks.mod_img, blocks.mod_txt), "pe": (blocks.cos, blocks.sin),
                "attn_mask": None, "transformer_options": self.options}
        out = self._call(("double_block", i), args, original_block)
        return out["img"], out["txt"]

    def _single(self, blocks: BlockStack, i: int, h: torch.Tensor) -> torch.Tensor:
        def original_block(args: dict) -> dict:
            cos, sin = args["pe"]
            return {"img": replace(blocks, cos=cos, sin=sin, mod_single=args["vec"]).single(i, args["img"])}

        args = {"img": h, "vec": blocks.mod_single, "pe": (blocks.cos, blocks.sin), "attn_mask": None,
                "transformer_options": self.options}
        return self._call(("single_block", i), args, original_block)["img"]

    def _call(self, key: tuple[str, int], args: dict, original_block: Callable[[dict], dict]) -> dict:
        patch = self.replace[key]
        try:
            return patch(args, {"original_block": original_block})
        except _PATCH_ERRORS as exc:
            if is_out_of_memory(exc):
                raise
            raise RuntimeError(
                f"{NODE}: the ComfyUI block patch {_name(patch)} for dit {key[0]} {key[1]} failed on the Klein "
                f"model {self.model_name}: {type(exc).__name__}: {exc}. The Klein model gives block patches its "
                f"own 'vec' (modulation) and 'pe' (RoPE cos, sin) values: a patch that skips or replaces a block, "
                f"or changes its output, works; one that computes with ComfyUI's own FLUX layouts of 'vec' or "
                f"'pe' needs a model from ComfyUI's own FLUX.2 loader.") from exc

    def _add_control(self, which: str, i: int, x: torch.Tensor, start: int) -> torch.Tensor:
        """ControlNet residual ``i`` of ``which`` added to the image tokens from ``start``, as ComfyUI's FLUX
        adds it in place (computed in the wider dtype, stored in the tokens')."""
        adds = self.control.get(which) or ()
        add = adds[i] if i < len(adds) else None
        if add is None:
            return x
        n = add.shape[1]
        mid = (x[:, start:start + n] + add).to(x.dtype)
        return torch.cat([x[:, :start], mid, x[:, start + n:]], dim=1)


__all__ = ["APPLIED", "REFUSED", "FluxPatches", "check_patches"]
