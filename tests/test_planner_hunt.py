"""Hunting the memory planner, placement and tiling for estimates and plans that do not hold.

Each test that fails shows a real defect with real inputs (tiny models, or real-size configs on the
meta device traced by :func:`~klein_core.memory.trace.trace_activation_bytes`, as tests/test_planner.py
calibrates the formulas); the passing ones cover edge cases no other test covers (said in each).
The CPU, or the meta device, stands in for the GPU as in tests/test_offload.py.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

import klein_core as kc
from klein_core import testing as demo
from klein_core.memory import tiling as vt
from klein_core.memory.placement import StagePlacer, module_tensors
from klein_core.memory.planner import (
    DEFAULT_RESERVE_BYTES,
    MemoryRequest,
    ModelSizes,
    choose_plan,
    estimate,
    plan_for,
    text_activation_bytes,
    transformer_activation_bytes,
    vae_encode_activation_bytes,
    weights_home,
)
from klein_core.memory.trace import trace_activation_bytes
from klein_core.models.qwen3 import Qwen3Config, Qwen3TextEncoder
from klein_core.models.transformer import Flux2Transformer, ReferenceKV, TransformerConfig
from klein_core.models.vae import VAEConfig
from klein_core.pipeline.inpaint import InitImage, prepare_inpaint
from klein_core.pipeline.sampling import position_ids, text_position_ids

GB = 1e9
K4 = TransformerConfig(hidden_size=3072, num_heads=24, depth=5, depth_single=20, context_dim=7680,
                       mlp_hidden=9216)
Q4 = Qwen3Config(hidden_size=2560, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 intermediate_size=9728, vocab_size=151936, num_layers_in_file=36)
VAE = VAEConfig()
EDIT = MemoryRequest(1024, 1024, references=((1024, 1024),))

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _sizes(t=K4, q=Q4, v=VAE):
    return ModelSizes.from_configs(t, q, v)


def _meta_transformer(cfg=K4):
    with torch.device("meta"):
        return Flux2Transformer(cfg).to(torch.bfloat16)


def _trace_step(model, n_txt, n_img, batch=1, **kw):
    """Traced peak of one transformer forward on the meta device (RoPE made outside, as the sampler)."""
    cfg = model.config
    ids = position_ids(1, n_img)
    rope = model.rope(text_position_ids(n_txt), ids)
    args = dict(img=torch.empty(batch, n_img, 128, device="meta", dtype=torch.bfloat16), img_ids=ids,
                txt=torch.empty(batch, n_txt, cfg.context_dim, device="meta", dtype=torch.bfloat16),
                txt_ids=text_position_ids(n_txt), timesteps=torch.empty(batch, device="meta"), rope=rope,
                **kw)
    return trace_activation_bytes(lambda: model(**args))


# ---------------------------------------------------------------------------------------------
# Estimates that leave out something the request makes grow


def test_cfg_text_stage_counts_the_negative_prompt_encoded_in_the_same_batch():
    """With CFG, Engine.generate encodes the prompt and the negative prompt in ONE text-encoder batch
    (P + 1 sequences), but Engine.memory_request gives the planner batch = P * batch_size, so the text
    stage's activations are estimated for one sequence where two run (half the real bytes)."""
    tr, te, vae = demo.build_tiny_components()
    engine = kc.Engine(tr, te, vae, kind="base", prompt_cache=None)
    seen, forward = [], te.forward

    def counting(ids, *args, **kw):
        seen.append(tuple(ids.shape))
        return forward(ids, *args, **kw)

    te.forward = counting  # encode() calls self.forward: hooks never see it
    req = kc.GenerationRequest(prompt="a fox", negative_prompt="blurry",
                               settings=kc.Settings(128, 128, steps=1), output="latent")
    mr = engine.memory_request(req)
    assert mr.cfg and mr.encode_text
    engine.generate(req)
    (batch, length), = seen  # one text-encoder call: prompt and negative together
    assert batch == 2
    est = estimate(mr, ModelSizes.from_modules(tr, te, vae)).stages["text"].activations
    ran = text_activation_bytes(length, batch, te.config.hidden_size, te.config.intermediate_size)
    assert est >= ran, (est, ran)


