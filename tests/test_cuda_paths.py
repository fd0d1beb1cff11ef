"""CUDA-only code paths checked on the CPU: what reaches torch._scaled_mm, streamed blocks called
outside their forward, streamed text-encoder layers computing in fp32, bf16 support asked of the right
GPU (kernel launches on the tensors' device: tests/test_kitchen.py), a bare "cuda" device where torch
wants an index, and quantisation giving the CPU's bytes under CUDA's division. Each test fails on the
code before its fix."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from script_module import load_script
from torch import nn

from klein_core.files.fp8 import quantize_state_dict
from klein_core.memory.placement import BlockOffloader
from klein_core.models.transformer import DoubleStreamBlock, SingleStreamBlock
from klein_core.pipeline.request import as_device, indexed_device
from klein_core.quant import ggml
from klein_core.quant.fp8 import FLOAT8_DTYPES, FP8Linear, quantize_fp8
from klein_core.testing.tiny import tiny_text_encoder, tiny_transformer

REPO = Path(__file__).resolve().parents[1]


# ----- torch._scaled_mm gets what CUDA takes ----------------------------------------------------------


def _cuda_scaled_mm(calls: list):
    """A stand-in for torch._scaled_mm that enforces CUDA's documented requirements (those of
    torch's own meta function for CUDA) and computes the reference result in float32."""

    def fake(a, b, *, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
        assert a.ndim == 2 and b.ndim == 2
        assert a.dtype in FLOAT8_DTYPES and b.dtype in FLOAT8_DTYPES
        assert not (a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2)
        assert a.stride(1) == 1 and a.stride(0) > a.stride(1), f"mat1 must be row-major, got {a.stride()}"
        assert b.stride(0) == 1 and b.stride(1) > 1, f"mat2 must be column-major, got {b.stride()}"
        assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0
        for s in (scale_a, scale_b):  # tensorwise scaling
            assert s.numel() == 1 and s.dtype == torch.float32 and s.device == a.device
        assert out_dtype in (torch.bfloat16, torch.float16, torch.float32)
        assert bias is None or out_dtype != torch.float32
        calls.append((tuple(a.shape), tuple(b.shape)))
        return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)

    return fake


def _fp8_layer(per_row: bool = False, bias: bool = False) -> FP8Linear:
    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=bias)
    layer = FP8Linear.from_linear(lin)
    if per_row:
        layer.weight_scale = layer.weight_scale.expand(32).clone() * torch.linspace(0.5, 1.5, 32)
    layer.matmul = "scaled_mm"
    return layer


@pytest.mark.parametrize("per_row,bias", [(False, False), (True, True)])
def test_scaled_mm_gets_row_major_activations_for_any_input_layout(monkeypatch, per_row, bias):
    layer = _fp8_layer(per_row, bias)
    torch.manual_seed(1)
    inputs = {
        "batched": torch.randn(2, 5, 64).to(torch.bfloat16),
        "transposed view": torch.randn(64, 7).to(torch.bfloat16).t(),  # strides (1, 7): column-major
        "sliced rows": torch.randn(3, 9, 64).to(torch.bfloat16)[:, 2:6],
    }
    expected = {k: layer(x) for k, x in inputs.items()}  # torch's CPU kernel, which takes any layout
    calls: list = []
    monkeypatch.setattr(torch, "_scaled_mm", _cuda_scaled_mm(calls))
    bias_f = layer.bias.float() if bias else None
    for name, x in inputs.items():
        y = layer(x)
        assert y.shape == (*x.shape[:-1], 32) and y.dtype == x.dtype, name
        torch.testing.assert_close(y.float(), expected[name].float(), rtol=2e-2, atol=2e-2, msg=name)
        # and independently of FP8Linear's own maths: the float32 product with the dequantised
        # weight, off only by the activations' fp8 rounding (measured 2.4-2.6% relative L2)
        exact = torch.nn.functional.linear(x.float(), layer.dequantized_weight(torch.float32), bias_f)
        rel = ((y.float() - exact).norm() / exact.norm()).item()
        assert rel < 0.06, (name, rel)
    assert len(calls) == len(inputs)


