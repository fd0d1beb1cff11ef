"""GGUF files and GGML blocks: dequantisation bit for bit against the ``gguf`` package (llama.cpp's
own reader), transformer and Qwen3 files written with ``gguf.GGUFWriter`` in the published
namings and loaded through the public loaders, outputs per type, and q8/q4 on load."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from extras import require
from gguf_files import KQUANTS
from gguf_files import block_kind as _kind
from gguf_files import dequantized_values as _gguf_reference_values
from gguf_files import hf_to_llama as _hf_to_llama
from gguf_files import random_blocks as _random_blocks
from gguf_files import write_gguf as _write_gguf
from safetensors.torch import save_file

import klein_core as kc
from klein_core.files.identify import probe
from klein_core.files.loaders import meta_model
from klein_core.memory.placement import module_bytes
from klein_core.memory.planner import weights_home
from klein_core.models.transformer import Flux2Transformer, TransformerConfig
from klein_core.models.variants import KLEIN_4B, KLEIN_9B
from klein_core.pipeline.sampling import position_ids, text_position_ids
from klein_core.pipeline.tokenizer import tokenize_prompts
from klein_core.quant.ggml import GGMLLinear, GGMLType, dequantize, ggml_layers, quantize
from klein_core.testing import tiny_text_encoder

gguf = require("gguf")
T = gguf.GGMLQuantizationType
LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)))


@pytest.mark.parametrize("name", LEGACY + list(KQUANTS))
@pytest.mark.parametrize("finite", [True, False])
def test_dequantize_is_bit_identical_to_gguf(name, finite, parity):
    rng = np.random.default_rng(len(name) + finite)
    elems = gguf.GGML_QUANT_SIZES[getattr(T, name)][0]
    raw = _random_blocks(name, 9, elems * 3, rng, finite=finite)
    ref = gguf.quants.dequantize(raw, getattr(T, name))
    ours = dequantize(torch.from_numpy(raw), int(getattr(T, name)), ref.shape).numpy()
    assert _same_bits(ours, ref)
    if finite:
        parity(f"GGUF {name} dequantised vs gguf.quants.dequantize (max abs)", float(np.abs(ours - ref).max()))


@pytest.mark.parametrize("name", ["F16", "BF16"])
def test_float_types_read_exactly(name):
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    raw = gguf.quants.quantize(x, getattr(T, name))
    ref = gguf.quants.dequantize(raw, getattr(T, name))
    ours = dequantize(torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8)), int(getattr(T, name)), (4, 64))
    assert _same_bits(ours.numpy(), ref)


@pytest.mark.parametrize("name", LEGACY)
def test_quantize_is_bit_identical_to_gguf(name):
    x = np.random.default_rng(1).standard_normal((6, 96)).astype(np.float32)
    x[0, :32] = 0  # an all-zero block (scale 0)
    x[1, 5] = 40.0  # an outlier
    assert np.array_equal(quantize(torch.from_numpy(x), int(getattr(T, name))).numpy(),
                          gguf.quants.quantize(x, getattr(T, name)))


# ----- files ----------------------------------------------------------------------------------------


CFG = TransformerConfig(hidden_size=256, num_heads=2, depth=1, depth_single=1, context_dim=96, mlp_hidden=768,
                        axes_dim=(32, 32, 32, 32))


@pytest.fixture(scope="module")
def float_transformer():
    torch.manual_seed(0)
    model = Flux2Transformer(CFG).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def _run(model, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    img, txt = torch.randn(2, 12, 128, generator=g), torch.randn(2, 5, 96, generator=g)
    with torch.no_grad():
        return model(img=img, img_ids=position_ids(3, 4), txt=txt, txt_ids=text_position_ids(5),
                     timesteps=torch.tensor([0.9, 0.4]))


@pytest.mark.parametrize("block", LEGACY + list(KQUANTS) + ["F16"])
def test_transformer_gguf_loads_exactly_and_per_type_quality(tmp_path, float_transformer, block, parity):
    sd = {k: v.numpy() for k, v in float_transformer.state_dict().items()}
    path = tmp_path / f"flux-2-klein-tiny-{block}.gguf"
    _write_gguf(path, {k: (v, _kind(k, v, block)) for k, v in sd.items()}, "flux")
    model = kc.load_transformer(path, dtype=torch.float32)
    layers = ggml_layers(model)
    if block != "F16":
        assert layers and set(layers.values()) == {block}
        assert all(k.startswith(("double_blocks.", "single_blocks.")) for k in layers)
    # the loaded model is the file's values exactly: a float model built from gguf's own dequantisation
    exact = Flux2Transformer(CFG).eval()
    exact.load_state_dict(_gguf_reference_values(path))
    diff = (_run(model) - _run(exact)).abs().max().item()
    parity(f"GGUF transformer {block} blocks: output vs a float model of gguf's dequantised values", diff)
    assert diff <= 1e-5  # (not 0: CPU matmuls differ in the last bit between buffers of other alignment)
    if block not in KQUANTS:  # K blocks are random here (no K quantiser in gguf-py): no quality figure
        ref = _run(float_transformer)
        rel = ((_run(model) - ref).norm() / ref.norm()).item()
        parity(f"GGUF transformer {block} blocks vs the float model (relative L2, not a diff)", rel)
        # about twice what was measured (Q4_0 1.9e-2, Q4_1 1.7e-2, Q5 8-9e-3, Q8_0 1.2e-3, F16 3.1e-4)
        assert rel < {"Q4_0": 0.04, "Q4_1": 0.035, "Q5_0": 0.02, "Q5_1": 0.02, "Q8_0": 0.003, "F16": 7e-4}[block]


@pytest.mark.parametrize("mode", ["fp8", "q8", "q4"])
def test_quantize_choice_leaves_a_gguf_files_blocks_as_stored(tmp_path, float_transformer, mode):
    """weight_dtype fp8 / q8 / q4 on a GGUF file: its quantised blocks stay as stored (they once were
    read as raw bytes for fp8 and failed to load), and the model computes what quantize=None gives."""
    sd = {k: v.numpy() for k, v in float_transformer.state_dict().items()}
    path = tmp_path / "flux-2-klein-tiny-Q8_0.gguf"
    _write_gguf(path, {k: (v, _kind(k, v, "Q8_0")) for k, v in sd.items()}, "flux")
    stored = kc.load_transformer(path, dtype=torch.float32)
    chosen = kc.load_transformer(path, dtype=torch.float32, quantize=mode)
    assert ggml_layers(chosen) == ggml_layers(stored) and set(ggml_layers(stored).values()) == {"Q8_0"}
    assert torch.equal(_run(chosen), _run(stored))


def test_prefixed_names_and_weightless_size(tmp_path, float_transformer):
    sd = {k: v.numpy() for k, v in float_transformer.state_dict().items()}
    path = tmp_path / "prefixed.gguf"
    _write_gguf(path, {"model.diffusion_model." + k: (v, _kind(k, v, "Q8_0")) for k, v in sd.items()}, None)
    info = probe(path)
    assert info.kind == "transformer" and info.text_width == 96
    meta = meta_model(path, "transformer", dtype=torch.bfloat16)
    real = kc.load_transformer(path, dtype=torch.bfloat16)
    assert module_bytes(meta) == module_bytes(real)  # the planner counts the blocks' real bytes
    bf16 = kc.load_transformer(float_transformer.state_dict(), dtype=torch.bfloat16)
    assert module_bytes(real) < 0.75 * module_bytes(bf16)


@pytest.mark.parametrize("block", ["Q8_0", "Q4_0"])
def test_qwen3_gguf_in_llama_cpp_names(tmp_path, block, parity):
    te = tiny_text_encoder()
    sd = {("model." + k): v.numpy() for k, v in te.state_dict().items()}
    path = tmp_path / f"qwen_3_4b-{block}.gguf"
    tensors = {_hf_to_llama(k): (v, "F32" if v.ndim == 1 else block) for k, v in sd.items()}
    _write_gguf(path, tensors, "qwen3")
    info = probe(path)
    assert info.kind == "text_encoder" and info.text_width == 96
    ours = kc.load_text_encoder(path, dtype=torch.float32)
    assert set(ggml_layers(ours).values()) == {block}
    ref_values = {k: v for k, v in _gguf_reference_values(path).items()}
    exact = {k: ref_values[_hf_to_llama(k)] for k in sd}
    save_file({k: v.contiguous() for k, v in exact.items()}, tmp_path / "exact.safetensors")
    reference = kc.load_text_encoder(tmp_path / "exact.safetensors", dtype=torch.float32)
    ids, mask = tokenize_prompts(["a red fox", "blurry"], max_length=24)
    diff = (ours.encode(ids, mask) - reference.encode(ids, mask)).abs().max().item()
    parity(f"GGUF Qwen3 ({block}, llama.cpp names) vs the same values from safetensors", diff)
    assert diff <= 1e-5


@pytest.mark.parametrize("mode,qtype,max_rel", [("q8", "Q8_0", 0.003), ("q4", "Q4_0", 0.04)])
def test_quantize_on_load(tmp_path, float_transformer, mode, qtype, max_rel, parity):
    path = tmp_path / "bf16.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in float_transformer.state_dict().items()}, path)
    bf16 = kc.load_transformer(path, dtype=torch.float32)
    q = kc.load_transformer(path, dtype=torch.float32, quantize=mode)
    assert set(ggml_layers(q).values()) == {qtype}
    ref = _run(bf16)
    rel = ((_run(q) - ref).norm() / ref.norm()).item()
    parity(f"quantize='{mode}' on load vs the bf16 file (relative L2, not a diff)", rel)
    assert 0 < rel < max_rel
    q_bf16 = kc.load_transformer(path, dtype=torch.bfloat16, quantize=mode)
    ratio = module_bytes(q_bf16) / module_bytes(kc.load_transformer(path, dtype=torch.bfloat16))
    parity(f"quantize='{mode}': resident bytes / bf16 bytes (tiny model, not a diff)", ratio)
    assert ratio < (0.75 if mode == "q8" else 0.55)  # tiny: the unquantised embedders weigh a lot here
    assert module_bytes(meta_model(path, "transformer", dtype=torch.bfloat16, quantize=mode)) == \
        module_bytes(kc.load_transformer(path, dtype=torch.bfloat16, quantize=mode))


def test_loras_run_as_branches_on_ggml_layers_and_refuse_to_merge(tmp_path, float_transformer):
    sd = {k: v.numpy() for k, v in float_transformer.state_dict().items()}
    path = tmp_path / "m.gguf"
    _write_gguf(path, {k: (v, _kind(k, v, "Q8_0")) for k, v in sd.items()}, "flux")
    model = kc.load_transformer(path, dtype=torch.float32)
    name = "double_blocks.0.img_attn.qkv"
    g = torch.Generator().manual_seed(0)
    lora = kc.load_lora({f"diffusion_model.{name}.lora_A.weight": torch.randn(4, 256, generator=g) * 0.1,
                         f"diffusion_model.{name}.lora_B.weight": torch.randn(768, 4, generator=g) * 0.1})
    with pytest.raises(NotImplementedError, match="as a branch"):
        kc.apply_loras(model, lora)
    patched = kc.with_loras(model, lora)
    assert not torch.equal(_run(patched), _run(model))
    # the same LoRA as a branch on the float model of the file's values gives the same output
    exact = Flux2Transformer(CFG).eval()
    exact.load_state_dict(_gguf_reference_values(path))
    assert (_run(kc.with_loras(exact, lora)) - _run(patched)).abs().max().item() < 1e-5


def test_dora_on_ggml_layers_rescales_the_unpacked_weight(tmp_path, float_transformer, parity):
    """A DoRA LoRA on a GGUF layer: its change is computed from the unpacked weight (kept dense as a
    branch), so the output is that of the same LoRA merged into the float model of the file's values."""
    sd = {k: v.numpy() for k, v in float_transformer.state_dict().items()}
    path = tmp_path / "m.gguf"
    _write_gguf(path, {k: (v, _kind(k, v, "Q8_0")) for k, v in sd.items()}, "flux")
    model = kc.load_transformer(path, dtype=torch.float32)
    exact = Flux2Transformer(CFG).eval()
    exact.load_state_dict(_gguf_reference_values(path))
    name = "double_blocks.0.img_attn.qkv"
    g = torch.Generator().manual_seed(0)
    norms = exact.get_submodule(name).weight.detach().norm(dim=1, keepdim=True)
    lora = kc.load_lora({f"diffusion_model.{name}.lora_A.weight": torch.randn(4, 256, generator=g) * 0.1,
                         f"diffusion_model.{name}.lora_B.weight": torch.randn(768, 4, generator=g) * 0.1,
                         f"diffusion_model.{name}.dora_scale": norms * (0.5 + torch.rand(768, 1, generator=g))})
    patched = kc.with_loras(model, [(lora, 0.7)])
    kc.apply_loras(exact, [(lora, 0.7)])  # merged into the float weights
    diff = (_run(exact) - _run(patched)).abs().max().item()
    parity("DoRA on GGUF Q8_0 layers (branch) vs merged into the file's float values", diff)
    assert diff < 1e-5 and (_run(patched) - _run(model)).abs().max().item() > 1e-2