def test_text_stage_counts_float32_activations_and_the_layer_cast_of_comfyui_text():
    """TextOptions(activations=torch.float32) (COMFYUI_TEXT, ComfyUI's way) runs the Qwen3 encoder in
    fp32 with each layer's weights cast to fp32 while it runs; the planner is never told (the
    MemoryRequest keeps activation_bytes=2, no cast), so at Qwen3-4B size the text stage's estimate is
    ~5x under the traced peak (the trace even undercounts the cast weights)."""
    tr, te, vae = demo.build_tiny_components()
    engine = kc.Engine(tr, te, vae, prompt_cache=None, text=kc.COMFYUI_TEXT)
    mr = engine.memory_request(kc.GenerationRequest(prompt="a fox"))
    est = estimate(mr, _sizes()).stages["text"].activations
    with torch.device("meta"):
        q4 = Qwen3TextEncoder(Q4).to(torch.bfloat16)
    ids = torch.zeros(mr.batch, mr.text_length, dtype=torch.long, device="meta")
    traced = trace_activation_bytes(lambda: q4.forward(ids, torch.ones_like(ids), torch.float32,
                                                       left_padded=False))
    assert est >= traced, (est / GB, traced / GB)


def test_timestep_zero_reference_mode_is_estimated_for_its_per_token_modulation():
    """ref_mode="timestep_zero" (ComfyUI's index_timestep_zero, a sampler-node choice) expands the
    modulation vectors per token ([B, tokens, hidden], 9 of them) for the whole forward. The engine asks
    the planner exactly what it asks for "joint" (MemoryRequest has no field for it), so at Klein 4B
    1024^2 + one 1024^2 reference the denoise estimate is 1.79 GB against 2.23 GB traced."""
    tr, te, vae = demo.build_tiny_components()
    ref = Image.new("RGB", (128, 128))
    asked = {mode: kc.Engine(tr, te, vae, prompt_cache=None, ref_mode=mode).memory_request(
        kc.GenerationRequest(prompt="a fox", references=(ref,))) for mode in ("joint", "timestep_zero")}
    assert asked["timestep_zero"] == replace(asked["joint"], per_token_modulation=True)  # told apart
    est = estimate(replace(EDIT, per_token_modulation=True), _sizes()).stages["denoise"].activations
    traced = _trace_step(_meta_transformer(), 512, 2 * 4096, zero_time_tokens=4096)
    assert est >= traced, (est / GB, traced / GB)


def test_kv_mode_estimate_covers_the_reference_pass_with_its_stored_keys_and_values():
    """KV mode at Klein 4B, 1024^2 with four 1024^2 references: reference_kv's traced peak (the
    transient of one block on top of the keys/values stored so far) is 9.18 GB; the estimate,
    max(steps, reference pass) + stored, is 8.37 GB: 0.8 GB short (more than DEFAULT_RESERVE_BYTES)."""
    refs = ((1024, 1024),) * 4
    est = estimate(MemoryRequest(1024, 1024, references=refs, reference_kv=True), _sizes())
    model = _meta_transformer()
    n = 4 * 4096
    tokens = torch.empty(1, n, 128, device="meta", dtype=torch.bfloat16)
    traced = trace_activation_bytes(lambda: model.reference_kv(tokens, position_ids(1, n)))
    assert est.stages["denoise"].activations >= traced, (est.stages["denoise"].activations / GB, traced / GB)


def test_kv_mode_steps_count_the_reference_keys_joined_per_sequence():
    """KV mode steps join the stored reference keys/values to every sequence's keys ([B, H, L + N, D]
    copies in each block); the step formula leaves the references out of the tokens, so with four
    1024^2 references a batch of 4 traces 9.46 GB (step + stored) against an estimate of 8.84 GB."""
    refs = ((1024, 1024),) * 4
    n = 4 * 4096
    est = estimate(MemoryRequest(1024, 1024, references=refs, reference_kv=True, batch=4), _sizes())
    stored = 2 * n * K4.hidden_size * (K4.depth + K4.depth_single) * 2
    model = _meta_transformer()
    h, d = K4.num_heads, K4.hidden_size // K4.num_heads

    def kv():
        return torch.empty(1, h, n, d, device="meta", dtype=torch.bfloat16), torch.empty(
            1, h, n, d, device="meta", dtype=torch.bfloat16)

    stored_kv = ReferenceKV(tuple(kv() for _ in range(K4.depth)),
                            tuple(kv() for _ in range(K4.depth_single)), n)
    traced = _trace_step(model, 512, 4096, batch=4, kv=stored_kv)
    assert est.stages["denoise"].activations >= traced + stored, (
        est.stages["denoise"].activations / GB, (traced + stored) / GB)


