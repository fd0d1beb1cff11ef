"""One LoRA training step against diffusers' Flux2 transformer with peft LoRA on the same weights,
batch, noise and sigmas (drawn with diffusers' own density and scheduler): loss within 1e-5 and
LoRA gradients within 1e-4 relative, text-only and for an edit pair with two references."""

from __future__ import annotations

import copy

import pytest
import torch
from extras import require
from tiny_reference import CTX, tiny_diffusers_transformer

from klein_core.files.loaders import load_transformer
from klein_core.train.adapters import LoRASet, preset
from klein_core.train.objective import ObjectiveConfig, sample_density, sigmas_for
from klein_core.train.step import StepNoise, TrainBatch, compute_loss

diffusers = require("diffusers")
require("peft")
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3
from peft import LoraConfig, inject_adapter_in_model

RANK, ALPHA = 3, 6.0
# The test's own map from diffusers' Flux2 module names to (core module, q/k/v part).
_DOUBLE = {"attn.to_q": ("img_attn.qkv", 0), "attn.to_k": ("img_attn.qkv", 1), "attn.to_v": ("img_attn.qkv", 2),
           "attn.add_q_proj": ("txt_attn.qkv", 0), "attn.add_k_proj": ("txt_attn.qkv", 1),
           "attn.add_v_proj": ("txt_attn.qkv", 2), "attn.to_out.0": ("img_attn.proj", 0),
           "attn.to_add_out": ("txt_attn.proj", 0), "ff.linear_in": ("img_mlp.0", 0), "ff.linear_out": ("img_mlp.2", 0),
           "ff_context.linear_in": ("txt_mlp.0", 0), "ff_context.linear_out": ("txt_mlp.2", 0)}
_SINGLE = {"attn.to_qkv_mlp_proj": ("linear1", 0), "attn.to_out": ("linear2", 0)}


def _pairs(n_double: int, n_single: int) -> dict[str, tuple[str, int]]:
    out = {}
    for i in range(n_double):
        out.update({f"transformer_blocks.{i}.{d}": (f"double_blocks.{i}.{c}", p) for d, (c, p) in _DOUBLE.items()})
    for i in range(n_single):
        out.update({f"single_transformer_blocks.{i}.{d}": (f"single_blocks.{i}.{c}", p) for d, (c, p) in _SINGLE.items()})
    return out


@pytest.fixture(scope="module")
def models():
    dm = tiny_diffusers_transformer(seed=3)
    ours = load_transformer({k: v.contiguous() for k, v in dm.state_dict().items()})
    lora = LoRASet(ours, preset("full", rank=RANK, alpha=ALPHA), seed=1)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # B starts at 0; make it random so A gets gradients too
        for layer in lora.layers.values():
            layer.up.copy_(torch.randn(layer.up.shape, generator=g) * 0.3)
    pairs = _pairs(2, 2)
    assert {c for c, _ in pairs.values()} == set(lora.names())
    ref = copy.deepcopy(dm)
    inject_adapter_in_model(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(pairs)), ref)
    mods = dict(ref.named_modules())
    with torch.no_grad():
        for dname, (core, part) in pairs.items():
            layer = lora.layer(core)
            mods[dname].lora_A["default"].weight.copy_(layer.down[part])
            mods[dname].lora_B["default"].weight.copy_(layer.up[part])
    ref.requires_grad_(False)
    for n, p in ref.named_parameters():
        if "lora_" in n:
            p.requires_grad_(True)
    return ours, lora, ref, mods, pairs


