"""Qwen3 text encoder for FLUX.2 Klein (Qwen3-4B for Klein 4B, Qwen3-8B for Klein 9B).

Klein does not use Qwen3 as a language model: it reads three intermediate residual-stream states
of the decoder and concatenates them per token. Only the embedding and the first 27 decoder layers
are built and run; the loader never reads layers 28-36, the final norm or ``lm_head``
(SPEC §2.3).

The maths follows transformers' ``Qwen3ForCausalLM`` (SPEC §2.1): pre-norm decoder layers with
QK-RMSNorm per head before rotate-half RoPE (theta 1e6), GQA attention and a SwiGLU MLP, no biases.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..transfer import to_device
from .layers import RMSNorm, attention, computing_in_calls
from .variants import encoder_name

logger = logging.getLogger(__name__)

# Indices into Hugging Face's ``output_hidden_states`` tuple: index 0 is the token embedding and
# index k is the output of decoder layer k counted from 1 (``layers[k-1]``), before the final norm.
# Klein concatenates these three per token as [h9 | h18 | h27] (BFL ``OUTPUT_LAYERS_QWEN3``).
OUTPUT_LAYERS: tuple[int, ...] = (9, 18, 27)
LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


class ShapeSource(Protocol):
    """What config inference needs from a weight source: names, shapes and a name for messages."""

    name: str

    def keys(self) -> Iterable[str]: ...

    def shape(self, key: str) -> tuple[int, ...]: ...

    def __contains__(self, key: object) -> bool: ...


@dataclass(frozen=True)
class Qwen3Config:
    """Sizes of a Qwen3 decoder, inferred from weight shapes (see :meth:`from_source`)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_layers_in_file: int
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Qwen3Config.{name} must be a positive integer, got {value!r}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Qwen3Config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention."
            )
        if self.head_dim % 2:
            raise ValueError(f"Qwen3Config: head_dim must be even for RoPE, got {self.head_dim}.")
        if self.num_layers_in_file < self.num_layers_run:
            raise ValueError(
                f"Qwen3Config: Klein reads hidden state {max(OUTPUT_LAYERS)}, which needs at least "
                f"{self.num_layers_run} decoder layers; got {self.num_layers_in_file}."
            )
        if not self.rope_theta > 0:
            raise ValueError(f"Qwen3Config.rope_theta must be positive, got {self.rope_theta!r}.")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"Qwen3Config.rms_norm_eps must be positive, got {self.rms_norm_eps!r}.")

    @property
    def variant(self) -> str:
        """Human-readable model name: "Qwen3-4B", "Qwen3-8B" or "Qwen3 (hidden N)"."""
        return encoder_name(self.hidden_size)

    @property
    def text_dim(self) -> int:
        """Width of one encoded token (3 x hidden), the input width of the Klein ``txt_in``."""
        return len(OUTPUT_LAYERS) * self.hidden_size

    @property
    def num_layers_run(self) -> int:
        """Decoder layers actually built and run: up to the deepest output layer (27)."""
        return max(OUTPUT_LAYERS)

    @classmethod
    def from_source(cls, src: ShapeSource, hf_config: Mapping[str, Any] | None = None) -> Qwen3Config:
        """Infer the config from tensor shapes of ``src`` (keys ``model.embed_tokens.weight``,
        ``model.layers.N...``); no tensor data is read.

        ``hf_config`` (a parsed ``config.json``) supplies only ``rope_theta`` and ``rms_norm_eps``,
        which shapes cannot tell; without it the Qwen3 defaults (1e6, 1e-6) are used.
        """
        vocab, hidden = _shape(src, "model.embed_tokens.weight", ndim=2)
        (head_dim,) = _shape(src, "model.layers.0.self_attn.q_norm.weight", ndim=1)
        q_rows, _ = _shape(src, "model.layers.0.self_attn.q_proj.weight", ndim=2)
        k_rows, _ = _shape(src, "model.layers.0.self_attn.k_proj.weight", ndim=2)
        inter, _ = _shape(src, "model.layers.0.mlp.gate_proj.weight", ndim=2)
        for rows, key in ((q_rows, "q_proj"), (k_rows, "k_proj")):
            if rows % head_dim:
                raise ValueError(
                    f"{src.name}: model.layers.0.self_attn.{key}.weight has {rows} rows, not a multiple "
                    f"of head_dim {head_dim} (from q_norm); this is not a valid Qwen3 checkpoint."
                )
        indices = {int(m.group(1)) for k in src.keys() if (m := LAYER_KEY.match(k))}
        n_layers = max(indices) + 1
        needed = max(OUTPUT_LAYERS)
        if n_layers < needed:
            raise ValueError(
                f"{src.name}: this Qwen3 text encoder has only {n_layers} decoder layers; Klein reads the "
                f"output of layer {needed}, so at least {needed} are needed (Qwen3-4B/8B have 36). The "
                "file is truncated or a smaller model."
            )
        rope_theta, eps = _rope_and_eps(hf_config)
        config = cls(
            hidden_size=hidden,
            num_attention_heads=q_rows // head_dim,
            num_key_value_heads=k_rows // head_dim,
            head_dim=head_dim,
            intermediate_size=inter,
            vocab_size=vocab,
            num_layers_in_file=n_layers,
            rope_theta=rope_theta,
            rms_norm_eps=eps,
        )
        logger.debug("Inferred %s from %s: %s", config.variant, src.name, config)
        return config


