"""Parity of klein_core's Qwen3 text encoder with transformers' Qwen3ForCausalLM.

A tiny random HF model (30 layers: with exactly 27, transformers would replace hidden_states[27]
by the normed output) is saved in every layout users meet (ComfyUI single file, sharded HF folder,
HF repo root with ``text_encoder/``, state dict, ComfyUI all-in-one prefix), loaded through
``load_text_encoder``, and compared on a right-padded batch with
``cat(hidden_states[9], [18], [27])``, pad positions included.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from extras import require
from safetensors.torch import save_file

from klein_core.files.key_map import check_key_map
from klein_core.files.loaders import load_text_encoder
from klein_core.files.opening import open_weights
from klein_core.files.qwen3_layout import checkpoint_shapes, qwen3_key_map
from klein_core.files.source import WeightSource
from klein_core.models.qwen3 import Qwen3Config, Qwen3TextEncoder

transformers = require("transformers")

HIDDEN, VOCAB, N_LAYERS = 64, 1000, 30
FP32_TOL = 1e-4
# SPEC §2.3: Klein concatenates hidden states 9, 18 and 27. Written here, never read from klein_core
# (OUTPUT_LAYERS), so the reference cannot move with a bug in the code under test.
SPEC_LAYERS = (9, 18, 27)
AIO_PREFIX = "text_encoders.qwen3_4b.transformer."


def _tiny_hf(seed: int = 0, rope_theta: float = 1e6, attn: str = "sdpa"):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        # transformers 5.x: RoPE settings live in rope_parameters (a top-level rope_theta is legacy)
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.1,  # larger than the default 0.02 so attention is far from uniform
        attn_implementation=attn,
    )
    assert cfg.rope_parameters["rope_theta"] == rope_theta
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norm weights start at 1; randomise them so norm placement matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded batch with real lengths 13, 9 and 3 (pad id 0, like Qwen's pad in spirit)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, 13), generator=g)
    mask = torch.ones(3, 13, dtype=torch.long)
    mask[1, 9:] = 0
    mask[2, 3:] = 0
    ids[mask == 0] = 0
    return ids, mask


def _reference(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in SPEC_LAYERS], dim=-1)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module")
def hf_model():
    return _tiny_hf()


@pytest.fixture(scope="module")
def reference(hf_model) -> torch.Tensor:
    return _reference(hf_model, *_batch())


@pytest.fixture(scope="module")
def state_dict(hf_model) -> dict[str, torch.Tensor]:
    return {k: v.clone().contiguous() for k, v in hf_model.state_dict().items()}


@pytest.fixture(scope="module")
def files(tmp_path_factory, hf_model, state_dict) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3")
    comfy = root / "qwen_3_tiny.safetensors"
    save_file(state_dict, str(comfy))  # model.* keys plus lm_head.weight, like ComfyUI's file
    folder = root / "hf_folder"
    hf_model.save_pretrained(folder, max_shard_size="200KB")
    repo = root / "repo"
    hf_model.save_pretrained(repo / "text_encoder", max_shard_size="200KB")
    (repo / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline"}))
    decoy = repo / "transformer"
    decoy.mkdir()
    save_file({"single_stream_modulation.lin.weight": torch.zeros(6, 2)}, str(decoy / "model.safetensors"))
    aio = root / "all_in_one.safetensors"
    aio_sd = {AIO_PREFIX + k: v for k, v in state_dict.items()}
    aio_sd["model.diffusion_model.img_in.weight"] = torch.zeros(4, 8)  # other components are skipped
    aio_sd["vae.decoder.conv_in.weight"] = torch.zeros(2, 2, 3, 3)
    save_file(aio_sd, str(aio))
    return {"comfy_file": comfy, "hf_folder": folder, "hf_repo_root": repo, "all_in_one": aio}


def _source(layout: str, files: dict[str, Path], state_dict: dict[str, torch.Tensor]):
    return state_dict if layout == "state_dict" else files[layout]


# ---------------------------------------------------------------------------------------------
# Parity


@pytest.mark.parametrize("layout", ["comfy_file", "hf_folder", "hf_repo_root", "state_dict", "all_in_one"])
def test_fp32_parity_every_layout(layout, files, state_dict, reference, parity):
    te = load_text_encoder(_source(layout, files, state_dict))
    ids, mask = _batch()
    out = te.encode(ids, mask)
    assert out.shape == (3, 13, 3 * HIDDEN) == (*ids.shape, te.config.text_dim)
    assert out.dtype == torch.float32
    diff = parity(f"text encoder fp32, {layout}", _max_diff(out, reference))
    assert diff <= FP32_TOL, f"{layout}: fp32 max abs diff {diff:.3e} > {FP32_TOL}"
    # pad positions are computed and kept, not zeroed
    assert out[2, 3:].abs().amax() > 0.1


def test_hf_folder_is_sharded(files):
    folder = files["hf_folder"]
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1


def test_eager_reference_agrees(files):
    model = _tiny_hf(attn="eager")  # same seed: same weights, other attention kernel
    ids, mask = _batch()
    te = load_text_encoder(model.state_dict())
    diff = _max_diff(te.encode(ids, mask), _reference(model, ids, mask))
    assert diff <= FP32_TOL, f"eager reference: max abs diff {diff:.3e}"


def test_bf16_close_to_fp32_reference(files, reference, parity):
    te = load_text_encoder(files["comfy_file"], dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in te.parameters())
    ids, mask = _batch()
    out = te.encode(ids, mask)
    assert out.dtype == torch.bfloat16

    def rel(x: torch.Tensor) -> float:
        return ((x.float() - reference).norm() / reference.norm()).item()

    # 27 random layers in bf16 drift ~2% from fp32; transformers' own bf16 run sets the yardstick.
    hf_rel = rel(_reference(_tiny_hf().to(torch.bfloat16), ids, mask))
    ours = rel(out)
    worst = _max_diff(out, reference) / reference.abs().max().item()
    msg = f"bf16: relative L2 {ours:.3e} (transformers bf16: {hf_rel:.3e}), max abs / max|ref| {worst:.3e}"
    parity("text encoder bf16 (relative L2 vs fp32 reference)", ours)
    parity("text encoder bf16, transformers' own bf16 model (relative L2 vs fp32)", hf_rel)
    assert ours < 5e-2 and ours < 1.5 * hf_rel, msg
    assert worst < 5e-2, msg


def test_left_padding_matches_transformers_sdpa(hf_model):
    # Leading pads have no visible key; transformers' SDPA path zeroes their attention output.
    ids, _ = _batch()
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :10] = 0
    te = load_text_encoder(hf_model.state_dict())
    out = te.encode(ids, mask)
    assert torch.isfinite(out).all()
    diff = _max_diff(out, _reference(hf_model, ids, mask))
    assert diff <= FP32_TOL, f"left padding: max abs diff {diff:.3e}"


def test_hf_config_rope_theta_is_used(tmp_path):
    model = _tiny_hf(seed=3, rope_theta=10_000.0)
    model.save_pretrained(tmp_path)
    te = load_text_encoder(tmp_path)
    assert te.config.rope_theta == 10_000.0
    ids, mask = _batch()
    diff = _max_diff(te.encode(ids, mask), _reference(model, ids, mask))
    assert diff <= FP32_TOL, f"rope_theta 1e4 from config.json: max abs diff {diff:.3e}"


# ---------------------------------------------------------------------------------------------
# Early exit: what is built and what is read


def _recording(src: WeightSource, log: list[str]) -> WeightSource:
    def reader(key: str) -> torch.Tensor:
        log.append(key)
        return src.get(key)

    return WeightSource(src.name, {k: src.info(k) for k in src.keys()}, reader, src.metadata)


@pytest.mark.parametrize("layout", ["comfy_file", "all_in_one"])
def test_unused_tensors_are_never_read(layout, files, state_dict):
    log: list[str] = []
    src = _recording(open_weights(files[layout], component="text encoder"), log)
    te = load_text_encoder(src)
    prefix = AIO_PREFIX if layout == "all_in_one" else ""
    layer = re.compile(re.escape(prefix) + r"model\.layers\.(\d+)\.")
    expected = {
        prefix + k
        for k in state_dict
        if k == "model.embed_tokens.weight" or ((m := layer.match(prefix + k)) and int(m.group(1)) < 27)
    }
    assert len(log) == len(set(log)), "a tensor was read twice"
    assert set(log) == expected
    assert not any(k.endswith(("lm_head.weight", "model.norm.weight")) for k in log)
    assert max(int(m.group(1)) for k in log if (m := layer.match(k))) == 26
    assert len(te.layers) == 27 and te.config.num_layers_in_file == N_LAYERS


def test_plan_ignores_unused_and_module_names_follow_hf(state_dict):
    src = open_weights(state_dict, component="text encoder")
    plan = qwen3_key_map(src)
    assert "model.norm.weight" in plan.ignored and "lm_head.weight" in plan.ignored
    assert sum(k.startswith("model.layers.27.") for k in plan.ignored) == 11
    assert not plan.unexpected
    te = load_text_encoder(state_dict)
    expected = {k.removeprefix("model.") for k in state_dict if not any(k == i for i in plan.ignored)}
    assert set(te.state_dict()) == expected
    assert not any(b.is_meta for b in te.buffers()) and not any(p.is_meta for p in te.parameters())
    assert not any(p.requires_grad for p in te.parameters()) and not te.training


# ---------------------------------------------------------------------------------------------
# Config inference (real Klein shapes on the meta device: no memory)


def _fake_qwen3(hidden: int, inter: int, n_layers: int = 36, lm_head: bool = True) -> dict[str, torch.Tensor]:
    heads, kv, hd, vocab = 32, 8, 128, 151936

    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.bfloat16, device="meta")

    shapes = checkpoint_shapes(hidden, heads, kv, hd, inter, vocab, num_layers=n_layers, lm_head=lm_head)
    return {k: meta(*shape) for k, shape in shapes.items()}


@pytest.mark.parametrize(
    ("hidden", "inter", "lm_head", "variant", "text_dim"),
    [(2560, 9728, False, "Qwen3-4B", 7680), (4096, 12288, True, "Qwen3-8B", 12288)],
)
def test_config_from_real_klein_shapes(hidden, inter, lm_head, variant, text_dim):
    src = open_weights(_fake_qwen3(hidden, inter, lm_head=lm_head), component="text encoder")
    cfg = Qwen3Config.from_source(src)
    assert cfg.variant == variant and cfg.text_dim == text_dim
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 128)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.num_layers_in_file) == (inter, 151936, 36)
    assert (cfg.num_layers_run, cfg.rope_theta, cfg.rms_norm_eps) == (27, 1e6, 1e-6)
    plan = qwen3_key_map(src)
    assert len(plan.ops) == 1 + 27 * 11 and len(plan.ignored) == 9 * 11 + 1 + lm_head
    with torch.device("meta"):
        module = Qwen3TextEncoder(cfg)
    check_key_map(module, plan, src, "text encoder")  # the full-size key/shape table fits


def test_config_reads_either_hf_rope_style():
    src = open_weights(_fake_qwen3(1024, 3072, n_layers=28), component="text encoder")
    new = Qwen3Config.from_source(src, {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    old = Qwen3Config.from_source(src, {"rope_theta": 2e5, "rms_norm_eps": 1e-5, "rope_scaling": None})
    assert (new.rope_theta, new.rms_norm_eps) == (5e5, 1e-6)
    assert (old.rope_theta, old.rms_norm_eps) == (2e5, 1e-5)
    assert new.variant == "Qwen3 (hidden 1024)"
    with pytest.raises(ValueError, match="yarn"):
        Qwen3Config.from_source(src, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}})


def test_config_invariants():
    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=96, vocab_size=10, num_layers_in_file=30)
    Qwen3Config(**base)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        Qwen3Config(**{**base, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="head_dim must be even"):
        Qwen3Config(**{**base, "head_dim": 15})
    with pytest.raises(ValueError, match="at least 27"):
        Qwen3Config(**{**base, "num_layers_in_file": 26})
    with pytest.raises(ValueError, match="hidden_size"):
        Qwen3Config(**{**base, "hidden_size": 0})


# ---------------------------------------------------------------------------------------------
# Refusals


_NOT_QWEN3 = {
    "FLUX diffusion transformer": {
        "double_stream_modulation_img.lin.weight": torch.zeros(12, 2),
        "double_blocks.0.img_attn.qkv.weight": torch.zeros(6, 2),
        "single_blocks.0.linear1.weight": torch.zeros(6, 2),
        "txt_in.weight": torch.zeros(2, 6),
    },
    "VAE": {"decoder.conv_in.weight": torch.zeros(2, 2, 3, 3), "encoder.conv_in.weight": torch.zeros(2, 2)},
    "CLIP": {"text_model.embeddings.token_embedding.weight": torch.zeros(4, 2)},
    "T5": {
        "shared.weight": torch.zeros(4, 2),
        "encoder.block.0.layer.0.SelfAttention.q.weight": torch.zeros(2),
    },
    "Qwen2": {
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2),
        "model.layers.0.self_attn.q_proj.bias": torch.zeros(2),
    },
}


@pytest.mark.parametrize("what", list(_NOT_QWEN3))
def test_refuses_other_models(what, tmp_path):
    path = tmp_path / "wrong.safetensors"
    save_file(_NOT_QWEN3[what], str(path))
    with pytest.raises(ValueError, match="expected a Qwen3 text encoder") as err:
        load_text_encoder(path)
    assert what in str(err.value) and str(path) in str(err.value)


def test_refuses_too_few_layers(tmp_path, state_dict):
    path = tmp_path / "qwen3_20_layers.safetensors"
    layer = re.compile(r"model\.layers\.(\d+)\.")
    keep = {k: v for k, v in state_dict.items() if not (m := layer.match(k)) or int(m[1]) < 20}
    save_file(keep, str(path))
    with pytest.raises(ValueError, match=r"only 20 decoder layers") as err:
        load_text_encoder(path)
    assert str(path) in str(err.value)


def test_refuses_wrong_shape(tmp_path, state_dict):
    path = tmp_path / "misshaped.safetensors"
    bad = dict(state_dict)
    bad["model.layers.3.mlp.up_proj.weight"] = torch.zeros(97, HIDDEN)
    save_file(bad, str(path))
    with pytest.raises(ValueError, match=r"layers\.3\.mlp\.up_proj\.weight") as err:
        load_text_encoder(path)
    assert str(path) in str(err.value) and "[97, 64]" in str(err.value)


def test_refuses_missing_tensor(tmp_path, state_dict):
    path = tmp_path / "incomplete.safetensors"
    gone = "model.layers.5.self_attn.k_norm.weight"
    save_file({k: v for k, v in state_dict.items() if k != gone}, str(path))
    with pytest.raises(ValueError, match=r"Missing 1 tensors: 'layers\.5\.self_attn\.k_norm\.weight'") as err:
        load_text_encoder(path)
    assert str(path) in str(err.value)
    no_embed = {k: v for k, v in state_dict.items() if k != "model.embed_tokens.weight"}
    with pytest.raises(ValueError, match="model.embed_tokens.weight"):
        load_text_encoder(no_embed)


def test_encode_validates_inputs(state_dict):
    te = load_text_encoder(state_dict)
    ids, mask = _batch()
    with pytest.raises(ValueError, match=r"\[0, 1000\)"):
        te.encode(ids.clone().fill_(VOCAB), mask)
    with pytest.raises(ValueError, match=r"\[0, 1000\)"):
        te.encode(ids.clone().fill_(-1), mask)
    with pytest.raises(ValueError, match="does not match"):
        te.encode(ids, mask[:, :5])
    with pytest.raises(ValueError, match=r"shape \[batch, length\]"):
        te.encode(ids[0], mask[0])
    with pytest.raises(ValueError, match=r"rows \[1\] are all zeros"):
        te.encode(ids, torch.stack([mask[0], torch.zeros_like(mask[0]), mask[2]]))
    with pytest.raises(ValueError, match="integer"):
        te.encode(ids.float(), mask)
    with pytest.raises(ValueError, match="floating dtype"):
        load_text_encoder(state_dict, dtype=torch.int8)


def test_fp32_activations_match_transformers_on_the_same_bf16_weights(files, hf_model, parity):
    """ComfyUI's way: bf16 weights computing with fp32 activations (each layer cast while it runs)
    equals transformers in fp32 on the bf16-rounded weights."""
    import copy

    te = load_text_encoder(files["comfy_file"], dtype=torch.bfloat16)
    ids, mask = _batch()
    out = te.encode(ids, mask, activations=torch.float32)
    assert out.dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in te.parameters())  # the weights were cast back
    rounded = copy.deepcopy(hf_model)
    with torch.no_grad():  # parameters only: model.to(bf16) would also round the rotary inv_freq buffer
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    reference = _reference(rounded, ids, mask)
    diff = parity("text encoder fp32 activations on bf16 weights vs transformers fp32 on the same weights",
                  _max_diff(out, reference))
    assert diff <= FP32_TOL
    in_bf16 = _max_diff(te.encode(ids, mask), reference)
    assert in_bf16 > 10 * max(diff, 1e-7)  # the model-dtype path really is a different computation


def test_whole_prompt_longer_than_512_matches_transformers(files, hf_model, parity):
    """max_tokens=None keeps every token: a 600-token sequence through the encoder as through transformers."""
    te = load_text_encoder(files["comfy_file"])
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (2, 600), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 520:] = 0
    ids[mask == 0] = 0
    diff = parity("text encoder fp32, 600 tokens (whole prompt) vs transformers",
                  _max_diff(te.encode(ids, mask), _reference(hf_model, ids, mask)))
    assert diff <= FP32_TOL


def test_padding_side_read_from_the_host_mask():
    """``encode`` reads whether a row starts with padding from the host mask (``left_padded``), so the
    forward need not wait for the device; told the side, the forward gives what finding it out
    gives, for right and left padding alike. ``left_padded`` is the definition's: some query sees no
    key (no real token at or before it)."""
    from klein_core.models.qwen3 import left_padded
    from klein_core.testing.tiny import tiny_text_encoder

    g = torch.Generator().manual_seed(5)
    for _ in range(50):
        mask = (torch.rand(3, 9, generator=g) > 0.5).long()
        mask[:, -1] = 1
        blind = ((mask.cumsum(dim=1) == 0).any()).item()  # a position with no real token up to it
        assert left_padded(mask) == blind
    te = tiny_text_encoder()
    ids = torch.randint(0, 1000, (3, 12), generator=g)
    right = torch.ones_like(ids)
    right[1, 7:] = 0
    left = torch.ones_like(ids)
    left[2, :5] = 0
    for mask, side in ((right, False), (left, True)):
        found = te.forward(ids, mask)  # left_padded None: found out on the device
        assert torch.isfinite(found).all()
        assert torch.equal(te.forward(ids, mask, left_padded=side), found)
        assert torch.equal(te.forward(ids, mask, left_padded=True), found)  # blind rows looked for
        assert torch.equal(te.encode(ids, mask), found)
    assert list(te._inv_freq) == [torch.device("cpu")]  # the RoPE frequencies, once per device
