"""NVFP4 files (the ComfyUI / comfy-kitchen / BFL format): our dequantisation bit for bit against
comfy-kitchen's, tiny Klein files written in both marker forms and loaded through load_transformer,
outputs vs the bf16 model, and the bytes a 9B NVFP4 transformer keeps resident (meta path, from a
file with the published 9B layout)."""

from __future__ import annotations

import json

import pytest
import torch
from extras import require
from layout_files import manifests, write_safetensors
from safetensors.torch import save_file

import klein_core as kc
from klein_core.files.loaders import meta_model
from klein_core.memory.placement import module_bytes
from klein_core.pipeline.sampling import position_ids, text_position_ids
from klein_core.quant import nvfp4
from klein_core.quant.fp8 import block_linear_names
from klein_core.testing import tiny_transformer

ck = require("comfy_kitchen")


def _ck_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """comfy-kitchen's own NVFP4 quantisation (eager backend on the CPU), as ComfyUI makes files."""
    pts = (w.abs().amax().float() / (448.0 * 6.0)).reshape(())
    q, bs = ck.quantize_nvfp4(w.float(), pts)
    return q, bs, pts


@pytest.mark.parametrize("shape", [(64, 128), (256, 3072), (96, 48), (300, 2048), (2100, 4096)])  # last: 3 row chunks
def test_dequantize_is_bit_identical_to_comfy_kitchen(shape, parity):
    torch.manual_seed(0)
    w = torch.randn(*shape) * 0.05
    pts = (w.abs().amax().float() / (448.0 * 6.0)).reshape(())
    q, bs = ck.quantize_nvfp4(w, pts, pad_16x=True)
    ref = ck.dequantize_nvfp4(q, pts, bs, torch.float32)[: shape[0], : shape[1]]
    ours = nvfp4.dequantize(q, bs, pts, shape)
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))
    cols = q.shape[1] * 2 // 16
    assert torch.equal(nvfp4.unswizzle(bs, q.shape[0], cols).view(torch.uint8),
                       ck.from_blocked(bs, q.shape[0], cols).view(torch.uint8))
    assert torch.equal(nvfp4.swizzle(nvfp4.unswizzle(bs, q.shape[0], cols)).view(torch.uint8), bs.view(torch.uint8))
    parity(f"NVFP4 dequantised {list(shape)} vs comfy-kitchen dequantize_nvfp4 (max abs)", (ours - ref).abs().max().item())


def _nvfp4_file(path, model, marker: str, input_scale: bool = True) -> list[str]:
    """The model's block Linears in NVFP4 (comfy-kitchen), the rest bf16, in ComfyUI's layout."""
    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    layers = block_linear_names(model)
    meta = None
    for layer in layers:
        q, bs, pts = _ck_quantize(model.get_submodule(layer).weight)
        sd[f"{layer}.weight"] = q
        sd[f"{layer}.weight_scale"] = bs
        sd[f"{layer}.weight_scale_2"] = pts
        if input_scale:
            sd[f"{layer}.input_scale"] = torch.tensor(0.01)
        if marker == "comfy_quant":
            sd[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps({"format": "nvfp4"}).encode()), dtype=torch.uint8)
    if marker == "metadata":
        meta = {"_quantization_metadata": json.dumps({"format_version": "1.0",
                                                      "layers": {la: {"format": "nvfp4"} for la in layers}})}
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata=meta)
    return layers


def _run(model) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    img, txt = torch.randn(2, 12, 128, generator=g), torch.randn(2, 5, 96, generator=g)
    with torch.no_grad():
        return model(img=img, img_ids=position_ids(3, 4), txt=txt, txt_ids=text_position_ids(5),
                     timesteps=torch.tensor([0.9, 0.4]))