def _shape(src: ShapeSource, key: str, ndim: int) -> tuple[int, ...]:
    if key not in src:
        raise ValueError(f"{src.name}: missing tensor '{key}', which every Qwen3 text encoder has.")
    shape = src.shape(key)
    if len(shape) != ndim:
        raise ValueError(f"{src.name}: tensor '{key}' has shape {list(shape)}, expected {ndim} dimensions.")
    return shape


def _rope_and_eps(hf_config: Mapping[str, Any] | None) -> tuple[float, float]:
    theta, eps = 1e6, 1e-6
    if not hf_config:
        return theta, eps
    # transformers 5.x nests RoPE settings in "rope_parameters"; older configs keep rope_theta
    # (and an optional rope_scaling dict) at the top level.
    rope = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", hf_config.get("rope_theta", theta)))
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        # Only plain RoPE is implemented; running a scaled variant would silently give other states.
        raise ValueError(
            f"config.json asks for RoPE type '{rope_type}'; the Klein text encoder implements only "
            "the default RoPE of Qwen3-4B/8B."
        )
    eps = float(hf_config.get("rms_norm_eps", eps))
    return theta, eps


# ---------------------------------------------------------------------------------------------
# Model


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """RoPE's inverse frequencies ``[head_dim / 2]``, computed on the CPU exactly as transformers does
    at init, so the frequencies are bit-identical on every device."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _rope_cos_sin(
    length: int, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [1, 1, L, head_dim] for positions 0..L-1, computed in fp32 where ``inv_freq``
    is, then cast."""
    pos = torch.arange(length, device=inv_freq.device, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]  # [L, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [L, head_dim]
    return emb.cos().to(dtype)[None, None], emb.sin().to(dtype)[None, None]