def test_an_init_image_that_is_not_a_reference_is_still_encoded_within_the_plan():
    """image_as_reference=False with output="latent": the init image (up to 1 MP) is VAE-encoded by
    encode_pixels, but Engine.memory_request puts it nowhere (not in references, no decode stage), so
    the estimate has no VAE stage at all and the plan never tiles or counts a 1.35 GB encode."""
    tr, te, vae = demo.build_tiny_components()
    engine = kc.Engine(tr, te, vae, prompt_cache=None)
    init = InitImage(Image.new("RGB", (1024, 1024), "gray"), strength=0.5, as_reference=False)
    req = kc.GenerationRequest(prompt="a fox", init=init, output="latent")
    prepared = prepare_inpaint(init.image, multiple=engine.downscale)
    est = estimate(engine.memory_request(req, init=prepared), _sizes())
    plan = choose_plan(est, int(80 * GB))
    peaks = est.stage_peaks(plan)
    vae_peak = max((p for s, p in peaks.items() if est.stages[s].component == "vae"), default=0)
    encode = vae_encode_activation_bytes(1024, 1024, 1, VAE.block_channels)
    assert vae_peak >= encode, (sorted(est.stages), vae_peak / GB, encode / GB)


def test_denoise_alone_counts_a_negative_prompt_longer_than_the_prompt():
    """Engine.denoise (the ComfyUI sampler's path) plans with text_length = the prompt's length; a
    longer negative (whole prompts, ComfyUI's text) runs as its own pass at its own length, which the
    estimate never sees: here 2 x (512 + 64) token rows estimated, 4096 + 64 run in the negative pass."""
    tr, te, vae = demo.build_tiny_components()
    engine = kc.Engine(tr, te, vae, kind="base", prompt_cache=None)
    ctx = tr.config.context_dim
    cond = kc.Conditioning(torch.randn(1, 512, ctx) * 0.1, torch.randn(1, 4096, ctx) * 0.1)
    asked = []

    def spy(request):
        asked.append(request)
        raise KeyboardInterrupt  # stop before any compute: only the plan's request matters

    engine.plan = spy
    with pytest.raises(KeyboardInterrupt):
        engine.denoise(cond, (), kc.Settings(128, 128, steps=1, guidance=4.0))
    (mr,) = asked
    est = estimate(mr, ModelSizes.from_modules(tr, te, vae)).stages["denoise"].activations
    hidden = tr.config.hidden_size
    neg_pass = transformer_activation_bytes(4096 + 64, 1, hidden, 4096, ctx, 64)
    assert est >= neg_pass, (mr.text_length, est, neg_pass)


def test_float32_components_are_estimated_with_float32_activations():
    """A transformer loaded in fp32 (the Klein Model Loader's weight_dtype "fp32"; the tiny models are
    fp32 too): ModelSizes.from_modules counts its 4-byte weights, but no caller ever sets
    MemoryRequest.activation_bytes, so activations are estimated at 2 bytes: at Klein 4B 1024^2 the
    denoise estimate is 0.96 GB against a traced fp32 step of 1.72 GB."""
    with torch.device("meta"):
        model = Flux2Transformer(K4)  # float32
    tr, te, vae = demo.build_tiny_components()  # float32 too
    mr = kc.Engine(tr, te, vae, prompt_cache=None).memory_request(kc.GenerationRequest(prompt="a fox"))
    mr = replace(mr, width=1024, height=1024)
    est = estimate(mr, ModelSizes.from_modules(model)).stages["denoise"].activations
    traced = _trace_step(model, mr.text_length, mr.image_tokens)
    assert est >= traced, (est / GB, traced / GB)


# ---------------------------------------------------------------------------------------------
# Choices and messages


def test_weights_home_of_a_text_encoder_is_decided_by_its_size():
    """weights_home(component="text_encoder" or "vae") plans its default request (encode_text=False,
    decode=False), in which no stage uses the component: the estimate has no stage, and choose_plan's
    _reason then raises "ValueError: max() arg is an empty sequence" (any free memory). A 7.5 GB text
    encoder on a GPU with 1 GB free should be homed in CPU memory."""
    with torch.device("meta"):
        q4 = Qwen3TextEncoder(Q4).to(torch.bfloat16)
    free = DEFAULT_RESERVE_BYTES + int(0.25 * GB)
    assert weights_home(q4, "cuda", free_bytes=free, component="text_encoder") == torch.device("cpu")