def test_dequantising_a_9b_layer_needs_little_more_than_its_bf16_weight(parity):
    """A 9B single-block linear1 (36864 x 4096) dequantised for one call, traced on the meta device:
    it once built int64 codes and float32 products for the whole weight (2.49 GB of temporaries)."""
    from klein_core.memory.trace import trace_activation_bytes

    layer = nvfp4.NVFP4Linear(4096, 36864, device="meta")
    layer.native_matmul = False
    x = torch.empty(1, 16, 4096, dtype=torch.bfloat16, device="meta")
    peak = trace_activation_bytes(lambda: layer(x))
    bf16_weight = 36864 * 4096 * 2
    parity("NVFP4 9B linear1, one call: peak temporary bytes / its bf16 weight (not a diff)", peak / bf16_weight)
    assert peak < bf16_weight + 200 * 2**20, peak  # measured 0.45 GB against 0.30 GB of bf16 weight


def _file_values(model, layers):
    """Exactly an NVFP4 file's values as a float model: ``model`` with comfy-kitchen's dequantised
    weights in ``layers``."""
    exact = tiny_transformer().float()
    exact.load_state_dict(model.state_dict())
    with torch.no_grad():
        for layer in layers:
            q, bs, pts = _ck_quantize(model.get_submodule(layer).weight)
            exact.get_submodule(layer).weight.copy_(ck.dequantize_nvfp4(q, pts, bs, torch.float32))
    return exact


@pytest.mark.parametrize("marker", ["metadata", "comfy_quant", "weight_scale_2 only"])
def test_nvfp4_files_load_and_stay_nvfp4(tmp_path, marker, parity):
    model = tiny_transformer().float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # the bf16 file's values
    path = tmp_path / "flux-2-klein-4b-nvfp4.safetensors"
    layers = _nvfp4_file(path, model, marker)
    loaded = kc.load_transformer(path, dtype=torch.float32)
    assert sorted(nvfp4.nvfp4_layers(loaded)) == sorted(layers)
    exact = _file_values(model, layers)
    diff = (_run(loaded) - _run(exact)).abs().max().item()
    parity(f"NVFP4 file ({marker}): output vs a float model of comfy-kitchen's dequantised weights", diff)
    assert diff <= 1e-5
    ref = _run(model)
    rel = ((_run(loaded) - ref).norm() / ref.norm()).item()
    parity(f"NVFP4 tiny transformer vs the bf16 model (relative L2, not a diff; {marker})", rel)
    assert 0 < rel < 0.005  # measured 1.8e-3
    meta = meta_model(path, "transformer", dtype=torch.bfloat16)
    assert module_bytes(meta) == module_bytes(kc.load_transformer(path, dtype=torch.bfloat16))


@pytest.mark.parametrize("mode", ["fp8", "q8", "q4"])
def test_quantize_choice_leaves_nvfp4_layers_as_stored(tmp_path, mode):
    """weight_dtype fp8 / q8 / q4 on an NVFP4 file: its NVFP4 layers stay NVFP4 (they once were read
    as raw bytes and failed to load); only float block weights would be converted."""
    path = tmp_path / "flux-2-klein-4b-nvfp4.safetensors"
    layers = _nvfp4_file(path, tiny_transformer().float(), "comfy_quant")
    stored = kc.load_transformer(path, dtype=torch.float32)
    chosen = kc.load_transformer(path, dtype=torch.float32, quantize=mode)
    assert sorted(nvfp4.nvfp4_layers(chosen)) == sorted(layers)
    assert torch.equal(_run(chosen), _run(stored))


def test_loras_run_as_branches_on_nvfp4_layers_and_refuse_to_merge(tmp_path):
    model = tiny_transformer().float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # the bf16 file's values
    path = tmp_path / "flux-2-klein-4b-nvfp4.safetensors"
    layers = _nvfp4_file(path, model, "comfy_quant")
    loaded = kc.load_transformer(path, dtype=torch.float32)
    name = "double_blocks.0.img_attn.qkv"
    mod = loaded.get_submodule(name)
    g = torch.Generator().manual_seed(0)
    lora = kc.load_lora({f"diffusion_model.{name}.lora_A.weight": torch.randn(4, mod.in_features, generator=g) * 0.1,
                         f"diffusion_model.{name}.lora_B.weight": torch.randn(mod.out_features, 4, generator=g) * 0.1})
    with pytest.raises(NotImplementedError, match="holds NVFP4 blocks.*as a branch"):
        kc.apply_loras(loaded, lora)
    patched = kc.with_loras(loaded, lora)
    assert not torch.equal(_run(patched), _run(loaded))
    # the same LoRA as a branch on the float model of the file's values gives the same output
    diff = (_run(kc.with_loras(_file_values(model, layers), lora)) - _run(patched)).abs().max().item()
    assert diff < 1e-5, diff