def _reference_step(ref, batch: TrainBatch, noise, u, scheme, shift):
    pipe = diffusers.Flux2KleinPipeline
    sched = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    indices = (u * sched.config.num_train_timesteps).long()
    timesteps = sched.timesteps[indices]
    sigmas = sched.sigmas[[(sched.timesteps == t).nonzero().item() for t in timesteps]].reshape(-1, 1, 1, 1)
    x0 = batch.latents
    noisy = (1.0 - sigmas) * x0 + sigmas * noise
    ids = pipe._prepare_latent_ids(x0)
    tokens = [pipe._pack_latents(noisy)]
    all_ids = [ids]
    if batch.references:
        refs = list(batch.references)
        cond_ids = pipe._prepare_image_ids([r[0:1] for r in refs]).expand(x0.shape[0], -1, -1)
        tokens += [pipe._pack_latents(r) for r in refs]
        all_ids.append(cond_ids)
    pred = ref(hidden_states=torch.cat(tokens, 1), timestep=timesteps / 1000, guidance=None,
               encoder_hidden_states=batch.text, txt_ids=pipe._prepare_text_ids(batch.text),
               img_ids=torch.cat(all_ids, 1), return_dict=False)[0]
    pred = pipe._unpack_latents_with_ids(pred[:, : tokens[0].shape[1]], ids)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=scheme, sigmas=sigmas)
    target = noise - x0
    return torch.mean((weighting.float() * (pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1).mean()


@pytest.mark.parametrize("case", ["text", "edit"])
def test_one_step_matches_diffusers_peft(models, case, parity):
    ours, lora, ref, mods, pairs = models
    scheme, shift = ("logit_normal", 3.0) if case == "text" else ("cosmap", 1.0)
    cfg = ObjectiveConfig(weighting_scheme=scheme, shift=shift)
    g = torch.Generator().manual_seed(11)
    refs = (torch.randn(2, 8, 2, 3, generator=g), torch.randn(2, 8, 3, 2, generator=g)) if case == "edit" else ()
    batch = TrainBatch(torch.randn(2, 8, 3, 4, generator=g), torch.randn(2, 5, CTX, generator=g), refs)
    noise = torch.randn(batch.latents.shape, generator=g)
    u = sample_density(cfg, 2, torch.Generator().manual_seed(7))
    u_ref = compute_density_for_timestep_sampling(scheme, 2, logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
                                                  generator=torch.Generator().manual_seed(7))
    assert torch.equal(u, u_ref)
    sigmas, timesteps = sigmas_for(cfg, u)

    lora.zero_grad()
    lora.attach(ours)
    try:
        loss, _ = compute_loss(ours, batch, StepNoise(noise, sigmas, timesteps), cfg)
        loss.backward()
    finally:
        lora.detach()
    ref.zero_grad()
    ref_loss = _reference_step(ref, batch, noise, u_ref, scheme, shift)
    ref_loss.backward()

    assert ref_loss.item() > 0.1
    diff = parity(f"train step loss vs diffusers+peft ({case})", abs(loss.item() - ref_loss.item()))
    assert diff <= 1e-5
    worst = 0.0
    for dname, (core, part) in pairs.items():
        layer = lora.layer(core)
        for mine, theirs in ((layer.down.grad[part], mods[dname].lora_A["default"].weight.grad),
                             (layer.up.grad[part], mods[dname].lora_B["default"].weight.grad)):
            scale = theirs.abs().max().item()
            assert scale > 0, dname
            worst = max(worst, (mine - theirs).abs().max().item() / scale)
    parity(f"train step LoRA grads vs diffusers+peft, relative ({case})", worst)
    assert worst <= 1e-4


# -- text-encoder LoRA --------------------------------------------------------------------------

TE_RANK, TE_ALPHA = 2, 3.0
TE_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SPEC_LAYERS = (9, 18, 27)  # SPEC §2.3, written here rather than read from klein_core


@pytest.fixture(scope="module")
def text_models():
    transformers = require("transformers")
    from klein_core.files.loaders import load_text_encoder
    from klein_core.train.adapters import text_encoder_preset

    torch.manual_seed(4)
    # 28 layers: transformers' last hidden state is after the final norm, so layer 27's must not be the last
    cfg = transformers.Qwen3Config(hidden_size=CTX // 3, intermediate_size=16, num_hidden_layers=28,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=4, vocab_size=64,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
                                   tie_word_embeddings=False, initializer_range=0.2, attn_implementation="sdpa")
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    ours = load_text_encoder({k: v.clone().contiguous() for k, v in hf.state_dict().items()})
    te_lora = LoRASet(ours, text_encoder_preset(rank=TE_RANK, alpha=TE_ALPHA), seed=2)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():  # B random so A gets gradients too
        for layer in te_lora.layers.values():
            layer.up.copy_(torch.randn(layer.up.shape, generator=g) * 0.3)
    targets = [f"model.layers.{i}.{n}" for i in range(27) for n in TE_LINEARS]
    assert sorted(t.removeprefix("model.") for t in targets) == sorted(te_lora.names())
    inject_adapter_in_model(LoraConfig(r=TE_RANK, lora_alpha=TE_ALPHA, target_modules=targets), hf)
    mods = dict(hf.named_modules())
    with torch.no_grad():
        for t in targets:
            layer = te_lora.layer(t.removeprefix("model."))
            mods[t].lora_A["default"].weight.copy_(layer.down[0])
            mods[t].lora_B["default"].weight.copy_(layer.up[0])
    hf.requires_grad_(False)
    for n, p in hf.named_parameters():
        if "lora_" in n:
            p.requires_grad_(True)
    return ours, te_lora, hf, mods, targets


def test_one_step_with_a_text_encoder_lora_matches_transformers_diffusers_peft(models, text_models, parity):
    """Both LoRAs train at once: the prompt goes through our Qwen3 with its LoRA (encode_text, with
    gradients) and through transformers' Qwen3 with peft's; the loss and the gradients of both
    LoRAs match."""
    from klein_core.train.step import encode_text

    ours, lora, ref, mods, pairs = models
    te, te_lora, hf, te_mods, targets = text_models
    cfg = ObjectiveConfig(weighting_scheme="none")
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(1, 64, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0  # right padding, as Klein's prompts
    latents = torch.randn(2, 8, 3, 4, generator=g)
    noise = torch.randn(latents.shape, generator=g)
    u = sample_density(cfg, 2, torch.Generator().manual_seed(3))
    sigmas, timesteps = sigmas_for(cfg, u)

    lora.zero_grad()
    te_lora.zero_grad()
    lora.attach(ours)
    te_lora.attach(te)
    try:
        text = encode_text(te, ids, mask)
        loss, _ = compute_loss(ours, TrainBatch(latents, text), StepNoise(noise, sigmas, timesteps), cfg)
        loss.backward()
    finally:
        lora.detach()
        te_lora.detach()
    ref.zero_grad()
    hf.zero_grad()
    out = hf(ids, attention_mask=mask, output_hidden_states=True)
    ref_text = torch.cat([out.hidden_states[i] for i in SPEC_LAYERS], dim=-1)
    ref_loss = _reference_step(ref, TrainBatch(latents, ref_text), noise, u, "none", 1.0)
    ref_loss.backward()

    diff = parity("train step loss with a text-encoder LoRA vs transformers+diffusers+peft",
                  abs(loss.item() - ref_loss.item()))
    assert ref_loss.item() > 0.1 and diff <= 1e-5
    worst_te = 0.0
    for t in targets:
        layer = te_lora.layer(t.removeprefix("model."))
        for mine, theirs in ((layer.down.grad[0], te_mods[t].lora_A["default"].weight.grad),
                             (layer.up.grad[0], te_mods[t].lora_B["default"].weight.grad)):
            scale = theirs.abs().max().item()
            assert scale > 0, t
            worst_te = max(worst_te, (mine - theirs).abs().max().item() / scale)
    parity("text-encoder LoRA grads vs transformers+peft, relative", worst_te)
    assert worst_te <= 1e-4
    worst = max((layer_grad - mods[d].lora_A["default"].weight.grad).abs().max().item()
                / mods[d].lora_A["default"].weight.grad.abs().max().item()
                for d, (core, part) in pairs.items() for layer_grad in (lora.layer(core).down.grad[part],))
    assert worst <= 1e-4