def test_a_component_already_on_the_device_is_planned_as_staying_there():
    """A component whose weights are on the compute device runs in place whatever its placement
    (StagePlacer.in_place), and free memory counts its bytes as usable; yet the plan may "stage" or
    "stream" it and estimate stages without it. Here the transformer sits on the device (meta stands in
    for the GPU; text encoder and VAE in CPU memory, as ComfyUI homes a transformer its plan kept
    resident): the plan picks swap and calls it fitting, while the text stage really holds both."""
    tr, te, vae = demo.build_tiny_components()
    tr = tr.to("meta")
    req = MemoryRequest(256, 256)
    est = estimate(req, ModelSizes.from_modules(tr, te, vae))
    free = choose_plan(est, 1 << 62, mode="swap").peak_bytes + DEFAULT_RESERVE_BYTES  # swap just fits
    plan = plan_for(req, tr, te, vae, device="meta", free_bytes=free)
    placer = StagePlacer("meta", {"transformer": tr, "text_encoder": te, "vae": vae}, dict(plan.placements))
    stuck = {c: "resident" for c in placer.components if placer.in_place(c)}
    assert stuck == {"transformer": "resident"}
    real = est.peak(replace(plan, placements={**plan.placements, **stuck}))
    assert not plan.fits or real <= free - DEFAULT_RESERVE_BYTES, (plan.name, plan.reason, real)
    assert plan.placements["transformer"] == "resident"  # planned where it runs
    assert not plan.fits and "load the transformer into CPU memory" in plan.reason, plan.reason
    roomy = plan_for(req, tr, te, vae, device="meta", free_bytes=real + DEFAULT_RESERVE_BYTES)
    assert roomy.fits and roomy.placements["transformer"] == "resident", roomy.reason
    assert "transformer on the device already" in roomy.name  # the text encoder still swaps in and out


def test_generate_with_given_embeddings_counts_the_negative_prompt_it_encodes():
    """Engine.generate with conditioning that has no negative, on a base model: the negative prompt is
    encoded and denoised at its own length, which the plan must count (ComfyUI's whole prompts)."""
    tr, te, vae = demo.build_tiny_components()
    engine = kc.Engine(tr, te, vae, kind="base", prompt_cache=None, text=kc.COMFYUI_TEXT)
    ctx = tr.config.context_dim
    negative = " ".join(["blurry, out of focus, low quality"] * 120)
    req = kc.GenerationRequest(conditioning=kc.Conditioning(torch.zeros(1, 512, ctx), None),
                               negative_prompt=negative, settings=kc.Settings(128, 128, steps=1))
    mr = engine.memory_request(req)
    assert mr.encode_text and mr.text_batch == 1
    assert mr.text_length == kc.COMFYUI_TEXT.length([negative]) > 512


def test_a_forced_modes_reason_names_what_everything_resident_would_need():
    """choose_plan's reason says "everything resident would need X GB", but X is the first candidate's
    peak: under a forced mode ("minimum", or "blocks" tiled) that is the forced mode's own peak."""
    est = estimate(EDIT, _sizes())
    resident = choose_plan(est, int(80 * GB)).peak_bytes
    plan = choose_plan(est, int(80 * GB), mode="minimum")
    assert plan.fits and "everything resident would need" in plan.reason
    assert f"everything resident would need {resident / GB:.2f} GB" in plan.reason, plan.reason


def test_a_forced_mode_refusal_names_the_mode_that_would_fit():
    """memory="resident" on a card where "auto" finds a fitting plan: the refusal suggests fp8 weights, a
    smaller size or fewer references, never the memory mode, the one change that makes it run as asked."""
    est = estimate(EDIT, _sizes())
    free = int(12 * GB)
    assert choose_plan(est, free).fits
    refused = choose_plan(est, free, mode="resident")
    assert not refused.fits
    assert any(word in refused.reason for word in ("auto", "swap", "blocks", "minimum", "memory mode")), (
        refused.reason)