def test_gguf_errors_name_the_file(tmp_path):
    (tmp_path / "broken.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x07" * 40)
    with pytest.raises(kc.WeightFormatError, match="broken.gguf"):
        kc.load_transformer(tmp_path / "broken.gguf")
    layer = GGMLLinear(64, 8, GGMLType.Q8_0)
    with pytest.raises(ValueError, match="whole number of Q4_K blocks"):
        GGMLLinear(100, 8, GGMLType.Q4_K)
    assert "Q8_0" in repr(layer)


@pytest.mark.parametrize("mode", ["q8", "q4"])
def test_full_size_resident_bytes(mode, parity):
    """Klein 4B and 9B with their block Linears as GGML blocks, counted on the meta device."""
    from klein_core.files.gguf import swap_to_ggml_
    from klein_core.quant.fp8 import block_linear_names
    from klein_core.quant.ggml import QUANTIZE_TYPES

    for variant in (KLEIN_4B, KLEIN_9B):
        cfg = TransformerConfig(hidden_size=variant.hidden, num_heads=variant.heads, depth=variant.depth,
                                depth_single=variant.depth_single, context_dim=variant.text_width,
                                mlp_hidden=3 * variant.hidden)
        with torch.device("meta"):
            model = Flux2Transformer(cfg).to(torch.bfloat16)
        full = module_bytes(model)
        swap_to_ggml_(model, {n + ".weight": QUANTIZE_TYPES[mode] for n in block_linear_names(model)},
                      torch.bfloat16)
        size = module_bytes(model)
        parity(f"{variant.name} transformer resident with quantize='{mode}' (GiB, not a diff)", size / 2**30)
        assert size < full * (0.6 if mode == "q8" else 0.35)


def test_an_8gb_card_keeps_a_9b_q4_transformer_resident():
    """The planner counts the blocks' real bytes: 9B Q4 (5.2 GiB) stays on an 8 GB card, bf16 does not."""
    from klein_core.files.gguf import swap_to_ggml_
    from klein_core.quant.fp8 import block_linear_names

    v = KLEIN_9B
    cfg = TransformerConfig(hidden_size=v.hidden, num_heads=v.heads, depth=v.depth, depth_single=v.depth_single,
                            context_dim=v.text_width, mlp_hidden=3 * v.hidden)
    with torch.device("meta"):
        bf16 = Flux2Transformer(cfg).to(torch.bfloat16)
        q4 = Flux2Transformer(cfg).to(torch.bfloat16)
    swap_to_ggml_(q4, {n + ".weight": GGMLType.Q4_0 for n in block_linear_names(q4)}, torch.bfloat16)
    free = 7_800 * 2**20  # what an 8 GB card has free
    assert weights_home(q4, "cuda", free_bytes=free) == torch.device("cuda")
    assert weights_home(bf16, "cuda", free_bytes=free) == torch.device("cpu")
