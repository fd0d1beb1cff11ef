"""fp8 on the device: fp8 files and ``quantize="fp8"`` load onto it with the same bytes, FP8Linear's
``torch._scaled_mm`` path (fp8 tensor cores, compute capability 8.9+) against its upcast path, and a
whole generation with fp8 transformer and text encoder.

Tolerances. fp8 e4m3 keeps 3 mantissa bits: each weight is off by up to 2^-4 of itself (about 3.6%
RMS relative for uniformly spread values), and the errors of a dot product average out, so one layer
is within a few percent (tests/test_quant.py: < 5%). Measured on the CPU with the small model (its
modulation scaled up so the blocks dominate): fp8 file vs unquantised 2.7% (fp32) / 2.8% (bf16)
relative L2 for one forward, scaled-mm vs upcast 2.1% / 2.2% (that path also rounds the activations
to e4m3 with one dynamic scale per tensor), a whole fp8 generation vs unquantised 1.4% / 1.7%. The
bounds are about three times those: 8% for one forward, 5% for the latents of a generation (the
CUDA model is larger, hidden 256 with 5 blocks, so it gets the margin). Full size: 15%.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import klein_core as kc
from klein_core.files.fp8 import quantize_state_dict
from klein_core.memory.placement import module_bytes
from klein_core.quant.fp8 import FP8Linear, block_linear_names, fp8_layers, scaled_mm_available

from .helpers import forward, load_small, rel_l2, tag, transformer_inputs

F8 = torch.float8_e4m3fn


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == F8 else t


def _small_state(gpu):
    """The small transformer's bf16 state with its modulation weights x30: random init leaves the gates
    small and the blocks (the fp8 part) barely move the output; larger gates make the measured error
    theirs (as tests/test_quant.py does)."""
    tr = load_small(gpu, device="cpu", dtype=torch.bfloat16)[0]
    sd = {k: (v * 30 if "modulation" in k else v).contiguous() for k, v in tr.state_dict().items()}
    return sd, block_linear_names(tr)


@pytest.fixture(scope="module")
def fp8_pair(gpu, tmp_path_factory):
    """(bf16 model, model from an fp8 file, model quantised on load), all on the device."""
    sd, layers = _small_state(gpu)
    path = tmp_path_factory.mktemp("fp8") / "flux-2-klein-4b-fp8.safetensors"
    save_file(quantize_state_dict(sd, layers, style="comfy_quant"), str(path))
    ref = kc.load_transformer(sd, device=gpu.device, dtype=gpu.dtype)
    from_file = kc.load_transformer(path, device=gpu.device, dtype=gpu.dtype)
    on_load = kc.load_transformer(sd, device=gpu.device, dtype=gpu.dtype, quantize="fp8")
    return ref, from_file, on_load, layers


def test_fp8_file_and_quantize_on_load_on_the_device(gpu, fp8_pair, parity):
    ref, from_file, on_load, layers = fp8_pair
    assert sorted(fp8_layers(from_file)) == sorted(layers) == sorted(fp8_layers(on_load))
    a, b = from_file.state_dict(), on_load.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].device.type == gpu.device.type, k
        # bit for bit: the file's scales were computed on the CPU, these on the device, both by true
        # division (CUDA's ``t / 448.0`` is ``t * (1 / 448)``: tests/test_cuda_paths.py)
        assert a[k].dtype == b[k].dtype and torch.equal(_bytes(a[k]), _bytes(b[k])), k
    inputs = transformer_inputs(ref, gpu, 8, 8, ref=(4, 4), batch=2)
    out = forward(from_file, inputs)
    assert torch.equal(out, forward(on_load, inputs))
    rel = parity(tag(gpu, "fp8 file vs unquantised, one forward, relative L2"), rel_l2(out, forward(ref, inputs)))
    assert 0 < rel < 0.08, rel


def _set_matmul(model, how: str | None) -> None:
    for m in model.modules():
        if isinstance(m, FP8Linear):
            if how is None:
                m.__dict__.pop("matmul", None)  # back to the class default ("auto")
            else:
                m.matmul = how


@pytest.fixture
def scaled_mm_calls(monkeypatch) -> list:
    """A list that grows by one at every call of torch._scaled_mm (which still runs)."""
    calls: list = []
    real = torch._scaled_mm

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    return calls


def test_scaled_mm_path_against_upcast(gpu, fp8_pair, scaled_mm_calls, parity):
    """On CUDA (8.9+) the default path must really call torch._scaled_mm. In the CPU mode the
    scaled-mm path is forced (torch._scaled_mm runs on the CPU too) to check the same comparison."""
    _, model, _, _ = fp8_pair
    calls = scaled_mm_calls
    inputs = transformer_inputs(model, gpu, 16, 16, txt_len=64, ref=(8, 8))
    try:
        if gpu.cpu or not scaled_mm_available(gpu.device):
            if not gpu.cpu:
                pytest.skip(f"{torch.cuda.get_device_name(gpu.device)} has no fp8 tensor cores (needs 8.9+)")
            _set_matmul(model, "scaled_mm")
        else:
            assert gpu.dtype in (torch.bfloat16, torch.float16)
        fast = forward(model, inputs)
        assert calls, "the scaled-mm path was not taken"
        n = len(calls)
        _set_matmul(model, "upcast")
        slow = forward(model, inputs)
        assert len(calls) == n, "the upcast path called torch._scaled_mm"
    finally:
        _set_matmul(model, None)
    assert fast.dtype == slow.dtype == gpu.dtype and torch.isfinite(fast).all()
    rel = parity(tag(gpu, "fp8 scaled_mm vs upcast, one forward, relative L2"), rel_l2(fast, slow))
    assert 0 < rel < 0.08, rel


def test_generate_with_fp8_transformer_and_text_encoder(gpu, tmp_path, parity):
    _, te, vae = load_small(gpu, device="cpu", dtype=torch.bfloat16)
    tr_path, te_path = tmp_path / "flux-2-klein-4b.safetensors", tmp_path / "qwen_3_4b.safetensors"
    save_file(_small_state(gpu)[0], str(tr_path))
    save_file({"model." + k: v.contiguous() for k, v in te.state_dict().items()}, str(te_path))
    q_tr = kc.load_transformer(tr_path, device=gpu.device, dtype=gpu.dtype, quantize="fp8")
    q_te = kc.load_text_encoder(te_path, device=gpu.device, dtype=gpu.dtype, quantize="fp8")
    assert fp8_layers(q_tr) and fp8_layers(q_te)
    plain = [kc.load_transformer(tr_path, device=gpu.device, dtype=gpu.dtype),
             kc.load_text_encoder(te_path, device=gpu.device, dtype=gpu.dtype)]
    vae = vae.to(gpu.device, gpu.dtype)
    kw = {"prompt": "a lighthouse", "width": gpu.size, "height": gpu.size, "steps": 4, "seed": 2, "cache": None}
    got = kc.generate(q_tr, q_te, vae, **kw)
    want = kc.generate(*plain, vae, **kw)
    assert torch.isfinite(got.latents).all()
    rel = parity(tag(gpu, "fp8 transformer + text encoder: latents vs unquantised, relative L2"),
                 rel_l2(got.latents, want.latents))
    assert 0 < rel < 0.05, rel


@pytest.mark.cuda("CUDA graphs exist only on a CUDA device; tests/test_text_graph.py checks on the CPU that "
                  "these encoders are eligible for replay")
@pytest.mark.parametrize("quantize", ["fp8", "q8"])
def test_quantised_text_encoder_graph_replay(gpu, tmp_path, parity, caplog, quantize):
    """``speed="fast"`` replays the text encoder's forward as a CUDA graph: also with fp8 layers
    (``torch._scaled_mm`` or upcast) and with GGML blocks (``quantize="q8"``, the layers a GGUF file
    gives), recorded once and replayed with the eager forward's features, without a warning (a
    capture that fails would run eagerly from then on, with one)."""
    import logging

    from klein_core.accel.speed import apply_speed
    from klein_core.accel.text_encoder import disable_fast_text_encoder
    from klein_core.accel.text_graph import graphed_forward
    from klein_core.pipeline.tokenizer import tokenize_prompts
    from klein_core.quant.ggml import ggml_layers

    te = load_small(gpu, device="cpu", dtype=torch.bfloat16)[1]
    path = tmp_path / "qwen_3_4b.safetensors"
    save_file({"model." + k: v.contiguous() for k, v in te.state_dict().items()}, str(path))
    q = kc.load_text_encoder(path, device=gpu.device, dtype=gpu.dtype, quantize=quantize)
    assert (fp8_layers if quantize == "fp8" else ggml_layers)(q)
    ids, mask = tokenize_prompts(["a red fox in the snow"], max_length=512)
    other_ids, other_mask = tokenize_prompts(["an old boat"], max_length=512)
    eager, eager_other = q.encode(ids, mask), q.encode(other_ids, other_mask)
    try:
        with caplog.at_level(logging.INFO, logger="klein_core.accel.text_graph"):
            apply_speed(None, None, "fast", q)
            forward = graphed_forward(q)
            assert forward is not None
            first, other, again = q.encode(ids, mask), q.encode(other_ids, other_mask), q.encode(ids, mask)
    finally:
        disable_fast_text_encoder(q)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert (forward.captures, forward.replays, forward.disabled) == (1, 3, None)
    assert torch.equal(first, again) and not torch.equal(first, other)
    for name, out, ref in (("prompt 1", first, eager), ("prompt 2", other, eager_other)):
        rel = parity(tag(gpu, f"{quantize} text encoder: CUDA graph vs eager forward ({name}), relative L2"),
                     rel_l2(out, ref))
        assert rel < 1e-3, (name, rel)


# ---------------------------------------------------------------------------------------------
# Full size


@pytest.mark.full_size(40)
@pytest.mark.cuda("fp8 tensor cores")
def test_full_4b_quantize_fp8_scaled_mm_vs_upcast(gpu, full4b, parity):
    """``quantize="fp8"`` of the full-size 4B transformer on the GPU (from its state dict, one layer at a
    time), one 1024x1024 forward through torch._scaled_mm against the upcast path and the bf16 model,
    and the milliseconds of each."""
    if not scaled_mm_available(gpu.device):
        pytest.skip("no fp8 tensor cores (compute capability < 8.9)")
    tr = full4b[0]
    q = kc.load_transformer(tr.state_dict(), device=gpu.device, dtype=gpu.dtype, quantize="fp8")
    try:
        n_fp8 = len(fp8_layers(q))
        assert n_fp8 == len(block_linear_names(tr)) == 80, n_fp8  # BFL's 4B fp8 file has 80 too
        assert module_bytes(q) < 0.6 * module_bytes(tr)
        inputs = transformer_inputs(tr, gpu, 64, 64, txt_len=512)
        ref = forward(tr, inputs)
        times = {}
        outs = {}
        for how in ("auto", "upcast"):
            _set_matmul(q, None if how == "auto" else how)
            forward(q, inputs)  # warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            outs[how] = forward(q, inputs)
            end.record()
            torch.cuda.synchronize(gpu.device)
            times[how] = start.elapsed_time(end)
        _set_matmul(q, None)
        parity(tag(gpu, "full 4B fp8 forward 1024: scaled_mm ms"), times["auto"])
        parity(tag(gpu, "full 4B fp8 forward 1024: upcast ms"), times["upcast"])
        rel = parity(tag(gpu, "full 4B fp8 scaled_mm vs upcast, relative L2"), rel_l2(outs["auto"], outs["upcast"]))
        assert rel < 0.15, rel
        rel_bf16 = parity(tag(gpu, "full 4B fp8 (upcast) vs bf16, relative L2"), rel_l2(outs["upcast"], ref))
        assert rel_bf16 < 0.15, rel_bf16
    finally:
        del q
        torch.cuda.empty_cache()


def test_lora_training_step_on_the_fp8_model(gpu, fp8_pair, scaled_mm_calls, parity):
    """A LoRA training step on the fp8 model takes the fp8 matmul on 8.9+ GPUs (forced in the CPU
    mode); torch._scaled_mm has no derivative, so its backward goes through the upcast weight: the
    LoRA gradients are finite and close to the upcast path's."""
    from klein_core.train import LoRASet, TrainConfig, Trainer, TrainSample, preset

    _, model, _, _ = fp8_pair
    if not gpu.cpu and not scaled_mm_available(gpu.device):
        pytest.skip(f"{torch.cuda.get_device_name(gpu.device)} has no fp8 tensor cores (needs 8.9+)")
    calls = scaled_mm_calls
    g = torch.Generator().manual_seed(0)
    sample = TrainSample(torch.randn(1, 128, 8, 8, generator=g),
                         torch.randn(1, 32, model.config.context_dim, generator=g))
    grads = {}
    try:
        for mode in ("scaled_mm" if gpu.cpu else None, "upcast"):
            _set_matmul(model, mode)
            lora = LoRASet(model, preset("style", rank=4), seed=1)
            up = torch.Generator().manual_seed(2)
            with torch.no_grad():  # B off zero, so A gets gradients too
                for layer in lora.layers.values():
                    layer.up.copy_(torch.randn(layer.up.shape, generator=up).to(layer.up) * 0.1)
            trainer = Trainer(model, lora, [sample], TrainConfig(steps=1, seed=0, gradient_checkpointing=True))
            before = len(calls)
            try:
                trainer.train_step()
            finally:
                trainer.close()
            grads[mode or "auto"] = torch.cat([p.grad.flatten().float() for p in trainer.params])
            if mode != "upcast":
                assert len(calls) > before, "the fp8 matmul was not taken"
    finally:
        _set_matmul(model, None)
    fp8 = grads["scaled_mm" if gpu.cpu else "auto"]
    assert torch.isfinite(fp8).all() and fp8.abs().sum() > 0
    rel = parity(tag(gpu, "LoRA gradients on the fp8 model: fp8 matmul vs upcast, relative L2"),
                 rel_l2(fp8, grads["upcast"]))
    assert rel < 0.1, rel
