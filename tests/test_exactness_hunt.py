"""Exactness of the models and the sampler against the references at edge inputs.

Every expected value comes from the reference implementations (diffusers ``Flux2Transformer2DModel``,
``Flux2KleinPipeline`` and its ``FlowMatchEulerDiscreteScheduler``; transformers ``Qwen3ForCausalLM``
and ``Qwen2Tokenizer`` rendering Qwen3's own chat template), never from klein_core. The parity
tests cover the usual inputs; these cover the edges: 1x1 / 1xN / Nx1 token grids, per-item
timesteps at exactly 0 and 1, one text token, bf16 / fp16 text encoders and sampling loops, prompts
of exactly 512 tokens and over, special tokens typed in the prompt, and the schedule over many
step counts and image sizes.
"""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch
from extras import require
from test_text_encoder import SPEC_LAYERS, _tiny_hf
from test_tokenizer import DATA_DIR, _official_config
from test_transformer import _to_bfl
from tiny_reference import CTX, tiny_diffusers_transformer

from klein_core.files.loaders import load_text_encoder, load_transformer
from klein_core.pipeline.prompts import encode_prompts
from klein_core.pipeline.sampling import denoise, get_schedule, position_ids, text_position_ids, unpack
from klein_core.testing.tiny import TINY_4B, tiny_text_encoder

diffusers = require("diffusers")
transformers = require("transformers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Qwen3's chat template as shipped in the Qwen3 tokenizer_config.json ("chat_template"), the
# template diffusers' Flux2KleinPipeline renders with enable_thinking=False. Written here (not taken
# from klein_core) so the expected text cannot move with the code under test. The tools and
# assistant branches are abridged (Klein never passes tools and sends one user message); the user
# turn, the generation prompt and the enable_thinking switch are verbatim.
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---------------------------------------------------------------------------------------------
# Transformer at edge shapes and timesteps


@pytest.fixture(scope="module")
def transformer_pair():
    ref = tiny_diffusers_transformer(0)
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    return ref, sd


# (grid h, grid w, batch, text tokens, per-item timesteps)
EDGE_CASES = [
    (1, 1, 1, 1, [0.0]),  # one image token, one text token, t exactly 0
    (1, 1, 2, 1, [1.0, 0.0]),  # t exactly 1 and 0 in one batch
    (1, 9, 2, 3, [0.0, 1.0]),  # a single row of tokens
    (9, 1, 3, 5, [1.0, 0.5, 0.0]),  # a single column, batch 3 with different texts
    (3, 5, 1, 512, [0.3]),  # 512 text tokens (the Klein length) on a non-square grid
]


def _edge_inputs(h, w, batch, length, t):
    g = torch.Generator().manual_seed(h * 100 + w * 10 + batch)
    ids = position_ids(h, w)
    img = torch.randn(batch, h * w, 8, generator=g)
    txt = torch.randn(batch, length, CTX, generator=g)  # a different text per batch item
    return img, ids, txt, text_position_ids(length), torch.tensor(t)


@pytest.mark.parametrize("case", EDGE_CASES, ids=[f"{c[0]}x{c[1]}_b{c[2]}_L{c[3]}" for c in EDGE_CASES])
def test_transformer_fp32_matches_diffusers_at_edge_grids_and_timesteps(transformer_pair, case, parity):
    """1x1, 1xN and Nx1 token grids, one text token or 512, per-item timesteps at exactly 0 and 1,
    batch items with different texts: the fp32 velocity equals diffusers' to fp32 rounding."""
    ref, sd = transformer_pair
    ours = load_transformer(_to_bfl(sd, 2, 2))
    img, ids, txt, tids, t = _edge_inputs(*case)
    with torch.no_grad():
        expected = ref(hidden_states=img, encoder_hidden_states=txt, timestep=t, img_ids=ids, txt_ids=tids,
                       return_dict=False)[0]
        got = ours(img=img, img_ids=ids, txt=txt, txt_ids=tids, timesteps=t)
    assert got.shape == expected.shape
    diff = parity(f"transformer fp32 at edge {case[:4]} vs diffusers", _max_diff(got, expected))
    assert diff <= 1e-5 * max(1.0, expected.abs().max().item()), f"max abs diff {diff:.3e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", EDGE_CASES[:4], ids=[f"{c[0]}x{c[1]}_b{c[2]}" for c in EDGE_CASES[:4]])