class Qwen3Attention(nn.Module):
    """Grouped-query self-attention with per-head QK-RMSNorm before RoPE."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        blind_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, n, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.n_kv, self.head_dim).transpose(1, 2)  # [B, Hkv, L, D]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = self.n_heads // self.n_kv
        if rep > 1:  # query head h reads kv head h // rep, as transformers' repeat_kv
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = attention(q, k, v, mask)  # [B, H, L, D]
        if blind_rows is not None:
            out = out.masked_fill(blind_rows, 0.0)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.n_heads * self.head_dim))


class Qwen3MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Qwen3MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        blind_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, blind_rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3TextEncoder(nn.Module):
    """The first ``config.num_layers_run`` (27) layers of a Qwen3 decoder, returning Klein's
    concatenated hidden states. Parameter names follow Hugging Face's ``Qwen3Model``."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        # nn.Embedding's own init, but skipped on the meta device (where loaders build the model): there
        # it costs ~1.5 s and ~140 MB the first time (torch imports its decompositions for it).
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if weight.device.type != "meta":
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding.from_pretrained(weight, freeze=False)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config) for _ in range(config.num_layers_run))
        # RoPE's inverse frequencies per device, copied there once rather than in every forward.
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    @property
    def device(self) -> torch.device:
        """Where the weights are (the embedding's device), as the transformer and the VAE say theirs."""
        return self.embed_tokens.weight.device

    def _rope_inv_freq(self, device: torch.device) -> torch.Tensor:
        inv_freq = self._inv_freq.get(device)
        if inv_freq is None:
            inv_freq = to_device(_inv_freq(self.config.head_dim, self.config.rope_theta), device)
            self._inv_freq[device] = inv_freq
        return inv_freq

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                activations: torch.dtype | None = None, *, left_padded: bool | None = None) -> torch.Tensor:
        """Unchecked forward; use :meth:`encode`. ids/mask [B, L] on the model device -> [B, L, 3*hidden].

        ``left_padded``: whether some row has padding before its first token (see :func:`left_padded`);
        None finds out from the mask on the device, which waits for it. Given, the forward never
        waits for the device.
        """
        _, n = input_ids.shape
        x = self.embed_tokens(input_ids)  # [B, L, H]
        if activations is not None:
            x = x.to(activations)
        cos, sin = _rope_cos_sin(n, self._rope_inv_freq(x.device), x.dtype)
        keep = attention_mask.bool()
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        mask = causal[None, None] & keep[:, None, None, :]  # [B, 1, L, L], True = attend
        # A query with no visible key (a pad before the first real token, i.e. left padding) has an
        # undefined softmax; some SDPA backends return NaN there, which later layers would spread
        # through the values. Such rows attend to everything and their attention output is zeroed,
        # which is what transformers' SDPA path gives on torch >= 2.5. Right-padded Klein prompts
        # never have such rows, so the usual case pays nothing.
        blind_rows = None
        if left_padded is not False:
            has_key = mask.any(dim=-1, keepdim=True)  # [B, 1, L, 1]
            if left_padded or not bool(has_key.all()):
                blind_rows = ~has_key
        if blind_rows is not None:
            mask = mask | blind_rows
        states: list[torch.Tensor] = [x] if 0 in OUTPUT_LAYERS else []
        for i, layer in enumerate(self.layers, start=1):
            if activations is None:
                x = layer(x, cos, sin, mask, blind_rows)
            else:  # weights cast one layer at a time, as ComfyUI's manual cast (inside the layer's
                # hooks, so a streamed layer casts its device weights)
                with computing_in_calls(layer, activations):
                    x = layer(x, cos, sin, mask, blind_rows)
            if i in OUTPUT_LAYERS:
                states.append(x)
        return torch.cat(states, dim=-1)

    @torch.no_grad()  # no_grad rather than inference_mode: callers may reuse the result in-place
    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
               activations: torch.dtype | None = None) -> torch.Tensor:
        """Encode token ids into Klein text features.

        Args:
            input_ids: integer ``[B, L]`` token ids (any device; moved to the model's).
            attention_mask: ``[B, L]``, 1 = token, 0 = padding (any side; at least one token per row).
            activations: the compute dtype; None is the model dtype (BFL, diffusers), ``torch.float32`` with
                bf16 weights is ComfyUI's way (each layer's weights cast to fp32 while it runs).

        Returns ``[B, L, 3 * hidden]`` in the activation dtype: per token [h9 | h18 | h27] (Hugging Face
        ``hidden_states``, no final norm). Positions are ``arange(L)``; pad positions are computed and kept.
        """
        _check_inputs(input_ids, attention_mask, self.config.vocab_size)
        device = self.embed_tokens.weight.device
        # read where the mask is given (the host, usually), so the forward need not wait for the device
        padded = left_padded(attention_mask) if attention_mask.device.type == "cpu" else None
        ids = to_device(input_ids, device, torch.long)
        mask = to_device(attention_mask, device)
        if activations is not None and not activations.is_floating_point:
            raise ValueError(f"activations must be a floating dtype, got {activations}")
        return self.forward(ids, mask, None if activations == self.embed_tokens.weight.dtype else activations,
                            left_padded=padded)


def left_padded(attention_mask: torch.Tensor) -> bool:
    """Whether some row of ``attention_mask`` ``[B, L]`` starts with padding: then the queries before
    its first token see no key (the causal mask hides every later one), which the forward handles
    apart. Right-padded prompts (Klein's) never do."""
    return bool((attention_mask[:, 0] == 0).any())


def _check_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, vocab_size: int) -> None:
    if not isinstance(input_ids, torch.Tensor) or not isinstance(attention_mask, torch.Tensor):
        raise TypeError("input_ids and attention_mask must be torch tensors.")
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids must have shape [batch, length] with length > 0, got {list(input_ids.shape)}."
        )
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {list(attention_mask.shape)} does not match input_ids "
            f"{list(input_ids.shape)}."
        )
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}.")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(
            f"input_ids must be in [0, {vocab_size}) for this text encoder, got values in [{lo}, {hi}]; "
            "was the prompt tokenized with the Qwen3 tokenizer?"
        )
    if not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError("attention_mask must contain only 0 (padding) and 1 (real token).")
    empty = (~attention_mask.bool().any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"attention_mask rows {empty} are all zeros: every prompt needs at least one token.")