def test_dora_on_nvfp4_layers_rescales_the_unpacked_weight(tmp_path, parity):
    """A DoRA LoRA (per input column) on an NVFP4 layer: its change is computed from the unpacked
    weight, so the branch gives the output of the same LoRA merged into the file's float values."""
    model = tiny_transformer().float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    path = tmp_path / "flux-2-klein-4b-nvfp4.safetensors"
    layers = _nvfp4_file(path, model, "comfy_quant")
    loaded = kc.load_transformer(path, dtype=torch.float32)
    exact = _file_values(model, layers)
    name = "double_blocks.0.img_attn.qkv"
    mod = loaded.get_submodule(name)
    g = torch.Generator().manual_seed(0)
    norms = exact.get_submodule(name).weight.detach().norm(dim=0, keepdim=True)
    lora = kc.load_lora({f"diffusion_model.{name}.lora_A.weight": torch.randn(4, mod.in_features, generator=g) * 0.1,
                         f"diffusion_model.{name}.lora_B.weight": torch.randn(mod.out_features, 4, generator=g) * 0.1,
                         f"diffusion_model.{name}.dora_scale": norms * (0.5 + torch.rand(norms.shape, generator=g))})
    patched = kc.with_loras(loaded, lora)
    kc.apply_loras(exact, lora)
    diff = parity("DoRA on NVFP4 layers (branch) vs merged into the file's float values",
                  (_run(exact) - _run(patched)).abs().max().item())
    assert diff < 1e-5 and (_run(patched) - _run(loaded)).abs().max().item() > 1e-2