def test_transformer_low_precision_error_is_the_references_own_at_edges(transformer_pair, case, dtype, parity):
    """At bf16 / fp16 the velocity stays as close to diffusers' fp32 one as diffusers' own model at
    that dtype (the QK-norm cast order differs from diffusers' torch RMSNorm only at rounding level)."""
    ref, sd = transformer_pair
    ours = load_transformer(_to_bfl(sd, 2, 2), dtype=dtype)
    ref_low = copy.deepcopy(ref).to(dtype)
    img, ids, txt, tids, t = _edge_inputs(*case)
    with torch.no_grad():
        exact = ref(hidden_states=img, encoder_hidden_states=txt, timestep=t, img_ids=ids, txt_ids=tids,
                    return_dict=False)[0]
        theirs = ref_low(hidden_states=img.to(dtype), encoder_hidden_states=txt.to(dtype), timestep=t.to(dtype),
                         img_ids=ids, txt_ids=tids, return_dict=False)[0]
        got = ours(img=img.to(dtype), img_ids=ids, txt=txt.to(dtype), txt_ids=tids, timesteps=t.to(dtype))
    assert got.dtype == dtype
    mine, reference_own = _rel_l2(got, exact), _rel_l2(theirs, exact)
    parity(f"transformer {dtype} at edge {case[:4]} (relative L2 vs fp32 diffusers)", mine)
    assert torch.isfinite(got).all()
    assert mine <= 1.25 * reference_own + 1e-4, f"ours {mine:.4f}, diffusers' own {reference_own:.4f}"


# ---------------------------------------------------------------------------------------------
# Sampling loop: bf16 / fp16 Euler steps, timestep rounding and CFG, with one shared network


class _DiffusersAsKlein(torch.nn.Module):
    """diffusers' transformer behind klein_core's model interface, so both sampling loops drive the
    very same network and only the loops (timestep rounding, CFG, Euler step, casts) are compared."""

    def __init__(self, model):
        super().__init__()
        self.inner = model
        self.step_cache = None

    @property
    def dtype(self):
        return self.inner.dtype

    @property
    def device(self):
        return self.inner.device

    def rope(self, txt_ids, img_ids):
        return (None, None)

    def forward(self, *, img, img_ids, txt, txt_ids, timesteps, rope=None, kv=None, zero_time_tokens=0):
        assert kv is None and zero_time_tokens == 0
        return self.inner(hidden_states=img, encoder_hidden_states=txt, timestep=timesteps, img_ids=img_ids,
                          txt_ids=txt_ids, return_dict=False)[0]


def _klein_pipe(transformer, distilled: bool):
    sched = diffusers.FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, time_shift_type="exponential", base_image_seq_len=256, max_image_seq_len=4096,
        base_shift=0.5, max_shift=1.15, shift=3.0,
    )
    vae = diffusers.AutoencoderKLFlux2(  # never run (output_type="latent"); sets vae_scale_factor 1
        block_out_channels=(32,), layers_per_block=1, latent_channels=2, norm_num_groups=32,
        down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
    ).eval()
    return diffusers.Flux2KleinPipeline(scheduler=sched, vae=vae, text_encoder=None, tokenizer=None,
                                        transformer=transformer, is_distilled=distilled)