def test_fp16_all_zero_input_gives_zeros_not_nan():
    # The dynamic activation scale's floor (1e-12) rounds to 0 in fp16: 0 / 0 before the fix.
    layer = _fp8_layer()
    for dtype in (torch.float16, torch.bfloat16):
        y = layer(torch.zeros(4, 64, dtype=dtype))
        assert torch.equal(y, torch.zeros(4, 32, dtype=dtype)), dtype


# ----- block streaming ----------------------------------------------------------------------------------


def test_offloader_streams_the_reference_pass(monkeypatch):
    """KV mode runs ``block.reference`` directly, past the forward hooks: before the fix the blocks
    computed with their CPU home weights (on a GPU: device inputs against CPU weights)."""
    model = tiny_transformer()
    torch.manual_seed(2)
    tokens, ids = torch.randn(1, 16, 128), torch.randint(0, 4, (16, 4))
    expected = model.reference_kv(tokens, ids)
    blocks = [*model.double_blocks, *model.single_blocks]
    homes = {id(b): {n: p.data_ptr() for n, p in b.named_parameters()} for b in blocks}
    used_home = []

    def watch(original):
        def reference(self, *args, **kwargs):
            used_home.append(any(p.data_ptr() == homes[id(self)][n] for n, p in self.named_parameters()))
            return original(self, *args, **kwargs)
        return reference

    for cls in (DoubleStreamBlock, SingleStreamBlock):
        monkeypatch.setattr(cls, "reference", watch(cls.reference))
    with BlockOffloader(model, "cpu") as off:
        got = model.reference_kv(tokens, ids)
        assert off.stats.loads == len(blocks) + off.prefetch
    assert used_home == [False] * len(blocks)
    for (k0, v0), (k1, v1) in zip((*expected.double, *expected.single), (*got.double, *got.single)):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert all("reference" not in b.__dict__ for b in blocks)  # detach unwrapped them
    assert all(p.data_ptr() == homes[id(b)][n] for b in blocks for n, p in b.named_parameters())


def test_streamed_text_encoder_computes_in_fp32():
    """ComfyUI's "fp32 activations" with streamed layers: the cast must see the offloader's device
    weights (before the fix: bf16 weights against fp32 activations, and on CUDA a read before the
    copy was waited for), and afterwards every layer holds its home weights again."""
    encoder = tiny_text_encoder().to(torch.bfloat16)
    ids, mask = torch.randint(0, 1000, (2, 9)), torch.ones(2, 9, dtype=torch.long)
    expected = encoder.encode(ids, mask, activations=torch.float32)
    homes = {n: p.data_ptr() for n, p in encoder.named_parameters()}
    with BlockOffloader(encoder, "cpu") as off:
        got = encoder.encode(ids, mask, activations=torch.float32)
        assert off.stats.loads >= len(encoder.layers)
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)
    assert {n: p.data_ptr() for n, p in encoder.named_parameters()} == homes
    assert all(p.dtype == torch.bfloat16 for p in encoder.parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in encoder.modules())


# ----- the ComfyUI host ---------------------------------------------------------------------------------


def test_bf16_support_is_asked_of_the_given_gpu(monkeypatch):
    host = load_script("klein_nodes_host_for_cuda_tests", REPO / "nodes" / "host.py")
    majors = {0: 8, 1: 7}  # an Ampere card and a Turing card (bf16 only emulated there)

    def properties(device):
        return SimpleNamespace(major=majors[torch.device(device).index])

    def no_current_device():
        raise AssertionError("asked the current device instead of the given one")

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "current_device", no_current_device)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # what torch says on Turing
    monkeypatch.setattr(torch.version, "hip", None)
    assert host.bf16_supported(torch.device("cuda", 0)) is True
    assert host.bf16_supported(torch.device("cuda", 1)) is False
    assert host.bf16_supported(torch.device("cpu")) is True


