"""Speed, peak memory and output agreement of klein_core against diffusers' Flux2KleinPipeline.

Builds full-size random-weight FLUX.2 Klein 4B / 9B components directly on the GPU in bf16 (the
modules are built on the meta device, ``to_empty``-ed onto the GPU and filled by a random init on
the device; nothing goes through the CPU): the transformer, the Qwen3 text encoder (27 layers for
klein_core; the full 36-layer ``Qwen3ForCausalLM`` that diffusers runs, sharing those 27 layers)
and the full VAE. diffusers' ``Flux2Transformer2DModel`` and ``AutoencoderKLFlux2`` get *the same*
weights, converted from the BFL layout to diffusers names as views (q/k/v split, final-layer
halves swapped), so both pipelines run on one copy of memory.

Cases (``--cases``):

* ``a``: text-to-image 1024x1024, 4 steps (distilled);
* ``b``: edit, 1024x1024 output with two 1024x1024 references, 4 steps (distilled);
* ``c``: base model, 1024x1024, 50 steps, guidance 4 (CFG with the empty negative prompt).

For each case and model it times, warm, the median of ``--runs`` runs: text encoding, reference
encoding, every denoising step, the VAE decode (CUDA events around the modules), end to end
(host clock around the whole call, synchronised, prompt to PIL image), and the peak GPU memory.
Variants (``--variants``, in this order):

* ``diffusers``: diffusers' Flux2KleinPipeline as it comes (native SDPA, eager);
* ``diffusers+compile``: diffusers at its best: cuDNN attention (``set_attention_backend(
  "_native_cudnn")``), ``compile_repeated_blocks()`` on the transformer and the VAE encoder and
  decoder compiled;
* ``plain``: klein_core's reference path;
* ``default``: what the nodes and the CLI run by default (``speed="fast"``,
  :mod:`klein_core.accel.speed`); the name stays ``default`` whatever that is, so results from
  different commits compare;
* ``compile``: ``speed="compile"`` (the nodes' "fast + compile");
* ``compile+encoder``: ``compile`` with the VAE encoder compiled too
  (``enable_fast_vae(compile_encoder=True)``), against ``compile``'s eager encoder with the fused
  norms in one process;
* ``default+step_cache``: ``default`` with the opt-in step cache
  (:mod:`klein_core.accel.step_cache`, ``--cache-threshold``); approximate, so its latents' relative
  L2 and pixel difference against ``default`` are reported beside its speed;
* ``default+trim`` / ``compile+trim``: ``default`` / ``compile`` with the prompt padded to a multiple
  of 64 tokens instead of 512 (``TextOptions(trim=64)``, opt-in); approximate, so its difference
  against ``default`` is reported beside its speed, and its TFLOP/s count the tokens it ran;
* ``fast[<attention>]`` for each backend in ``--attention``: the fast path with that attention.

It reports the max abs difference of the final latents and the decoded images between every
variant and the first one, speed-ups against both diffusers variants, the transformer step's
achieved TFLOP/s (matmul and attention FLOPs of one forward, :func:`step_flops`) against the bf16
peak, counts host-device synchronisations inside klein_core's denoising loop (CUDA only), records the
Python garbage collections and torch.compile compilations inside each variant's timed runs
(``host_audit``, :mod:`benchmarks.host_audit`), prints a table and writes everything to ``--out``.

Peak memory: all pipelines share one copy of the weights, so for each run the script reports the
activation peak (``max_memory_allocated`` minus what was allocated at the start of the run, after
``reset_peak_memory_stats``) and the pipeline peak = its own components' weight bytes + that
activation peak (what the pipeline would peak at on its own).

Warm-up runs (``--warmup``, default 1) come first and are reported as ``first_call_ms``
(torch.compile compiles there). ``--tiny`` shrinks everything (64x64, 4 steps in every case, fp32 on the
CPU) to test the script itself.

Usage (GPU, from the repository root; diffusers is imported only when used)::

    python benchmarks/speed.py --models 4b --cases a,b --runs 3 \
        --variants diffusers,diffusers+compile,plain,default,compile --out s4.json
    python benchmarks/speed.py --models 4b --cases c --runs 1 --variants diffusers,default,default+step_cache \
        --out s4c.json
    python benchmarks/speed.py --models 9b --cases a,b --runs 3 --out s9.json
    python benchmarks/speed.py --tiny --runs 1 --out /tmp/speed_tiny.json   # CPU self-test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO))

import klein_core
from benchmarks.host_audit import HostAudit
from benchmarks.peers import diffusers_flux2_transformer
from klein_core.accel import fast, speed, step_cache
from klein_core.files.transformer_layout import bfl_to_diffusers
from klein_core.models import (
    Flux2Transformer,
    Flux2VAE,
    Qwen3Config,
    Qwen3TextEncoder,
    TransformerConfig,
    VAEConfig,
)
from klein_core.models.variants import KLEIN_4B, KLEIN_9B
from klein_core.pipeline.prompts import TRIM_MULTIPLE, TextOptions
from klein_core.pipeline.sampling import make_noise, pack
from klein_core.pipeline.tokenizer import tokenize_prompts
from klein_core.testing.fill import full_size_configs, random_fill_
from klein_core.testing.sync import sync_callers

logger = logging.getLogger("speed")

PROMPT = "a red fox sitting in fresh snow at golden hour, detailed fur, 85mm photograph"
SEED = 1234
GiB = 1024**3

# ---------------------------------------------------------------------------------------------
# Model sizes


@dataclass(frozen=True)
class ModelSpec:
    name: str
    transformer: TransformerConfig
    text: Qwen3Config
    text_layers_hf: int  # layers of the full Qwen3 that diffusers runs
    vae: VAEConfig


def _spec(name: str) -> ModelSpec:
    if name in ("4b", "9b"):
        variant = KLEIN_4B if name == "4b" else KLEIN_9B
        tr, te, vae = full_size_configs(variant)
        return ModelSpec(variant.name, tr, te, 36, vae)
    if name == "tiny":
        tr = TransformerConfig(hidden_size=64, num_heads=2, depth=1, depth_single=2, context_dim=96,
                               mlp_hidden=192, axes_dim=(8, 8, 8, 8))
        te = Qwen3Config(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         intermediate_size=64, vocab_size=151936, num_layers_in_file=36)
        vae = VAEConfig(block_channels=(32,) * 4, decoder_block_channels=(32,) * 4, num_res_blocks=1)
        return ModelSpec("tiny", tr, te, 36, vae)
    raise ValueError(f"unknown model {name!r}: use 4b, 9b (or --tiny)")


@dataclass(frozen=True)
class Case:
    key: str
    title: str
    size: int
    steps: int
    guidance: float
    distilled: bool
    n_refs: int


def _cases(tiny: bool) -> dict[str, Case]:
    # --tiny only checks the script's plumbing: small images, and fewer base steps to stay quick.
    s, base_steps = (64, 4) if tiny else (1024, 50)
    return {
        "a": Case("a", f"text-to-image {s}x{s}, 4 steps", s, 4, 1.0, True, 0),
        "b": Case("b", f"edit {s}x{s}, two {s}x{s} references, 4 steps", s, 4, 1.0, True, 2),
        "c": Case("c", f"base {s}x{s}, {base_steps} steps, guidance 4 (CFG)", s, base_steps, 4.0, False, 0),
    }


def step_flops(cfg: TransformerConfig, image_tokens: int, text_tokens: int, batch: int) -> float:
    """Floating-point operations of one transformer forward: every Linear (2 x tokens x in x out)
    and the attention products (QK^T and PV: 4 x L^2 x hidden per block, L the joint length).
    ``image_tokens`` counts reference tokens too (they join the sequence); elementwise work (norms,
    RoPE, modulation) is left out."""
    h, m, ctx = cfg.hidden_size, cfg.mlp_hidden, cfg.context_dim
    n, t = image_tokens, text_tokens
    length = n + t
    per_stream = lambda s: 2 * s * h * (3 * h + h + 2 * m) + 2 * s * m * h  # qkv, proj, mlp in, mlp out
    double = per_stream(n) + per_stream(t) + 4 * length * length * h
    single = 2 * length * h * (3 * h + 2 * m) + 2 * length * (h + m) * h + 4 * length * length * h
    io = 2 * n * cfg.in_channels * h * 2 + 2 * t * ctx * h  # img_in, final linear, txt_in
    return float(batch * (cfg.depth * double + cfg.depth_single * single + io))


VARIANTS = ("diffusers", "diffusers+compile", "plain", "default", "compile", "compile+encoder",
            "default+step_cache", "default+trim", "compile+trim")
TRIMMED = TextOptions(trim=TRIM_MULTIPLE)  # the +trim variants' prompt options
BF16_PEAK_TFLOPS = 790.0  # measured on an H100 (8192^3 bf16 matmul, 2026-11-13, device KINDS.md)

# ---------------------------------------------------------------------------------------------
# Random weights on the device




def _on_device(factory: Callable[[], torch.nn.Module], device: torch.device, dtype: torch.dtype,
               generator: torch.Generator, fp32: Callable[[torch.nn.Module], None] | None = None) -> Any:
    with torch.device("meta"):
        module = factory()
    module.to(dtype)  # on meta: only the recorded dtype changes
    if fp32 is not None:
        fp32(module)
    module.to_empty(device=device)
    random_fill_(module, generator)
    return module.eval().requires_grad_(False)


def build_ours(spec: ModelSpec, device: torch.device, dtype: torch.dtype
               ) -> tuple[Flux2Transformer, Qwen3TextEncoder, Flux2VAE]:
    g = torch.Generator(device=device).manual_seed(SEED)
    tr = _on_device(lambda: Flux2Transformer(spec.transformer), device, dtype, g)
    te = _on_device(lambda: Qwen3TextEncoder(spec.text), device, dtype, g)
    vae = _on_device(lambda: Flux2VAE(spec.vae), device, dtype, g, fp32=lambda m: m.bn.float())
    return tr, te, vae


# ---------------------------------------------------------------------------------------------
# The same weights in diffusers / transformers modules (views: no copy)


def bfl_to_diffusers_transformer(
    sd: dict[str, torch.Tensor], cfg: TransformerConfig
) -> dict[str, torch.Tensor]:
    """klein_core (BFL) transformer state dict -> ``Flux2Transformer2DModel`` names (row views)."""
    return bfl_to_diffusers(sd, cfg)


def bfl_to_diffusers_vae(sd: dict[str, torch.Tensor], cfg: VAEConfig) -> dict[str, torch.Tensor]:
    """klein_core (BFL) VAE state dict -> ``AutoencoderKLFlux2`` names (the inverse of the loader's
    diffusers mapping): ``down.{i}.block.{j}`` -> ``down_blocks.{i}.resnets.{j}``, ``up.{b}`` ->
    ``up_blocks.{n-1-b}``, mid attention 1x1 convs -> Linear weights (views)."""
    n = len(cfg.decoder_block_channels)
    resnet = {"nin_shortcut": "conv_shortcut"}
    attn = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        parts = key.split(".")
        if key.startswith("bn."):
            out[key] = t
        elif key.startswith("encoder.quant_conv."):
            out[key[len("encoder."):]] = t
        elif key.startswith("decoder.post_quant_conv."):
            out[key[len("decoder."):]] = t
        elif parts[1] in ("conv_in", "conv_out"):
            out[key] = t
        elif parts[1] == "norm_out":
            out[f"{parts[0]}.conv_norm_out.{parts[2]}"] = t
        elif parts[1] == "mid" and parts[2] in ("block_1", "block_2"):
            idx = int(parts[2][-1]) - 1
            sub = ".".join([resnet.get(parts[3], parts[3]), *parts[4:]])
            out[f"{parts[0]}.mid_block.resnets.{idx}.{sub}"] = t
        elif parts[1] == "mid" and parts[2] == "attn_1":
            name = f"{parts[0]}.mid_block.attentions.0.{attn[parts[3]]}.{parts[4]}"
            out[name] = t.flatten(1) if t.ndim == 4 else t
        elif parts[1] in ("down", "up"):
            level = int(parts[2])
            blocks = "down_blocks" if parts[1] == "down" else "up_blocks"
            level_d = level if parts[1] == "down" else n - 1 - level
            if parts[3] == "block":
                sub = ".".join([resnet.get(parts[5], parts[5]), *parts[6:]])
                out[f"{parts[0]}.{blocks}.{level_d}.resnets.{parts[4]}.{sub}"] = t
            else:  # downsample / upsample conv
                kind = "downsamplers" if parts[3] == "downsample" else "upsamplers"
                out[f"{parts[0]}.{blocks}.{level_d}.{kind}.0.{'.'.join(parts[4:])}"] = t
        else:
            raise KeyError(f"no diffusers name for VAE tensor {key}")
    return out


def _assign(module: torch.nn.Module, sd: dict[str, torch.Tensor], what: str) -> None:
    expected = module.state_dict()
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    bad = [k for k in sd if k in expected and tuple(sd[k].shape) != tuple(expected[k].shape)]
    if missing or unexpected or bad:
        raise RuntimeError(f"{what}: weight conversion mismatch: missing {missing[:5]}, unexpected "
                           f"{unexpected[:5]}, shape {bad[:5]}")
    module.load_state_dict(sd, strict=True, assign=True)


def _import_diffusers() -> Any:
    try:
        import diffusers
    except ImportError:
        raise SystemExit(
            "diffusers is not installed: the baseline needs it (pip install diffusers==0.42.1, or carry "
            "its wheel), or pass --no-diffusers to time klein_core alone."
        ) from None
    return diffusers


def build_diffusers(spec: ModelSpec, tr: Flux2Transformer, te: Qwen3TextEncoder, vae: Flux2VAE,
                    device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """diffusers transformer + VAE and a transformers Qwen3ForCausalLM on the same weights."""
    diffusers = _import_diffusers()
    import transformers

    d_tr = diffusers_flux2_transformer(diffusers, spec.transformer)
    with torch.device("meta"):
        v = spec.vae
        d_vae = diffusers.AutoencoderKLFlux2(
            down_block_types=("DownEncoderBlock2D",) * len(v.block_channels),
            up_block_types=("UpDecoderBlock2D",) * len(v.block_channels),
            block_out_channels=v.block_channels, decoder_block_out_channels=v.decoder_block_channels,
            layers_per_block=v.num_res_blocks, latent_channels=v.z_channels, norm_num_groups=v.norm_groups,
            batch_norm_eps=v.bn_eps,
        )
    _assign(d_tr, bfl_to_diffusers_transformer(tr.state_dict(), spec.transformer), "diffusers transformer")
    vae_sd = bfl_to_diffusers_vae(vae.state_dict(), v)
    vae_sd["bn.num_batches_tracked"] = torch.zeros((), dtype=torch.long, device=device)
    _assign(d_vae, vae_sd, "diffusers VAE")

    t = spec.text
    hf_cfg = transformers.Qwen3Config(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=spec.text_layers_hf, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, max_position_embeddings=40960,
        rms_norm_eps=t.rms_norm_eps, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": t.rope_theta},
    )
    hf_cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = transformers.Qwen3ForCausalLM(hf_cfg)
    hf.to(dtype)
    # Layers 28-36 and the final norm exist only in the full model: fresh random weights.
    ours = {"model." + k: p for k, p in te.state_dict().items()}
    g = torch.Generator(device=device).manual_seed(SEED + 1)
    extra = {}
    for k, p in hf.state_dict().items():
        if k not in ours and k != "lm_head.weight":
            extra[k] = torch.empty(p.shape, dtype=dtype, device=device)
    holder = torch.nn.ParameterDict({k.replace(".", "_"): torch.nn.Parameter(x, requires_grad=False)
                                     for k, x in extra.items()})
    random_fill_(holder, g)
    hf.load_state_dict({**ours, **extra}, strict=False, assign=True)
    hf.lm_head.weight = hf.model.embed_tokens.weight  # never used; tied so it costs no memory
    with torch.device(device):  # inv_freq is a non-persistent buffer: rebuild it on the device
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf_cfg)
    left = [n for n, x in [*hf.named_parameters(), *hf.named_buffers()] if x.is_meta]
    if left:
        raise RuntimeError(f"transformers Qwen3: tensors left on meta: {left[:5]}")
    hf.eval().requires_grad_(False)
    return {"transformer": d_tr.eval().requires_grad_(False), "vae": d_vae.eval().requires_grad_(False),
            "text_encoder": hf}


class _Tokenizer:
    """Stands in for the Qwen2 tokenizer that diffusers would download from the hub.

    ``apply_chat_template`` hands the raw prompt through and ``__call__`` runs klein_core's tokenizer,
    which applies the same chat template and gives the same ids (tests/test_tokenizer.py).
    """

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> str:
        return messages[-1]["content"]

    def __call__(self, text: str, max_length: int = 512, **_: Any) -> dict[str, torch.Tensor]:
        ids, mask = tokenize_prompts([text], max_length=max_length)
        return {"input_ids": ids, "attention_mask": mask}


def diffusers_pipeline(parts: dict[str, Any], distilled: bool) -> Any:
    diffusers = _import_diffusers()
    sched = diffusers.FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, time_shift_type="exponential", base_image_seq_len=256,
        max_image_seq_len=4096, base_shift=0.5, max_shift=1.15, shift=3.0,
    )
    pipe = diffusers.Flux2KleinPipeline(
        scheduler=sched, vae=parts["vae"], text_encoder=parts["text_encoder"], tokenizer=None,
        transformer=parts["transformer"], is_distilled=distilled,
    )
    object.__setattr__(pipe, "tokenizer", _Tokenizer())  # not a registered component: skip the config
    pipe.set_progress_bar_config(disable=True)
    return pipe


class DiffusersBest:
    """diffusers at its best, switched on and off in place on the shared pipeline parts: cuDNN
    attention through its attention dispatcher, regional compilation of the transformer's repeated
    blocks (``compile_repeated_blocks``), the VAE encoder and decoder compiled, and each decoder
    layer of the text encoder compiled (as klein's ``compile`` does with its own)."""

    def __init__(self, parts: dict[str, Any]) -> None:
        self.parts = parts
        self.backend = "_native_cudnn"
        self.text_eager = False  # set if its text encoder layers could not be compiled

    def _text_layers(self) -> list[torch.nn.Module]:
        return [m for m in self.parts["text_encoder"].modules() if type(m).__name__.endswith("DecoderLayer")]

    def _compiled(self) -> list[torch.nn.Module]:
        tr, vae = self.parts["transformer"], self.parts["vae"]
        blocks = [m for m in tr.modules() if type(m).__name__ in getattr(tr, "_repeated_blocks", ())]
        return [*blocks, vae.encoder, vae.decoder, *self._text_layers()]

    def enable(self) -> None:
        tr, vae = self.parts["transformer"], self.parts["vae"]
        if next(tr.parameters()).is_cuda:  # cuDNN attention exists on CUDA only (--tiny runs on the CPU)
            tr.set_attention_backend(self.backend)
        tr.compile_repeated_blocks()
        for m in (vae.encoder, vae.decoder):  # forward only: the timing hooks must stay eager
            m.forward = torch.compile(m.forward)
        for m in self._text_layers():
            m.forward = self._guarded(m)

    def _guarded(self, module: torch.nn.Module) -> Callable[..., Any]:
        """The text encoder layer compiled, or eager (logged) if dynamo cannot take transformers' layer:
        the text encoder is the newest part of this peer, and its failure must not end the run."""
        compiled, eager = torch.compile(module.forward), module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            try:
                return compiled(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the peer runs eagerly instead, said once
                module.__dict__["forward"] = eager
                if not self.text_eager:
                    logger.warning("diffusers+compile: its text encoder layers run eagerly (%s)",
                                   str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                self.text_eager = True
                return eager(*args, **kwargs)
        return forward

    def disable(self) -> None:
        self.parts["transformer"].reset_attention_backend()
        for m in self._compiled():
            m._compiled_call_impl = None  # where nn.Module.compile() keeps the compiled call
            m.__dict__.pop("forward", None)


def _as_dict(stats: Any) -> dict[str, Any]:
    if hasattr(stats, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(stats)
    return dict(stats) if isinstance(stats, dict) else {"value": str(stats)}


# ---------------------------------------------------------------------------------------------
# Timing


class Clock:
    """Timestamps on the device stream (CUDA events) or the host clock (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1000.0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


@dataclass
class Probe:
    """Module hooks that put marks around the stages of one pipeline run."""

    clock: Clock
    active: bool = False
    spans: dict[str, list[tuple[Any, Any]]] = field(default_factory=dict)
    steps: list[Any] = field(default_factory=list)  # [denoise start, end of step 1, ...]
    after_step: Callable[[int], None] | None = None  # called with the number of steps done
    _open: dict[str, Any] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)
    unwrap: list[tuple[Any, str, Any]] = field(default_factory=list)

    def reset(self) -> None:
        self.spans, self.steps, self._open = {}, [], {}

    def span(self, stage: str, start: torch.nn.Module, end: torch.nn.Module | None = None) -> None:
        """Time ``stage`` from the call of ``start`` to the return of ``end`` (default ``start``)."""
        def pre(*_: Any) -> None:
            if self.active:
                self._open[stage] = self.clock.mark()

        def post(*_: Any) -> None:
            if self.active and stage in self._open:
                self.spans.setdefault(stage, []).append((self._open.pop(stage), self.clock.mark()))

        self.handles.append(start.register_forward_pre_hook(pre))
        self.handles.append((end or start).register_forward_hook(post))

    def around(self, stage: str, obj: Any, method: str) -> None:
        """Time ``stage`` around each call of ``obj.method`` (an instance attribute wrapping it, put
        back by :meth:`remove`). Unlike module hooks it leaves the modules hook-free: a hook on the
        text encoder's modules turns off its CUDA graph replay (klein_core.accel.text_graph), so
        hooks would time a path users do not run."""
        inner = getattr(obj, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return inner(*args, **kwargs)
            start = self.clock.mark()
            out = inner(*args, **kwargs)
            self.spans.setdefault(stage, []).append((start, self.clock.mark()))
            return out

        self.unwrap.append((obj, method, obj.__dict__.get(method)))
        obj.__dict__[method] = timed

    def denoiser(self, module: torch.nn.Module) -> None:
        def pre(*_: Any) -> None:
            if self.active and not self.steps:
                self.steps.append(self.clock.mark())

        self.handles.append(module.register_forward_pre_hook(pre))

    def step_done(self) -> None:
        if self.active:
            self.steps.append(self.clock.mark())
        if self.after_step is not None:
            self.after_step(len(self.steps) - 1)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for obj, method, previous in reversed(self.unwrap):  # an instance attribute it wrapped comes back
            if previous is None:
                obj.__dict__.pop(method, None)
            else:
                obj.__dict__[method] = previous
        self.unwrap.clear()

    def result(self) -> dict[str, Any]:
        ms = self.clock.ms
        out: dict[str, Any] = {k: sum(ms(a, b) for a, b in v) for k, v in self.spans.items()}
        out["steps"] = [ms(a, b) for a, b in zip(self.steps, self.steps[1:])]
        out["denoise"] = sum(out["steps"])
        return out


@dataclass
class RunOutput:
    stages: dict[str, Any]
    e2e_ms: float
    peak_alloc_gib: float
    activation_gib: float
    latents: torch.Tensor  # packed [B, N, 128], float32 CPU
    image: np.ndarray  # uint8 [H, W, 3]
    # klein_core's own stage clocks (GenerationResult.timings: CUDA events from the start of each stage
    # to its end, the device idling for the host included), ms. None for diffusers.
    engine_wall: dict[str, float] | None = None


def _memory_start(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _memory_peak(device: torch.device, start: int) -> tuple[float, float]:
    if device.type != "cuda":
        return float("nan"), float("nan")
    peak = torch.cuda.max_memory_allocated(device)
    return peak / GiB, (peak - start) / GiB


def _images(size: int, n: int) -> list[Image.Image]:
    """Smooth random images (so the VAE sees image-like content), deterministic."""
    rng = np.random.default_rng(SEED)
    out = []
    for _ in range(n):
        small = rng.integers(0, 256, (size // 32, size // 32, 3), dtype=np.uint8)
        out.append(Image.fromarray(small).resize((size, size), Image.BICUBIC))
    return out


def run_ours(components: tuple[Flux2Transformer, Qwen3TextEncoder, Flux2VAE], case: Case, probe: Probe,
             noise: torch.Tensor, refs: list[Image.Image], device: torch.device,
             waits: list[str] | None = None, text: TextOptions | None = None) -> RunOutput:
    """One generation, timed; ``waits``: collect where it made the host wait for the GPU; ``text``:
    the prompt options (default: the engine's)."""
    tr, te, vae = components
    probe.reset()
    start = _memory_start(device)
    probe.clock.sync()
    t0 = time.perf_counter()
    with _host_waits(device, waits):
        res = klein_core.generate(
            tr, te, vae, prompt=PROMPT, references=refs, width=case.size, height=case.size, steps=case.steps,
            guidance=case.guidance, kind="distilled" if case.distilled else "base", noise=noise, cache=None,
            callback=lambda i, n, lat: probe.step_done(), **({} if text is None else {"text": text}),
        )
    probe.clock.sync()
    e2e = (time.perf_counter() - t0) * 1000.0
    peak, act = _memory_peak(device, start)
    latents = pack(res.latents).float().cpu()
    return RunOutput(probe.result(), e2e, peak, act, latents, np.asarray(res.images[0]),
                     {k: v * 1000.0 for k, v in res.timings.items()})


def run_diffusers(pipe: Any, case: Case, probe: Probe, noise: torch.Tensor, refs: list[Image.Image],
                  device: torch.device) -> RunOutput:
    probe.reset()
    final: dict[str, torch.Tensor] = {}

    def on_step(p: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        probe.step_done()
        if i == case.steps - 1:
            final["latents"] = kwargs["latents"]
        return {}

    start = _memory_start(device)
    probe.clock.sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = pipe(image=refs or None, prompt=PROMPT, width=case.size, height=case.size,
                   num_inference_steps=case.steps, guidance_scale=case.guidance, latents=noise,
                   callback_on_step_end=on_step, output_type="pil")
    probe.clock.sync()
    e2e = (time.perf_counter() - t0) * 1000.0
    peak, act = _memory_peak(device, start)
    latents = final["latents"].float().cpu()
    return RunOutput(probe.result(), e2e, peak, act, latents, np.asarray(out.images[0]))


def _median_stages(runs: list[RunOutput]) -> dict[str, Any]:
    keys = sorted({k for r in runs for k in r.stages if k != "steps"})
    out: dict[str, Any] = {k: statistics.median(r.stages.get(k, 0.0) for r in runs) for k in keys}
    steps = [r.stages["steps"] for r in runs]
    out["steps"] = [statistics.median(s[i] for s in steps) for i in range(min(map(len, steps)))]
    out["step_median"] = statistics.median(out["steps"]) if out["steps"] else float("nan")
    return out


# ---------------------------------------------------------------------------------------------
# Sync audit


@contextlib.contextmanager
def _sync_audit(device: torch.device, probe: Probe, tr: torch.nn.Module, steps: int) -> Iterator[list[str]]:
    """Record synchronising CUDA calls made from the first denoising step to the end of the last.

    ``torch.cuda.set_sync_debug_mode("warn")`` is switched on by a hook at the first transformer
    call and off by the step callback after the last step; each wait is named by its caller outside
    torch (``klein_core.testing.sync``).
    """
    state = {"on": False}

    def first_step(*_: Any) -> None:
        if not state["on"]:
            state["on"] = True
            torch.cuda.set_sync_debug_mode("warn")

    def after_step(done: int) -> None:
        if done >= steps:
            torch.cuda.set_sync_debug_mode(0)

    if device.type != "cuda":
        yield []
        return
    with sync_callers(switch=False) as found:
        handle = tr.register_forward_pre_hook(first_step)
        probe.after_step = after_step
        try:
            yield found
        finally:
            handle.remove()
            probe.after_step = None


@contextlib.contextmanager
def _host_waits(device: torch.device, found: list[str] | None) -> Iterator[None]:
    """With a list: collect into it where the block made the host wait for the GPU (each synchronising
    CUDA call, named by its caller outside torch). klein_core's generate should wait once the
    images are to come to the host, and only then (klein_core.pipeline.engine)."""
    if found is None or device.type != "cuda":
        yield
        return
    with sync_callers() as waits:
        yield
    found.extend(waits)


# ---------------------------------------------------------------------------------------------
# Driver


def _weights_gib(*modules: torch.nn.Module) -> float:
    seen: set[int] = set()
    total = 0
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total / GiB


def _diff(a: RunOutput, b: RunOutput) -> dict[str, float]:
    lat = (a.latents - b.latents).abs()
    img = np.abs(a.image.astype(np.int16) - b.image.astype(np.int16))
    rel = float((a.latents - b.latents).norm() / b.latents.norm().clamp_min(1e-12))
    return {"latents_max_abs": float(lat.max()), "latents_rel_l2": rel, "image_max_abs_255": int(img.max()),
            "image_mean_abs_255": float(img.mean())}


def bench_model(spec: ModelSpec, cases: list[Case], args: argparse.Namespace, device: torch.device,
                dtype: torch.dtype) -> dict[str, Any]:
    clock = Clock(device)
    t0 = time.perf_counter()
    ours = build_ours(spec, device, dtype)
    tr, te, vae = ours
    clock.sync()
    build_s = time.perf_counter() - t0
    logger.info("%s: built klein_core components in %.1f s", spec.name, build_s)
    parts = None if args.no_diffusers else build_diffusers(spec, tr, te, vae, device, dtype)
    weights = {"klein_core": _weights_gib(tr, te, vae)}
    if parts is not None:
        weights["diffusers"] = _weights_gib(parts["transformer"], parts["text_encoder"], parts["vae"])

    probe_ours = Probe(clock)
    probe_ours.around("text", te, "encode")
    probe_ours.span("references", vae.encoder)
    probe_ours.span("decode", vae.decoder)
    probe_ours.denoiser(tr)
    probe_diff = Probe(clock)
    if parts is not None:
        probe_diff.span("text", parts["text_encoder"])
        probe_diff.span("references", parts["vae"].encoder)
        probe_diff.span("decode", parts["vae"].decoder)
        probe_diff.denoiser(parts["transformer"])

    def at_speed(name: str, attention: str | None = None) -> Callable[[], None]:
        def setup() -> None:
            speed.apply_speed(tr, vae, name, te)
            if attention is not None:
                fast.enable_fast_paths(tr, attention=attention)
        return setup

    def with_compiled_encoder() -> None:
        speed.apply_speed(tr, vae, "compile", te)
        fast.enable_fast_vae(vae, compile=True, compile_encoder=True)

    def with_step_cache() -> None:
        speed.apply_speed(tr, vae, speed.DEFAULT_SPEED, te)
        kw = {} if args.cache_threshold is None else {"threshold": args.cache_threshold}
        step_cache.enable_step_cache(tr, **kw)

    # name -> (setup, teardown); run in the order of --variants
    ours_setups: dict[str, tuple[Callable[[], None], Callable[[], None] | None]] = {
        "plain": (at_speed("plain"), None), "default": (at_speed(speed.DEFAULT_SPEED), None),
        "compile": (at_speed("compile"), None), "compile+encoder": (with_compiled_encoder, None),
        "default+step_cache": (with_step_cache, lambda: step_cache.disable_step_cache(tr)),
        "default+trim": (at_speed(speed.DEFAULT_SPEED), None), "compile+trim": (at_speed("compile"), None),
    }
    texts = {"default+trim": TRIMMED, "compile+trim": TRIMMED}  # variants' prompt options, if not the default
    for attn in args.attention:
        ours_setups[f"fast[{attn}]"] = (at_speed("plain", attn), None)
    diff_best = DiffusersBest(parts) if parts is not None else None

    result: dict[str, Any] = {"model": spec.name, "build_s": build_s, "weights_gib": weights, "cases": {}}
    for case in cases:
        noise = make_noise(SEED, 1, spec.transformer.in_channels, case.size // 16, case.size // 16)
        refs = _images(case.size, case.n_refs)
        # (name, setup before timing, teardown after, probe, one run); closures run within this iteration
        plan: list[tuple[str, Callable[[], None] | None, Callable[[], None] | None, Probe,
                         Callable[[], RunOutput]]] = []
        for name in args.variants:
            if name.startswith("diffusers"):
                if parts is None:
                    continue
                pipe = diffusers_pipeline(parts, case.distilled)
                best = name == "diffusers+compile"
                plan.append((name, diff_best.enable if best else None, diff_best.disable if best else None,
                             probe_diff, lambda pipe=pipe: run_diffusers(pipe, case, probe_diff, noise, refs, device)))
            else:
                setup, teardown = ours_setups[name]
                text = texts.get(name)
                plan.append((name, setup, teardown, probe_ours,
                             lambda text=text: run_ours(ours, case, probe_ours, noise, refs, device, text=text)))
        runs: dict[str, list[RunOutput]] = {}
        warm_ms: dict[str, float] = {}
        notes: dict[str, Any] = {}
        for name, setup, teardown, probe, go in plan:
            if setup is not None:
                setup()
            probe.active = True
            t_warm = time.perf_counter()
            for _ in range(args.warmup):  # compilation, cuDNN autotuning, allocator warm-up
                go()
            warm_ms[name] = (time.perf_counter() - t_warm) * 1000.0 / max(args.warmup, 1)
            with HostAudit() as audit:  # garbage collections and recompilations inside the timed runs
                runs[name] = [go() for _ in range(args.runs)]
            notes.setdefault("host_audit", {})[name] = audit.result()
            is_ours = not name.startswith("diffusers")
            if is_ours and isinstance(tr.ops, fast.FastOps):
                resolved = tr.ops.resolved()
                notes.setdefault("fast", {}).update({f"{name} on {k}": v for k, v in resolved.items()})
            stats = getattr(getattr(tr, "step_cache", None), "last_run", None)
            if is_ours and stats is not None:
                notes.setdefault("step_cache", {})[name] = _as_dict(stats)
            if is_ours and device.type == "cuda" and case is cases[0]:
                with _sync_audit(device, probe_ours, tr, case.steps) as found:
                    go()
                waits: list[str] = []
                run_ours(ours, case, probe_ours, noise, refs, device, waits, text=texts.get(name))
                notes.setdefault("sync_audit", {})[name] = {"syncs_inside_denoise": len(found),
                                                           "where": found[:20], "syncs_per_run": len(waits),
                                                           "where_per_run": waits[:20]}
            probe.active = False
            if teardown is not None:
                teardown()
            logger.info("%s case %s %s: e2e median %.1f ms", spec.name, case.key, name,
                        statistics.median(r.e2e_ms for r in runs[name]))
        speed.apply_speed(tr, vae, "plain", te)
        if diff_best is not None and "diffusers+compile" in runs:
            notes["diffusers+compile text encoder"] = (
                "eager (its compilation failed)" if diff_best.text_eager else "compiled")
        n_img = (case.size // 16) ** 2 * (1 + case.n_refs)
        batch = 2 if case.guidance > 1 else 1
        flops = step_flops(spec.transformer, n_img, 512, batch)
        text_tokens = {name: opts.length([PROMPT] + ([""] if case.guidance > 1 else [])) for name, opts in texts.items()}
        first = next(iter(runs))
        summary: dict[str, Any] = {}
        for name, rs in runs.items():
            summary[name] = {
                "stages_ms": _median_stages(rs),
                "e2e_ms": statistics.median(r.e2e_ms for r in rs),
                "e2e_all_ms": [r.e2e_ms for r in rs],
                "stages_per_run_ms": [{k: v for k, v in r.stages.items() if k != "steps"} for r in rs],
                "engine_wall_ms": ({k: statistics.median(r.engine_wall[k] for r in rs) for k in rs[0].engine_wall}
                                   if rs[0].engine_wall is not None else None),
                "first_call_ms": warm_ms[name],
                "peak_alloc_gib": max(r.peak_alloc_gib for r in rs),
                "activation_gib": max(r.activation_gib for r in rs),
                "pipeline_peak_gib": weights["diffusers" if name.startswith("diffusers") else "klein_core"]
                + max(r.activation_gib for r in rs),
                "diff_vs_" + first: _diff(rs[-1], runs[first][-1]),
            }
            step_ms = summary[name]["stages_ms"]["step_median"]
            ran = step_flops(spec.transformer, n_img, text_tokens[name], batch) if name in text_tokens else flops
            summary[name]["step_tflops"] = ran / (step_ms * 1e-3) / 1e12 if step_ms == step_ms else float("nan")
            if name in text_tokens:
                summary[name]["text_tokens"] = text_tokens[name]
            for other in ("plain", "default"):
                if name != other and other in runs:
                    summary[name]["diff_vs_" + other] = _diff(rs[-1], runs[other][-1])
            finite = bool(torch.isfinite(rs[-1].latents).all())
            summary[name]["finite"] = finite
        result["cases"][case.key] = {"title": case.title, "variants": summary, "step_gflop": flops / 1e9,
                                     **notes}
    probe_ours.remove()
    probe_diff.remove()
    return result


def _fmt(x: float, unit: str = "") -> str:
    if x != x:  # NaN
        return "-"
    return f"{x:,.1f}{unit}" if abs(x) < 1e5 else f"{x:,.0f}{unit}"


def print_table(results: list[dict[str, Any]], out: Any = sys.stdout) -> None:
    for res in results:
        for key, case in res["cases"].items():
            variants = case["variants"]
            names = list(variants)
            W = max(15, *(len(n) + 2 for n in names))  # noqa: N806 - the column width
            print(f"\n{res['model']} - case {key}: {case['title']}  (ms, median of runs)", file=out)
            print(f"{'':22}" + "".join(f"{n:>{W}}" for n in names), file=out)
            rows = [("text encoding", lambda v: v["stages_ms"].get("text", float("nan"))),
                    ("reference encoding", lambda v: v["stages_ms"].get("references", float("nan"))),
                    ("step (median)", lambda v: v["stages_ms"]["step_median"]),
                    ("denoise (all steps)", lambda v: v["stages_ms"]["denoise"]),
                    ("VAE decode", lambda v: v["stages_ms"].get("decode", float("nan"))),
                    ("end to end", lambda v: v["e2e_ms"]),
                    ("outside the stages", lambda v: v["e2e_ms"] - sum(
                        v["stages_ms"].get(k, 0.0) for k in ("text", "references", "denoise", "decode")))]
            for label, get in rows:
                print(f"{label:22}" + "".join(f"{_fmt(get(variants[n])):>{W}}" for n in names), file=out)
            for ref_name in ("diffusers", "diffusers+compile"):
                ref_v = variants.get(ref_name)
                if ref_v is not None:
                    print(f"{'vs ' + ref_name:22}" + "".join(
                        f"{ref_v['e2e_ms'] / variants[n]['e2e_ms']:>{W - 1}.2f}x" for n in names), file=out)
            print(f"{'step TFLOP/s':22}" + "".join(f"{_fmt(variants[n]['step_tflops']):>{W}}" for n in names),
                  file=out)
            print(f"{'% of bf16 peak':22}" + "".join(
                f"{_fmt(100 * variants[n]['step_tflops'] / BF16_PEAK_TFLOPS):>{W}}" for n in names), file=out)
            print(f"{'activation peak GiB':22}" + "".join(
                f"{_fmt(variants[n]['activation_gib']):>{W}}" for n in names), file=out)
            print(f"{'pipeline peak GiB':22}" + "".join(
                f"{_fmt(variants[n]['pipeline_peak_gib']):>{W}}" for n in names), file=out)
            ref = names[0]
            print(f"{'latents max|d| vs ' + ref:22}"[:22] + "".join(
                f"{variants[n]['diff_vs_' + ref]['latents_max_abs']:>{W}.3g}" for n in names), file=out)
            print(f"{'image max|d| (/255)':22}" + "".join(
                f"{variants[n]['diff_vs_' + ref]['image_max_abs_255']:>{W}d}" for n in names), file=out)
            for name, v in variants.items():
                if name != "default" and "diff_vs_default" in v and ("step_cache" in name or "trim" in name):
                    d = v["diff_vs_default"]
                    print(f"{name} vs default: latents relative L2 {d['latents_rel_l2']:.3g}, image max "
                          f"|d| {d['image_max_abs_255']}/255, mean {d['image_mean_abs_255']:.2f}/255", file=out)
            for name, stats in case.get("step_cache", {}).items():
                print(f"{name}: {stats}", file=out)
            for name, audit in case.get("sync_audit", {}).items():
                print(f"host syncs inside klein_core's denoising loop ({name}): "
                      f"{audit['syncs_inside_denoise']}"
                      + "".join(f"\n    {w}" for w in audit["where"][:5]), file=out)
            for where, text in case.get("fast", {}).items():
                print(f"{where}: {text}", file=out)
            for name, audit in case.get("host_audit", {}).items():
                g = audit["gc"]
                print(f"inside the timed runs ({name}): garbage collections gen0/1/2 "
                      f"{g['gen0']['count']}/{g['gen1']['count']}/{g['gen2']['count']} "
                      f"({g['gen0']['ms'] + g['gen1']['ms'] + g['gen2']['ms']:.1f} ms, largest {g['largest_ms']:.1f}), "
                      f"compiled frames {audit['compiles'].get('frames', 'n/a')}", file=out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="4b", help="comma list of 4b, 9b (default 4b)")
    ap.add_argument("--cases", default="a,b,c", help="comma list of a, b, c (default all)")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per variant and case (median reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first (compilation happens here)")
    ap.add_argument("--variants", default="diffusers,plain,default",
                    help=f"comma list of {', '.join(VARIANTS)} (see the module doc)")
    ap.add_argument("--attention", default="",
                    help=f"comma list of klein_core.accel attention backends {fast.ATTENTION_BACKENDS}; each "
                         "adds a fast[<backend>] variant")
    ap.add_argument("--compile", action="store_true", help="add the compile and diffusers+compile variants")
    ap.add_argument("--cache-threshold", type=float, default=None,
                    help="threshold of the default+step_cache variant (default: the step cache's own)")
    ap.add_argument("--no-diffusers", action="store_true", help="skip the diffusers variants")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny random models (tests the script itself; CPU ok)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                    help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--out", default="out/speed_results.json", help="JSON results file (its folder is created)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda"
                                                                            else "fp32")]
    args.attention = [a.strip() for a in args.attention.split(",") if a.strip()]
    for a in args.attention:
        if a not in fast.ATTENTION_BACKENDS:
            ap.error(f"--attention {a!r}: choose from {fast.ATTENTION_BACKENDS}")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.compile:
        args.variants += [v for v in ("diffusers+compile", "compile") if v not in args.variants]
    if args.no_diffusers:
        args.variants = [v for v in args.variants if not v.startswith("diffusers")]
    for v in args.variants:
        if v not in VARIANTS:
            ap.error(f"--variants {v!r}: choose from {', '.join(VARIANTS)}")
    args.variants = [v for v in VARIANTS if v in args.variants]  # the documented order
    args.variants += [f"fast[{a}]" for a in args.attention]
    if not any(v.startswith("diffusers") for v in args.variants):
        args.no_diffusers = True
    all_cases = _cases(args.tiny)
    try:
        cases = [all_cases[c.strip()] for c in args.cases.split(",") if c.strip()]
    except KeyError as exc:
        ap.error(f"unknown case {exc}; use a, b, c")
    models = ["tiny"] if args.tiny else [m.strip().lower() for m in args.models.split(",") if m.strip()]
    if args.runs < 1 or args.warmup < 0:
        ap.error("--runs must be >= 1 and --warmup >= 0")
    if device.type == "cuda":
        # cuDNN autotuning for the VAE convolutions (both pipelines); a process-wide setting, so it
        # belongs to the application (here: this benchmark), never to the library.
        torch.backends.cudnn.benchmark = True
    if not args.no_diffusers:
        _import_diffusers()

    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "dtype": str(dtype)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    for mod in ("triton", "comfy_kitchen", "diffusers", "transformers", "flash_attn", "flash_attn_interface"):
        try:
            env[mod] = getattr(__import__(mod), "__version__", "installed")
        except ImportError:
            env[mod] = None
    results = []
    with torch.inference_mode(False), torch.no_grad():
        for m in models:
            results.append(bench_model(_spec(m), cases, args, device, dtype))
            if any("compile" in v for v in args.variants):
                torch._dynamo.reset()  # compiled code must not keep this model's tensors alive
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report = {"env": env, "args": {k: v for k, v in vars(args).items()}, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print_table(results)
    print(f"\nfull results: {args.out}")
    return report


if __name__ == "__main__":
    main()