# (batch, grid h, grid w, steps, guidance, distilled)
LOOP_CASES = [
    (2, 3, 5, 3, 4.0, False),  # base model, CFG, non-square, batch 2
    (1, 1, 7, 2, 1.0, True),  # distilled, a single row of tokens
    (3, 4, 1, 4, 2.5, False),  # CFG, a single column, batch 3
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", LOOP_CASES, ids=["cfg_3x5_b2", "distilled_1x7", "cfg_4x1_b3"])
def test_low_precision_sampling_loop_is_bit_identical_to_diffusers(case, dtype, parity):
    """The same network driven by klein_core's denoise and by diffusers' Flux2KleinPipeline in bf16 /
    fp16: the timesteps the model sees (sigma*1000 rounded to the latent dtype, /1000), the CFG mix
    ``neg + g * (pos - neg)`` (klein batches [pos; neg], diffusers runs two forwards), the fp32 Euler
    step re-cast to the model dtype after every step: the final latents are bit-identical."""
    batch, h, w, steps, guidance, distilled = case
    net = tiny_diffusers_transformer(0, in_channels=8).to(dtype)
    pipe = _klein_pipe(net, distilled)
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(batch, 8, h, w, generator=g)
    emb = torch.randn(batch, 7, CTX, generator=g).to(dtype)
    neg = None if distilled else torch.randn(batch, 7, CTX, generator=g).to(dtype)
    captured = {}

    def grab(p, i, t, kwargs):
        captured["latents"] = kwargs["latents"].clone()
        return {}

    f = pipe.vae_scale_factor * 2  # pixels per token
    with torch.no_grad():
        pipe(prompt_embeds=emb, negative_prompt_embeds=neg, height=h * f, width=w * f, num_inference_steps=steps,
             guidance_scale=guidance, latents=noise.to(dtype), output_type="latent", callback_on_step_end=grab)
        ours = denoise(_DiffusersAsKlein(net), noise, emb, get_schedule(steps, h * w), neg_txt=neg, guidance=guidance)
    expected = unpack(captured["latents"], h, w)  # diffusers' packing is row-major, as its ids say
    assert ours.dtype == expected.dtype == dtype
    diff = parity(f"sampling loop {dtype} {case} vs diffusers' loop, same network", _max_diff(ours, expected))
    assert diff == 0.0, f"max abs diff {diff:.3e}"


@pytest.mark.parametrize("size", [(64, 64), (256, 256), (512, 512), (2048, 2048), (512, 1024), (64, 2048),
                                  (2048, 64), (1360, 768), (1040, 1040), (1088, 1024)])
def test_schedule_bit_identical_to_diffusers_for_every_step_count(size, parity):
    """mu from the noisy token count (both branches: <= 4300 and above, e.g. 2048x2048 and a 64x2048
    strip) and the exponential shift, for every step count 1..120: bit-identical sigmas."""
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu as diffusers_mu

    w, h = size
    seq = (h // 16) * (w // 16)
    worst, bad = 0.0, []
    for steps in range(1, 121):
        sched = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=diffusers_mu(seq, steps))
        ours = get_schedule(steps, seq)
        if not torch.equal(ours, sched.sigmas):
            bad.append(steps)
            worst = max(worst, _max_diff(ours, sched.sigmas))
    parity(f"schedule 1..120 steps at {w}x{h} vs diffusers (worst)", worst)
    assert not bad, f"{w}x{h}: schedules differ at steps {bad[:10]} (max abs diff {worst:.3e})"


# ---------------------------------------------------------------------------------------------
# Text encoder in bf16 / fp16


def _hf_from_pretrained(model, folder, dtype):
    """The transformers model as users load it: ``from_pretrained(dtype=...)`` keeps the RoPE inverse
    frequencies in fp32 (a plain ``model.to(bf16)`` would round them and is not the reference)."""
    model.save_pretrained(folder)
    loaded = type(model).from_pretrained(folder, dtype=dtype).eval()
    assert loaded.model.rotary_emb.inv_freq.dtype == torch.float32
    return loaded


def _hf_states(model, ids, mask):
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i] for i in SPEC_LAYERS], dim=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_text_encoder_low_precision_bit_identical_to_transformers(tmp_path, dtype, parity):
    """bf16 / fp16 text encoder (RMSNorm cast order, RoPE tables cast from fp32, GQA, masks) against
    transformers' model loaded in that dtype, on a right-padded batch holding a 1-token row, a full
    row and a half-padded row, then on a left-padded one: bit-identical, pads included."""
    hf32 = _tiny_hf()
    hf = _hf_from_pretrained(hf32, tmp_path / "hf", dtype)
    ours = load_text_encoder({k: v.clone() for k, v in hf32.state_dict().items()}, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 1000, (3, 40), generator=g)
    right = torch.ones_like(ids)
    right[1, 1:] = 0  # one real token
    right[2, 20:] = 0
    left = torch.ones_like(ids)
    left[1, :-1] = 0  # one real token, at the end
    left[2, :20] = 0
    for side, mask in (("right", right), ("left", left)):
        expected = _hf_states(hf, ids, mask)
        got = ours.encode(ids, mask)
        assert got.dtype == expected.dtype == dtype
        assert torch.isfinite(got).all()
        diff = parity(f"text encoder {dtype}, {side}-padded batch vs transformers", _max_diff(got, expected))
        assert diff == 0.0, f"{side} padding: max abs diff {diff:.3e}"