# ----- running out of memory frees the failed attempt -------------------------------------------------


def test_out_of_memory_frees_the_failed_frames_before_emptying_the_cache(monkeypatch):
    """While an OOM is being handled its traceback keeps the failed frames, and their activations,
    alive: emptying the CUDA cache then frees nothing. The handler must clear those frames first."""
    import gc
    import weakref

    import klein_core as kc
    from klein_core.pipeline import oom

    refs, alive_at_collect = [], []

    def failing_forward():
        activations = torch.empty(1024)
        refs.append(weakref.ref(activations))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: (real_collect(*a), alive_at_collect.append(refs[0]() is not None))[0])
    with pytest.raises(kc.KleinOutOfMemory, match="while denoising; the memory was released") as err:
        with oom.explain_oom("denoising", torch.device("cpu"), 1024, 1024, 1, 0):
            failing_forward()
    assert alive_at_collect == [False]
    # a torch OutOfMemoryError, so hosts treat it as one (ComfyUI unloads its models on those)
    assert isinstance(err.value, torch.OutOfMemoryError) and isinstance(err.value, RuntimeError)
    # a refusal (already a KleinOutOfMemory with its own advice) passes through unchanged
    with pytest.raises(kc.KleinOutOfMemory, match="^refused before running: too big$"):
        with oom.explain_oom("denoising", torch.device("cpu"), 1024, 1024, 1, 0):
            raise kc.KleinOutOfMemory("refused before running: too big")


@pytest.mark.parametrize("device, error, where, offload", [
    ("cuda", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "GPU", True),
    ("cuda", RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                          "memory: you tried to allocate 100000000000000 bytes. Error code 12"), "CPU", False),
    ("cuda", RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes."), "CPU", False),
    ("mps", RuntimeError("MPS backend out of memory (MPS allocated: 9 GB). Tried to allocate 2 GB"), "MPS", True),
    ("cpu", RuntimeError("DefaultCPUAllocator: can't allocate memory"), "CPU", True),
])
def test_out_of_memory_names_the_memory_that_ran_out(device, error, where, offload):
    """Host memory running out while the engine runs on a GPU (a batch prepared on the host) is
    named as CPU memory, and its advice is not to offload more to the CPU (which would take more of
    it); the GPU's own out-of-memory keeps the offloading advice."""
    import klein_core as kc
    from klein_core.pipeline import oom

    with pytest.raises(kc.KleinOutOfMemory) as err, \
            oom.explain_oom("preparing the batch", torch.device(device), 1024, 1024, 2, 0):
        raise error
    msg = str(err.value)
    assert msg.startswith(f"Out of {where} memory while preparing the batch"), msg
    assert "a smaller batch (now 2 images" in msg
    assert ("offload the text encoder or transformer blocks" in msg) == offload, msg
    assert ("more free CPU memory" in msg) == (not offload), msg


# ----- a component already on the GPU is not streamed ---------------------------------------------------


def test_blocks_placement_of_a_component_already_on_the_device_runs_it_in_place(caplog):
    """Streaming makes pinned CPU copies of the blocks their home; for a model already on the GPU
    that would leave it in CPU memory after the stage (moved for good). ``meta`` stands in for the
    GPU here: a device other than the CPU that the weights are already on."""
    from klein_core.memory.placement import StagePlacer

    with torch.device("meta"):
        model = tiny_transformer()
    placer = StagePlacer("meta", {"transformer": model}, {"transformer": "blocks"})
    with caplog.at_level("WARNING"), placer.stage("transformer") as m:
        assert m is model
        assert not model.double_blocks[0]._forward_pre_hooks  # no offloader attached
    assert all(t.device.type == "meta" for t in model.state_dict().values())
    assert "transformer is already on meta, so it runs there as it is" in caplog.text