def test_a_refusal_off_cuda_keeps_saying_it_does_not_fit():
    """plan_for off CUDA with free_bytes given (mode "auto"): the plan is refused, but its reason is
    replaced by "<name>: forced mode on cpu (no memory to measure); estimated peak ..." - the mode was
    not forced, the memory was given, and the "does not fit ... short by ..." of the refusal is lost
    (Engine.plan raises KleinOutOfMemory with exactly that reason)."""
    tr, te, vae = demo.build_tiny_components()
    plan = plan_for(MemoryRequest(256, 256), tr, te, vae, device="cpu", free_bytes=1 << 20)
    assert not plan.fits
    assert "does not fit" in plan.reason and "forced mode" not in plan.reason, plan.reason


# ---------------------------------------------------------------------------------------------
# Placement


class _OutOfMemoryOnCopy(torch.Tensor):
    """A buffer whose copy to another device fails as a full GPU's does (the device's fact)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (simulated)")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("placement", ["staged", "blocks"])
def test_a_stage_that_runs_out_of_memory_while_placing_puts_every_weight_back(placement):
    """The device runs out of memory part-way through placing the transformer (its final layer's
    weights): every weight must be back home. "staged" (on_device, tried inside its try) passes;
    "blocks" leaves the non-block weights copied so far on the device: BlockOffloader.attach runs in
    __enter__, so a failure there never reaches __exit__/detach."""
    tr = demo.tiny_transformer()
    tr.final_layer.register_buffer("probe", torch.zeros(4).as_subclass(_OutOfMemoryOnCopy))
    placer = StagePlacer("meta", {"transformer": tr}, {"transformer": placement})
    with pytest.raises(torch.OutOfMemoryError), placer.stage("transformer"):
        pass
    left = sorted(n for n, t in [*tr.named_parameters(), *tr.named_buffers()] if t.device.type != "cpu")
    assert left == [], left
    assert all(not b._forward_pre_hooks for b in [*tr.double_blocks, *tr.single_blocks])


def test_a_cancelled_streamed_kv_run_leaves_no_block_on_the_device_and_no_hook():
    """Edge case not covered elsewhere: memory="blocks" with KV-mode references (the blocks' wrapped
    ``reference`` method) cancelled by the callback after step 1: every weight is its original tensor
    again, no hook or wrapper stays, and the next run gives the uncancelled result."""
    tr, te, vae = demo.build_tiny_components()
    before = {n: t.data_ptr() for n, t in tr.state_dict().items()}
    engine = kc.Engine(tr, te, vae, memory="blocks", prompt_cache=None, ref_mode="kv", kv_cache=None)
    req = kc.GenerationRequest(prompt="a fox", references=(Image.new("RGB", (64, 64), "red"),),
                               settings=kc.Settings(64, 64, steps=2, seed=1), output="latent")
    with pytest.raises(kc.GenerationCancelled):
        engine.generate(req, callback=lambda step, total, latents: False)
    assert {n: t.data_ptr() for n, t in tr.state_dict().items()} == before
    blocks = [*tr.double_blocks, *tr.single_blocks]
    assert all(not b._forward_pre_hooks and not b._forward_hooks and "reference" not in b.__dict__
               for b in blocks)
    again = engine.generate(req).latents
    plain = kc.Engine(tr, te, vae, prompt_cache=None, ref_mode="kv", kv_cache=None).generate(req).latents
    assert torch.equal(again, plain)


def test_the_vae_is_placed_once_for_references_and_an_init_image():
    """Engine.generate with a reference and an init image encodes both in one placement of the VAE
    (encode_references and encode_pixels each placed it: a VAE staged from CPU memory was copied to
    the GPU twice for one stage), then places it again to decode; every weight is home afterwards."""
    tr, te, vae = demo.build_tiny_components()
    engine = kc.Engine(tr, te, vae, prompt_cache=None, memory="minimum")  # the VAE staged
    placed = []
    real = StagePlacer.stage

    def spy(self, component):
        placed.append(component)
        return real(self, component)

    init = InitImage(Image.new("RGB", (64, 64), "gray"), strength=0.5)
    req = kc.GenerationRequest(prompt="a fox", references=(Image.new("RGB", (64, 64), "red"),), init=init,
                               settings=kc.Settings(steps=1), output="pil")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StagePlacer, "stage", spy)
        engine.generate(req)
    assert placed.count("vae") == 2, placed  # references + init image, then decode
    assert engine._placed == {}
    assert all(t.device.type == "cpu" for t in vae.state_dict().values())


# ---------------------------------------------------------------------------------------------
# Edge cases that hold (not covered by other tests)


@pytest.mark.parametrize("free", [0, -1, DEFAULT_RESERVE_BYTES, DEFAULT_RESERVE_BYTES + 1])
def test_no_free_memory_at_all_is_refused_with_the_smallest_plan(free):
    """Edge case: free memory of 0, negative, or no more than the reserve: nothing fits, the plan is the
    most frugal one (everything streamed, tiles of 16) and the reason says it does not fit."""
    est = estimate(EDIT, _sizes())
    plan = choose_plan(est, free)
    assert not plan.fits and (plan.name, plan.vae_tile) == ("stream all blocks", 16)
    assert "does not fit" in plan.reason and "short by" in plan.reason


def test_bigger_requests_of_the_same_kind_never_get_a_smaller_estimate():
    """Edge case: the estimate (and the chosen plan's peak on one card) only grows with the batch, CFG,
    the number and size of references, the text length and the image size."""
    sizes = _sizes()
    base = MemoryRequest(1024, 1024, references=((512, 512),))
    bigger = [replace(base, batch=2), replace(base, cfg=True), replace(base, references=((512, 512),) * 2),
              replace(base, references=((1024, 1024),)), replace(base, text_length=1024),
              replace(base, width=1536), replace(base, reference_kv=True, references=((1024, 1024),) * 2)]
    small = estimate(base, sizes)
    for req in bigger:
        big = estimate(req, sizes)
        plan = choose_plan(small, int(16 * GB))
        assert big.peak(plan) >= small.peak(plan), req
    kv_small = estimate(replace(base, reference_kv=True), sizes)
    kv_big = estimate(replace(base, reference_kv=True, references=((1024, 1024),) * 2), sizes)
    assert kv_big.stages["denoise"].activations > kv_small.stages["denoise"].activations


class _Nearest:
    """A position-exact decoder/encoder (nearest upsampling / average pooling): any tiling of it must
    give the whole result exactly, so a misplaced tile, a gap or a blend that does not sum to 1 shows."""

    config = SimpleNamespace(downscale=16)

    def decode(self, z):
        return torch.nn.functional.interpolate(z[:, :3], scale_factor=16, mode="nearest")

    def encode(self, px):
        return torch.nn.functional.avg_pool2d(px, 16).repeat(1, 43, 1, 1)[:, :128]


@pytest.mark.parametrize("h,w", [(1, 67), (17, 33), (67, 130), (29, 29), (65, 1)])
def test_tiles_at_odd_latent_sizes_cover_the_image_with_weights_that_sum_to_one(h, w):
    """Edge case: latent sizes that are no multiple of the tile (a 1-row strip, 3-way overlaps at 29
    with tiles of 16, sides just above a tile) decode at every policy tile to the exact whole result and
    size; encoding the matching pixels likewise."""
    fake = _Nearest()
    z = torch.randn(2, 128, h, w, generator=torch.Generator().manual_seed(h * 1000 + w))
    whole = fake.decode(z)
    for tile in vt.TILE_SIDES:
        got = vt.decode(fake, z, tile)
        assert got.shape == whole.shape and torch.allclose(got, whole, atol=1e-5), tile
    px = whole[:1]
    for tile in vt.TILE_SIDES:
        got = vt.encode(fake, px, tile)
        assert torch.allclose(got, fake.encode(px), atol=1e-5), tile


def test_tensors_of_a_staged_component_are_the_callers_again_after_an_exception_in_the_stage():
    """Edge case: an exception raised by the stage's own work (not the placing) under each placement,
    on a device other than the module's home: every tensor is the caller's original again."""
    tr = demo.tiny_transformer()
    before = {n: t.data_ptr() for n, t in tr.state_dict().items()}
    for placement in ("resident", "staged", "blocks"):
        placer = StagePlacer("meta", {"transformer": tr}, {"transformer": placement})
        with pytest.raises(RuntimeError, match="boom"), placer.stage("transformer") as model:
            assert any(t.is_meta for t in module_tensors(model))
            raise RuntimeError("boom")
        assert {n: t.data_ptr() for n, t in tr.state_dict().items()} == before, placement