# ---------------------------------------------------------------------------------------------
# Prompt -> embedding, the whole chain, against diffusers' own prompt encoding


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory):
    """transformers' Qwen2Tokenizer on the shipped vocabulary with Qwen3's added tokens and Qwen3's
    chat template (what diffusers' pipeline calls apply_chat_template and tokenizer() on)."""
    folder = tmp_path_factory.mktemp("qwen3_tok")
    shutil.copyfile(DATA_DIR / "vocab.json", folder / "vocab.json")
    shutil.copyfile(DATA_DIR / "merges.txt", folder / "merges.txt")
    config = _official_config()
    config["chat_template"] = QWEN3_CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return transformers.Qwen2Tokenizer.from_pretrained(str(folder))


def _mirror_tiny_encoder(te) -> transformers.Qwen3ForCausalLM:
    """klein_core's tiny Qwen3 encoder as a transformers model: its 27 layers plus a 28th random one
    (so hidden_states[27] is a raw layer output, not the normed last one), final norm and lm_head."""
    c = te.config
    cfg = transformers.Qwen3Config(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=28,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        vocab_size=c.vocab_size, rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=False, attn_implementation="sdpa",
    )
    torch.manual_seed(5)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    result = hf.load_state_dict({"model." + k: v for k, v in te.state_dict().items()}, strict=False)
    assert not result.unexpected_keys and all(k.startswith(("model.layers.27.", "model.norm.", "lm_head."))
                                              for k in result.missing_keys)
    return hf


def _edge_prompts(tok) -> list[str]:
    def n_tokens(prompt: str) -> int:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True, enable_thinking=False)
        return len(tok(text)["input_ids"])

    def with_tokens(count: int) -> str:
        return next(p for n in range(480, 520) for p in ("cat " * n, "cat " * n + "dog") if n_tokens(p) == count)

    exactly_512 = with_tokens(512)
    prompts = [
        "",  # the CFG negative: 12 template tokens, 500 pads
        "a",
        exactly_512,  # fills the 512 tokens: no pad, nothing cut
        with_tokens(513),  # the last template token is cut
        "cat " * 600,  # the assistant suffix is cut away entirely
        "<|im_end|>\n<|im_start|>assistant\n<think>reasoning</think>",  # special tokens typed in the text
        "<tool_response>a photo</tool_response>",  # looks like a tool turn to the template's loop
        "  leading and trailing spaces \n\n",
        "<|endoftext|>pad token typed<|endoftext|>",
    ]
    return prompts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prompt_embeddings_equal_diffusers_prompt_encoding_at_edge_prompts(qwen3_tokenizer, tmp_path, dtype,
                                                                           caplog, parity):
    """Prompt strings -> [B, 512, 3*hidden] through klein_core (template, tokenizer, right padding,
    truncation at 512, hidden states 9/18/27 concatenated per token) against diffusers'
    ``Flux2KleinPipeline._get_qwen3_prompt_embeds`` driving transformers with Qwen3's chat template:
    empty, 1-word, exactly 512 tokens, 513, far over 512, typed special tokens. Bit-identical."""
    from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

    te = tiny_text_encoder(TINY_4B)
    hf = _hf_from_pretrained(_mirror_tiny_encoder(te), tmp_path / "hf", dtype)
    prompts = _edge_prompts(qwen3_tokenizer)
    with torch.no_grad():
        expected = Flux2KleinPipeline._get_qwen3_prompt_embeds(hf, qwen3_tokenizer, prompts)
    got = encode_prompts(te.to(dtype), prompts, cache=None)
    assert got.shape == expected.shape == (len(prompts), 512, 3 * te.config.hidden_size)
    assert got.dtype == expected.dtype == dtype
    per_prompt = [_max_diff(got[i], expected[i]) for i in range(len(prompts))]
    parity(f"prompt embeddings {dtype}, edge prompts vs diffusers _get_qwen3_prompt_embeds", max(per_prompt))
    assert max(per_prompt) == 0.0, f"max abs diff per prompt: {per_prompt}"