# ----- a bare "cuda" device -------------------------------------------------------------------------------
# torch.device("cuda") is the current GPU. torch.cuda.set_device and set_per_process_memory_fraction refuse
# it ("Expected a torch.device with a specified index": 41 errors at setup of the GPU suite on torch 2.11,
# and benchmarks/memory.py without --device cuda:0), and caches keyed by device held "cuda" and "cuda:0"
# apart. Public entry points give it the current index once, so every later call sees one device.


def _cuda_machine(monkeypatch, current: int) -> None:
    """CUDA as torch reports it on a machine whose current GPU is ``current`` (nothing reaches a driver)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def test_a_bare_cuda_device_gets_the_current_index(monkeypatch):
    _cuda_machine(monkeypatch, 1)
    for given in ("cuda", torch.device("cuda")):
        assert as_device(given) == torch.device("cuda", 1)
    assert as_device("cuda:0") == as_device(0) == torch.device("cuda", 0)
    assert as_device("cpu") == indexed_device("cpu") == torch.device("cpu")
    assert indexed_device("meta") == torch.device("meta")
    # torch's own set_device, up to the driver call
    selected: list[int] = []
    monkeypatch.setattr(torch._C, "_cuda_setDevice", selected.append, raising=False)
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_device(torch.device("cuda"))
    torch.cuda.set_device(as_device("cuda"))
    assert selected == [1]


def test_gpu_suite_without_a_device_variable_sets_an_indexed_device(monkeypatch):
    """``pytest tests/gpu`` with no KLEIN_GPU_TESTS_DEVICE: the ``gpu`` fixture calls
    ``torch.cuda.set_device(DEVICE)`` with what ``_target`` chose."""
    suite = importlib.import_module("gpu.conftest")  # tests/gpu/conftest.py
    _cuda_machine(monkeypatch, 0)
    monkeypatch.delenv(suite.ENV_DEVICE, raising=False)
    device, why = suite._target()
    assert why is None and device == torch.device("cuda", 0)
    selected: list[int] = []
    monkeypatch.setattr(torch._C, "_cuda_setDevice", selected.append, raising=False)
    torch.cuda.set_device(device)
    assert selected == [0]
    monkeypatch.setenv(suite.ENV_DEVICE, "cuda:x")
    device, why = suite._target()
    assert device is None and "'cuda:x'" in why  # a reason to skip with, not an error at collection


def test_memory_benchmark_caps_the_allocator_of_a_bare_cuda_device(monkeypatch, tmp_path):
    memory = load_script("klein_memory_benchmark_for_cuda_tests", REPO / "benchmarks" / "memory.py")
    _cuda_machine(monkeypatch, 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(name="stand-in GPU", total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda.memory, "_lazy_init", lambda: None)
    capped: list[tuple[float, int]] = []

    class Capped(Exception):
        pass

    def set_fraction(fraction, index):  # torch's own set_per_process_memory_fraction calls this last
        capped.append((fraction, index))
        raise Capped  # stop before any model is built

    monkeypatch.setattr(torch._C, "_cuda_setMemoryFraction", set_fraction, raising=False)
    with pytest.raises(Capped):
        memory.main(["--out", str(tmp_path / "memory.json"), "--tiny", "--device", "cuda"])
    assert capped == [(1.0, 0)]


def test_placement_takes_a_bare_cuda_device_as_the_current_one(monkeypatch):
    from klein_core.memory import placement

    _cuda_machine(monkeypatch, 1)
    assert placement.StagePlacer("cuda", {}, {}).device == torch.device("cuda", 1)
    assert BlockOffloader(tiny_transformer(), "cuda").device == torch.device("cuda", 1)
    # weights on cuda:0 are not on "cuda" while cuda:1 is current (before: any index matched "cuda",
    # and a stage would have run a module on the wrong GPU instead of copying it in)
    assert not placement._same_device(torch.device("cuda", 0), torch.device("cuda"))
    assert placement._same_device(torch.device("cuda", 1), torch.device("cuda"))


def test_device_keyed_caches_hold_cuda_and_its_index_as_one_device(monkeypatch):
    from klein_core.quant import fp8, nvfp4

    current = [0]
    capabilities = {0: (9, 0), 1: (8, 6)}  # a Hopper card and an Ampere one (no fp8 tensor cores)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    # as torch answers: a device without an index is the current one
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda d=None: capabilities[torch.cuda._utils._get_device_index(d, optional=True)])
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(fp8, "_scaled_mm_support", {})
    assert fp8.scaled_mm_available(torch.device("cuda")) and fp8.scaled_mm_available(torch.device("cuda", 0))
    assert list(fp8._scaled_mm_support) == [("cuda", 0)]
    current[0] = 1
    assert not fp8.scaled_mm_available(torch.device("cuda"))  # before: cuda:0's answer, cached under "cuda"
    monkeypatch.setattr(nvfp4, "_NATIVE", {})
    asked = []
    monkeypatch.setattr(nvfp4, "_native_reason", lambda d: asked.append(d) or "asked")
    nvfp4.native_unavailable(torch.device("cuda")), nvfp4.native_unavailable(torch.device("cuda", 1))
    assert asked == [torch.device("cuda", 1)]


# ----- quantising on a GPU gives the CPU's bytes --------------------------------------------------------


def _cuda_division(monkeypatch) -> None:
    """``tensor / number`` as CUDA computes it: ATen's div_true_kernel_cuda turns a divisor that is a host
    scalar into a multiplication by its reciprocal, rounded to float32 first ("this may lose one bit of
    precision"); dividing by a tensor is a true division there as here."""
    real = torch.Tensor.__truediv__

    def divide(self, other):
        if isinstance(other, (int, float)) and not isinstance(other, bool) and self.dtype == torch.float32:
            return self * real(torch.tensor(1.0), torch.tensor(float(other)))
        return real(self, other)

    monkeypatch.setattr(torch.Tensor, "__truediv__", divide)


def test_fp8_file_and_quantise_on_load_on_a_gpu_give_the_same_scale(monkeypatch):
    """tests/gpu/test_gpu_fp8.py on the H100: ``double_blocks.0.img_mlp.2.weight_scale`` of the fp8 file
    (quantised on the CPU) and of ``quantize="fp8"`` (on the GPU) differed by one ulp; that layer's amax is
    0.0361328125, and 0.0361328125 * float32(1 / 448) is 8.0653605e-05, not 8.0653597e-05."""
    torch.manual_seed(0)
    w = (torch.randn(64, 96) * 0.005).to(torch.bfloat16)
    w[3, 5] = 0.0361328125
    exact = torch.tensor(0.0361328125 / 448, dtype=torch.float32)  # the float64 quotient, rounded once
    written = quantize_state_dict({"layer.weight": w}, ["layer"], style="comfy_quant")  # the file, on the CPU
    assert torch.equal(written["layer.weight_scale"], exact)
    _cuda_division(monkeypatch)
    assert not torch.equal(torch.tensor(0.0361328125) / 448.0, exact)  # the stand-in is CUDA's rounding
    q, scale = quantize_fp8(w)  # what load_fp8 runs on the GPU
    assert torch.equal(scale, exact)
    assert torch.equal(q.view(torch.uint8), written["layer.weight"].view(torch.uint8))


def test_ggml_quantisation_on_a_gpu_gives_the_cpus_bytes(monkeypatch):
    """GGML blocks quantised while loading (``quantize="q8"``/``"q4"``) or by the converter must be the
    bytes gguf-py writes (tests/test_gguf.py); Q4_1 differed in 4 of 655360 bytes here before the fix."""
    torch.manual_seed(0)
    w = torch.randn(256, 4096)
    T = ggml.GGMLType
    types = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)
    expected = {t: ggml.quantize(w, t) for t in types}
    _cuda_division(monkeypatch)
    for t in types:
        assert torch.equal(ggml.quantize(w, t), expected[t]), t.name