def test_dequantize_option_and_bad_scales(tmp_path):
    model = tiny_transformer().float()
    path = tmp_path / "m.safetensors"
    _nvfp4_file(path, model, "metadata", input_scale=False)
    plain = kc.load_transformer(path, dtype=torch.float32, quantize="dequantize")
    assert not nvfp4.nvfp4_layers(plain)
    assert (_run(plain) - _run(kc.load_transformer(path, dtype=torch.float32))).abs().max() < 1e-5
    from safetensors.torch import load_file

    sd = load_file(str(path))
    key = next(k for k in sd if k.endswith(".weight_scale"))
    rows, cols = sd[key.replace("_scale", "")].shape
    sd[key] = torch.zeros(rows, cols * 2 // 16, dtype=torch.float8_e4m3fn)[:, : max(1, cols * 2 // 16 - 1)].contiguous()
    save_file(sd, str(tmp_path / "bad.safetensors"))
    with pytest.raises(kc.WeightFormatError, match="block scales"):
        kc.load_transformer(tmp_path / "bad.safetensors")


def test_resident_bytes_of_a_9b_nvfp4_transformer(tmp_path, parity):
    """BFL's 9B layout with its 112 fp8 block Linears as NVFP4 instead: the file's header alone
    (sparse file, zero data), loaded on the meta device as a real load would place it."""
    fp8 = manifests()["bfl_flux-2-klein-9b-fp8"]
    tensors, layers = {}, []
    for name, (shape, dtype) in fp8["tensors"].items():
        if name.endswith((".weight_scale", ".input_scale")):
            continue
        if dtype == "F8_E4M3":
            layer = name[: -len(".weight")]
            layers.append(layer)
            out_f, in_f = shape
            tensors[name] = [[out_f, in_f // 2], "U8"]
            tensors[layer + ".weight_scale"] = [list(nvfp4.scale_shape(out_f, in_f)), "F8_E4M3"]
            tensors[layer + ".weight_scale_2"] = [[], "F32"]
            tensors[layer + ".input_scale"] = [[], "F32"]
        else:
            tensors[name] = [shape, dtype]
    meta = {"_quantization_metadata": json.dumps({"format_version": "1.0",
                                                  "layers": {la: {"format": "nvfp4"} for la in layers}})}
    path = tmp_path / "flux-2-klein-9b-nvfp4.safetensors"
    write_safetensors(path, tensors, meta)
    model = meta_model(path, "transformer", dtype=torch.bfloat16)
    assert len(nvfp4.nvfp4_layers(model)) == len(layers) == 112
    size = module_bytes(model)
    parity("Klein 9B NVFP4 transformer resident (GiB, meta path; not a diff)", size / 2**30)
    assert 4.5 * 2**30 < size < 6 * 2**30


def test_model_to_dtype_never_rounds_the_scales(tmp_path):
    model = tiny_transformer().float()
    path = tmp_path / "m.safetensors"
    _nvfp4_file(path, model, "metadata")
    loaded = kc.load_transformer(path, dtype=torch.float32)
    before = _run(loaded)
    loaded.to(torch.bfloat16).to(torch.float32)  # a round trip through bf16 would round float scales
    assert torch.equal(_run(loaded), before)


# ---- native fp4 matmul (Blackwell through comfy-kitchen) --------------------------------------------------------
# No Blackwell GPU here: comfy-kitchen's cuBLAS kernel cannot run, so these tests give our code the real
# comfy-kitchen activation quantiser (its eager backend) and a stand-in for ``scaled_mm_nvfp4`` that computes
# what the kernel is documented to compute, ``dequant(a) @ dequant(b).T + bias``. They check what is ours:
# which tensors go where, padding, shapes, scales, the gate and the fallback.


class _EmulatedKitchen:
    """comfy-kitchen with its fp4 GEMM emulated in float32 (the CPU eager backend refuses swizzled scales)."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.calls: list[tuple[list[int], list[int]]] = []
        self.fail = fail

    @staticmethod
    def quantize_nvfp4(x, per_tensor_scale, pad_16x=False):
        return ck.quantize_nvfp4(x, per_tensor_scale, pad_16x=pad_16x)

    def scaled_mm_nvfp4(self, a, b, tensor_scale_a, tensor_scale_b, block_scale_a, block_scale_b, bias=None,
                        out_dtype=None):
        if self.fail is not None:
            raise self.fail
        # the CUDA backend's own shape rules (comfy_kitchen/backends/cuda scaled_mm_nvfp4)
        m, n, k = a.shape[0], b.shape[0], a.shape[1] * 2
        assert a.dtype == b.dtype == torch.uint8 and a.shape[1] == b.shape[1] and n % 8 == 0 and k % 32 == 0
        assert tuple(block_scale_a.shape) == (-(-m // 128) * 128, -(-(k // 16) // 4) * 4)
        assert tuple(block_scale_b.shape) == (-(-n // 128) * 128, -(-(k // 16) // 4) * 4)
        assert block_scale_a.dtype == block_scale_b.dtype == torch.float8_e4m3fn
        assert tensor_scale_a.dtype == tensor_scale_b.dtype == torch.float32
        self.calls.append((list(a.shape), list(b.shape)))
        y = ck.dequantize_nvfp4(a, tensor_scale_a, block_scale_a, torch.float32) @ \
            ck.dequantize_nvfp4(b, tensor_scale_b, block_scale_b, torch.float32).T
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype)


def _nvfp4_linear(in_f=256, out_f=96, bias=True, input_scale=None) -> tuple[nvfp4.NVFP4Linear, torch.Tensor]:
    torch.manual_seed(3)
    w = torch.randn(out_f, in_f) * 0.05
    q, bs, pts = _ck_quantize(w)
    layer = nvfp4.NVFP4Linear(in_f, out_f, bias=bias, input_scale=input_scale is not None)
    layer.qweight.copy_(q)
    layer.block_scale.copy_(bs.view(torch.uint8))
    layer.tensor_scale.copy_(pts.view(torch.int32))
    if input_scale is not None:
        layer.input_scale.copy_(torch.tensor(input_scale, dtype=torch.float32).view(torch.int32))
    if bias:
        layer.bias.data.copy_(torch.randn(out_f) * 0.1)
    return layer, w


@pytest.fixture
def native_here(monkeypatch):
    """Let the native path run on this CPU, through the emulated kitchen it returns."""
    kitchen = _EmulatedKitchen()
    monkeypatch.setattr(nvfp4, "native_unavailable", lambda device: None)
    monkeypatch.setattr(nvfp4, "_kitchen", lambda: kitchen)
    return kitchen


@pytest.mark.parametrize("input_scale", [None, 0.004])
def test_native_linear_quantises_the_input_and_multiplies_in_fp4(native_here, input_scale, parity):
    layer, _ = _nvfp4_linear(input_scale=input_scale)
    x = (torch.randn(2, 37, 256) * 2).to(torch.bfloat16)  # 74 rows: padded to 80 by comfy-kitchen, cut back
    y = layer(x)
    assert native_here.calls == [([80, 128], [96, 128])]
    assert y.shape == (2, 37, 96) and y.dtype == torch.bfloat16
    # by hand: the same input quantisation, then float maths
    x2 = x.reshape(-1, 256)
    sx = torch.tensor(input_scale) if input_scale is not None else x2.abs().amax().float() / (448 * 6)
    qx, bx = ck.quantize_nvfp4(x2, sx.float(), pad_16x=True)
    xq = ck.dequantize_nvfp4(qx, sx.float(), bx, torch.float32)[:74]
    ref = xq @ layer.dequantized(torch.float32).T + layer.bias.bfloat16().float()  # the bias as the layer adds it
    diff = (y.float().reshape(-1, 96) - ref).abs().max().item()
    parity(f"NVFP4 native path (emulated GEMM, input_scale={input_scale}) vs by-hand fp4 maths, bf16 out", diff)
    # one bf16 rounding of each output: at most half an ulp, and a bf16 ulp is at most |v| * 2^-7
    assert ((y.float().reshape(-1, 96) - ref).abs() <= ref.abs() * 2**-8 + 1e-5).all()
    plain = x.float().reshape(-1, 256) @ layer.dequantized(torch.float32).T + layer.bias.float()
    rel = ((y.float().reshape(-1, 96) - plain).norm() / plain.norm()).item()
    parity(f"NVFP4 native path vs dequantised weight with bf16-exact input (relative L2; input_scale={input_scale})", rel)
    assert 0 < rel < 0.2  # fp4 activations: 0.096 measured


def test_native_path_on_a_whole_tiny_transformer(tmp_path, native_here, parity):
    model = tiny_transformer().float()
    path = tmp_path / "flux-2-klein-4b-nvfp4.safetensors"
    _nvfp4_file(path, model, "metadata", input_scale=False)
    loaded = kc.load_transformer(path, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    img, txt = torch.randn(2, 12, 128, generator=g), torch.randn(2, 5, 96, generator=g)
    kw = {"img_ids": position_ids(3, 4), "txt": txt.bfloat16(), "txt_ids": text_position_ids(5),
          "timesteps": torch.tensor([0.9, 0.4])}
    with torch.no_grad():
        native = loaded(img=img.bfloat16(), **kw).float()
        calls = len(native_here.calls)
        assert nvfp4.set_native_matmul(loaded, False) == len(nvfp4.nvfp4_layers(loaded))
        dequant = loaded(img=img.bfloat16(), **kw).float()
    assert calls > 0 and len(native_here.calls) == calls  # switched off: no further fp4 GEMMs
    rel = ((native - dequant).norm() / dequant.norm()).item()
    parity("NVFP4 tiny transformer: fp4 activations (emulated GEMM) vs dequantised weights (relative L2)", rel)
    assert 0 < rel < 1e-2  # 4.3e-3 measured
    assert torch.isfinite(native).all()


def test_native_failure_falls_back_to_dequantising_once(monkeypatch, caplog):
    monkeypatch.setattr(nvfp4, "_FAILURES", set())
    kitchen = _EmulatedKitchen(fail=RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED"))
    monkeypatch.setattr(nvfp4, "native_unavailable", lambda device: None)
    monkeypatch.setattr(nvfp4, "_kitchen", lambda: kitchen)
    layer, _ = _nvfp4_linear()
    x = torch.randn(4, 256).to(torch.bfloat16)
    other, _ = _nvfp4_linear()
    with caplog.at_level("WARNING", logger="klein_core.quant.nvfp4"):
        y1, y2 = layer(x), layer(x)
        other(x)  # the same failure in another layer is not warned again
    expected = torch.nn.functional.linear(x, layer.dequantized(torch.bfloat16), layer.bias.bfloat16())
    assert torch.equal(y1, expected) and torch.equal(y2, expected)
    assert not layer.native_matmul and not other.native_matmul
    assert sum("CUBLAS_STATUS_NOT_SUPPORTED" in r.message for r in caplog.records) == 1
    monkeypatch.setattr(nvfp4, "_kitchen", lambda: _EmulatedKitchen(fail=torch.cuda.OutOfMemoryError("out of memory")))
    layer2, _ = _nvfp4_linear()
    with pytest.raises(torch.cuda.OutOfMemoryError):
        layer2(x)  # running out of memory is the caller's to handle, never hidden by a fallback
    assert layer2.native_matmul  # not switched off: the next step may fit


def test_native_gate(monkeypatch):
    monkeypatch.setattr(nvfp4, "_NATIVE", {})
    assert "cpu" in nvfp4.native_unavailable(torch.device("cpu"))
    assert nvfp4.NVFP4Linear(256, 96).native_matmul
    assert not nvfp4.NVFP4Linear(48, 96).native_matmul  # cuBLAS needs K % 32
    assert not nvfp4.NVFP4Linear(256, 100).native_matmul  # and N % 8
    monkeypatch.setenv("KLEIN_NVFP4_MATMUL", "dequantize")
    assert not nvfp4.NVFP4Linear(256, 96).native_matmul
    cuda = torch.device("cuda", 1)
    backends = {"cuda": {"available": True, "capabilities": ["scaled_mm_nvfp4"]}}
    monkeypatch.setattr(ck, "list_backends", lambda: backends)
    for capability, expect in [((9, 0), "compute capability 9.0"), ((8, 9), "8.9"), ((10, 0), None), ((12, 0), None)]:
        seen = []
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=capability, s=seen: s.append(d) or c)
        reason = nvfp4._native_reason(cuda)
        assert seen == [cuda]  # asks the layer's own GPU, not the current one
        assert reason is None if expect is None else expect in reason
    backends["cuda"] = {"available": False, "capabilities": [], "unavailable_reason": "CUDA not available"}
    assert "CUDA not available" in nvfp4._native_reason(cuda)
    # asked once per device, then remembered
    asked = []
    monkeypatch.setattr(nvfp4, "_native_reason", lambda d: asked.append(d) or "no")
    nvfp4.native_unavailable(cuda), nvfp4.native_unavailable(cuda)
    assert asked == [cuda]


def test_dequantising_path_is_untouched_on_the_cpu(monkeypatch):
    monkeypatch.setattr(nvfp4, "_NATIVE", {})
    monkeypatch.setattr(nvfp4, "_kitchen", lambda: pytest.fail("the CPU must never call the fp4 GEMM"))
    layer, _ = _nvfp4_linear()
    x = torch.randn(3, 256).to(torch.bfloat16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.dequantized(torch.bfloat16), layer.bias.bfloat16()))
