"""Interruption and recovery hunt: an interrupt or an exception in the middle of a stage (a model's
first read, a LoRA being applied, a training checkpoint being written) must leave every cache,
model and file as usable as before, so that the next run behaves as in a fresh process
(README "When something goes wrong": "everything stays usable afterwards").

Tiny random models on the CPU; the node tests run inside the real ComfyUI 0.3.75 modules (the
``comfy`` fixture of tests/test_nodes.py).
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from test_nodes import VAE, comfy  # noqa: F401 (comfy: the module's ComfyUI fixture)

import klein_core as kc
from klein_core.files.loaders import meta_model
from klein_core.lora import has_loras
from klein_core.testing import tiny_transformer
from klein_core.testing.tiny import build_tiny_components
from klein_core.train import LoRASet, TrainConfig, Trainer, TrainSample, preset, state_file
from klein_core.train import save as train_save
from klein_core.train.samples import CheckpointSampler
from klein_core.train.trainer import CHECKPOINT_FILE, latest_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: threads only contend

# ----- helpers -----------------------------------------------------------------------------------


def _native_vae(host_nodes):
    """Klein Model Loader's third output, as its last line makes it (``host.native_flux2_vae``: ComfyUI's
    own VAE over the FLUX.2 VAE file, one object per file state, read on first use)."""
    path = host_nodes.host.full_path("vae", VAE)
    return host_nodes.host.native_flux2_vae(path, meta_model(path, "vae").config)


def _decode(host_nodes, vae, samples):
    """Flux2 VAE Decode's IMAGE for ``samples`` through ``vae``."""
    with torch.inference_mode():
        return host_nodes.vae.KleinVAEDecode.execute({"samples": samples}, vae).args[0]


# The modules of the LoRA below, with their weight shapes [out, in] in the tiny 4B transformer.
_LORA_MODULES = {"double_blocks.0.img_attn.proj": (64, 64), "double_blocks.0.txt_attn.proj": (64, 64),
                 "single_blocks.0.linear2": (64, 256)}


def _lora_file(path: Path) -> Path:
    """A rank-2 LoRA in BFL / ComfyUI names (what Klein LoRA Trainer writes) over three modules."""
    g = torch.Generator().manual_seed(3)
    tensors = {}
    for module, (out, inp) in _LORA_MODULES.items():
        tensors[f"diffusion_model.{module}.lora_A.weight"] = torch.randn(2, inp, generator=g)
        tensors[f"diffusion_model.{module}.lora_B.weight"] = torch.randn(out, 2, generator=g)
    save_file(tensors, str(path))
    return path


def _samples(n: int = 2) -> list[TrainSample]:
    g = torch.Generator().manual_seed(0)
    return [TrainSample(torch.randn(1, 128, 2, 2, generator=g), torch.randn(1, 4, 96, generator=g))
            for _ in range(n)]


def _trainer(cfg: TrainConfig, **kw) -> Trainer:
    model = tiny_transformer().float()
    return Trainer(model, LoRASet(model, preset("style", 2)), _samples(), cfg, **kw)


def _half_written_then_interrupted(tensors, filename, metadata=None):
    """safetensors' ``save_file`` interrupted (Ctrl+C, the process's own cancel) after part of the file
    was written."""
    Path(filename).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"__m")
    raise KeyboardInterrupt


# ----- ComfyUI: the loader's native_vae ----------------------------------------------------------


def test_native_vae_works_again_after_its_first_read_failed(comfy, monkeypatch):  # noqa: F811
    """Was a bug: Klein Model Loader's ``native_vae`` output (ComfyUI's own VAE over the FLUX.2 VAE file,
    read on first use: nodes/host.py ``_native_vae_class``) is decoded by Flux2 VAE Decode while the
    file's first read fails once (``comfy.utils.load_torch_file`` raising an I/O error: a network
    drive's hiccup, memory short for a moment). That run fails, as it should. Seen: every later run
    fails too, with the same object served again by the loader (``native_flux2_vae`` keeps it per
    file state) and a false message: "vae is a ComfyUI VAE with 0 latent channels and 0 pixels per
    latent ..., not the FLUX.2 VAE: pick flux2-vae.safetensors in Load VAE", for that very file; only
    touching the file, or freeing ComfyUI's node cache as well, recovers (*Unload models* forgets the
    object, but ComfyUI's cached loader output still holds it). Expected: the next run reads the file again and
    decodes as a fresh process does. README "When something goes wrong": "everything stays usable
    afterwards". Cause: ``__getattr__`` sets ``_klein_pending`` to None before the read, so a failed
    read leaves an object that is neither pending nor initialised."""
    samples = torch.randn(1, 128, 4, 4, generator=torch.Generator().manual_seed(1))
    comfy.host.release_native_vaes()  # a native VAE not read yet (as after a start)
    native = _native_vae(comfy)
    real = comfy.utils.load_torch_file

    def failing_read(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(comfy.utils, "load_torch_file", failing_read)
    with pytest.raises(OSError, match="Input/output error"):
        _decode(comfy, native, samples)
    monkeypatch.setattr(comfy.utils, "load_torch_file", real)
    again = _native_vae(comfy)  # the graph queued again: the loader runs again (or its output is reused)
    try:
        retried = _decode(comfy, again, samples)
    except Exception as exc:  # noqa: BLE001 - the defect: the object stays broken
        pytest.fail(f"the native VAE stays broken after one failed read: {type(exc).__name__}: {exc}")
    comfy.host.release_native_vaes()  # what a fresh process's loader gives
    fresh = _decode(comfy, _native_vae(comfy), samples)
    assert torch.equal(retried, fresh)


# ----- LoRAs merged into a shared model -----------------------------------------------------------


def test_a_merge_interrupted_while_backing_up_a_weight_leaves_the_model_unchanged(tmp_path, monkeypatch):
    """Was a bug: ``apply_loras(model, lora)`` (merge mode: the CLI's ``--lora``, every LoRA row of a Ray
    batch worker or serve replica, which merge into the one model they keep and ``remove()`` after the
    row) is interrupted while it keeps the host backup of the second module's weight (a Ctrl+C during
    that device-to-host copy of a GPU model's weight, or the host allocator failing: merge keeps "host
    memory equal to the touched weights"). Simulated on the CPU by that ``weight.to("cpu")`` raising.
    Seen: the error propagates and the first module is restored, but the second keeps the merged
    weight, and ``has_loras(model)`` says False, so the model is silently changed for every later run
    (and its outputs are cached under the plain file's identity). Expected: nothing half-applied
    (klein_core/lora/apply.py's own comment: "the modules done so far are restored"; README: everything
    stays usable). Cause: ``_apply_plans`` writes ``weight.data = merged`` before the backup
    ``original.to("cpu")`` is recorded in ``handle._backups`` (and ``_merge_fp8`` writes the fp8 codes
    and scale before it returns their backup)."""
    model = tiny_transformer()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora = kc.load_lora(_lora_file(tmp_path / "style.safetensors"))
    modules = dict(model.named_modules())
    target = modules["double_blocks.0.txt_attn.proj"].weight.untyped_storage().data_ptr()
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args[:1] == ("cpu",) and self.untyped_storage().data_ptr() == target:
            raise KeyboardInterrupt  # the backup copy of txt_attn.proj's weight is interrupted
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    with pytest.raises(KeyboardInterrupt):
        kc.apply_loras(model, lora)
    monkeypatch.setattr(torch.Tensor, "to", real_to)
    assert not has_loras(model)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert changed == [], f"left merged after the interrupted apply_loras: {changed}"


def test_pinned_an_interrupted_branch_apply_leaves_no_hook_or_buffer(tmp_path, monkeypatch):
    """Pinned: ``apply_loras(model, lora, mode="branch")`` (the CLI and Ray workers on GGUF / NVFP4
    models) interrupted while it hooks the second module: no forward hook and no LoRA factor buffer
    stays on any module, ``has_loras`` is False, and the model computes exactly as before."""
    model = tiny_transformer()
    lora = kc.load_lora(_lora_file(tmp_path / "style.safetensors"))
    x = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(2))
    proj = dict(model.named_modules())["double_blocks.0.txt_attn.proj"]
    expected = proj(x)
    real = proj.register_forward_hook

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(proj, "register_forward_hook", interrupted)
    with pytest.raises(KeyboardInterrupt):
        kc.apply_loras(model, lora, mode="branch")
    monkeypatch.setattr(proj, "register_forward_hook", real)
    assert not has_loras(model)
    for name, module in model.named_modules():
        assert not module._forward_hooks, name
        assert not any(b.startswith("klein_lora") for b in module._buffers), name
    assert torch.equal(proj(x), expected)


# ----- memory placement: streamed blocks ----------------------------------------------------------


def test_a_block_copy_that_runs_out_of_memory_leaves_no_weight_on_the_device(monkeypatch):
    """Was a bug: ``memory="blocks"`` (the transformer in CPU memory, each block copied to the GPU while it
    runs: the mode for cards too small for the model) runs out of GPU memory while block 0 is copied
    in (its third tensor; the meta device stands in for the GPU, as in tests/test_kv_cache_hunt.py).
    The engine says so (``KleinOutOfMemory``: "...; the memory was released"). Seen: after the run,
    two of block 0's weights (``img_attn.qkv.weight``, ``img_attn.norm.query_norm.scale``) are still
    the device copies: the model is left half on the GPU, holding that memory and no longer all on its
    home device (a non-streamed plan then stages it in and leaves them there again). Expected: every
    weight back home, as after any other failed or cancelled stage (docs/memory.md: "your modules are
    never moved for good"; README: everything stays usable). Cause: klein_core/memory/placement.py
    ``BlockOffloader._load`` sets each tensor's device copy in turn and records the block in
    ``self._loaded`` only after the last one, so ``detach`` (which releases only ``_loaded`` blocks)
    never puts the copied ones back; the copy should restore the block's homes when it fails (or
    record the block first)."""
    model = tiny_transformer()
    before = {n: t.data_ptr() for n, t in model.state_dict().items()}
    third = list(model.double_blocks[0].parameters())[2].untyped_storage().data_ptr()
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        device = args[0] if args else kwargs.get("device")
        if str(device) == "meta" and self.untyped_storage().data_ptr() == third:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    engine = kc.Engine(model, device="meta", memory="blocks", prompt_cache=None, kv_cache=None)
    cond = kc.Conditioning(torch.randn(1, 8, 96), None)
    with pytest.raises(kc.KleinOutOfMemory, match="while denoising"):
        engine.denoise(cond, settings=kc.Settings(64, 64, steps=1))
    monkeypatch.setattr(torch.Tensor, "to", real_to)
    away = [n for n, t in model.state_dict().items() if t.device.type != "cpu"]
    assert away == [], f"left on the device after the failed streamed stage: {away}"
    assert {n: t.data_ptr() for n, t in model.state_dict().items()} == before
    assert not any(b._forward_pre_hooks or b._forward_hooks for b in [*model.double_blocks, *model.single_blocks])


# ----- training: checkpoints and the LoRA file ----------------------------------------------------


def test_pinned_a_checkpoint_interrupted_while_written_leaves_the_previous_one_to_resume(tmp_path, monkeypatch):
    """Pinned: training with ``keep_checkpoints=1`` (what the trainer node uses) is interrupted while
    its second checkpoint is written. The previous checkpoint is neither pruned nor damaged:
    ``latest_checkpoint`` finds checkpoint-1 (the half-written folder is skipped), and a run resumed
    from it ends with the LoRA of an uninterrupted run, bit for bit."""
    cfg = TrainConfig(steps=2, learning_rate=1e-2, checkpoint_every=1, keep_checkpoints=1)
    first = _trainer(cfg, output_dir=tmp_path)
    real = state_file.save_file
    writes = []

    def second_write_interrupted(tensors, filename, metadata=None):
        writes.append(filename)
        if len(writes) == 2:
            _half_written_then_interrupted(tensors, filename, metadata)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(state_file, "save_file", second_write_interrupted)
    with pytest.raises(KeyboardInterrupt):
        first.train()
    first.close()
    monkeypatch.setattr(state_file, "save_file", real)
    assert first.step == 2 and len(writes) == 2
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"
    resumed = _trainer(cfg)
    resumed.resume(latest_checkpoint(tmp_path))
    resumed.train()
    resumed.close()
    plain = _trainer(TrainConfig(steps=2, learning_rate=1e-2))
    plain.train()
    plain.close()
    got, want = resumed.lora.state_dict(), plain.lora.state_dict()
    assert resumed.step == 2 and got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("what", ["checkpoint", "lora", "sample"])
def test_an_interrupted_write_leaves_no_temporary_file(tmp_path, monkeypatch, what):
    """Was a bug: a training checkpoint (``Trainer.save_checkpoint`` -> ``save_state``), the trained LoRA
    (``save_lora``: the trainer node writes it into models/loras) or a checkpoint's sample image
    (``CheckpointSampler``) is interrupted while its file is written (Ctrl+C, or the disk filling up).
    The file it replaces is left intact (the write goes to a temporary name first). Seen: the
    half-written temporary file (``.trainer_state.safetensors.tmp``: as large as the state, the LoRA
    and its optimizer moments; ``.my_lora.safetensors.tmp``; ``.sample-0.png.tmp``) stays beside it
    for good, one more in every interrupted checkpoint folder. Expected: no file left behind, as
    klein_core's other atomic writers do (the training latent cache, klein_core/train/data.py
    ``TensorCache.get``, the disk prompt cache's ``DiskPromptCache.put`` and the Ray batch's
    ``write_atomic`` remove their temporary file in a ``finally``). Cause: klein_core/train/state_file.py
    ``save_state``, klein_core/train/save.py ``save_lora`` and klein_core/train/samples.py
    ``CheckpointSampler.__call__`` write ``tmp`` then rename it, with no cleanup on failure."""
    if what == "checkpoint":
        trainer = _trainer(TrainConfig(steps=1, learning_rate=1e-2), output_dir=tmp_path)
        trainer.save_checkpoint()  # checkpoint-0: the file the interrupted write would replace
        previous = (tmp_path / "checkpoint-0" / CHECKPOINT_FILE).read_bytes()
        monkeypatch.setattr(state_file, "save_file", _half_written_then_interrupted)
        with pytest.raises(KeyboardInterrupt):
            trainer.save_checkpoint(tmp_path / "checkpoint-0")
        trainer.close()
        assert (tmp_path / "checkpoint-0" / CHECKPOINT_FILE).read_bytes() == previous
    elif what == "sample":
        tr, _, vae = build_tiny_components()
        engine = kc.Engine(tr, None, vae, kind="base", prompt_cache=None)
        sampler = CheckpointSampler(engine, ["a red square"], steps=1, guidance=1.0, size=(64, 64),
                                    conditioning=kc.Conditioning(torch.randn(1, 8, 96), None))
        (tmp_path / "checkpoint-2").mkdir()  # as Trainer.sample_images makes it
        (path,) = sampler(tmp_path / "checkpoint-2", 2)
        previous = path.read_bytes()

        def png_interrupted(self, fp, *args, **kwargs):
            Path(fp).write_bytes(b"\x89PNG\r\n\x1a\n")
            raise KeyboardInterrupt

        monkeypatch.setattr(Image.Image, "save", png_interrupted)
        with pytest.raises(KeyboardInterrupt):
            sampler(tmp_path / "checkpoint-2", 2)
        assert path.read_bytes() == previous
    else:
        model = tiny_transformer().float()
        lora = LoRASet(model, preset("style", 2))
        out = tmp_path / "loras" / "my_lora.safetensors"
        monkeypatch.setattr(train_save, "save_file", _half_written_then_interrupted)
        with pytest.raises(KeyboardInterrupt):
            train_save.save_lora(out, lora)
        assert not out.exists()
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()
                  and p.name.endswith(".tmp"))
    assert left == [], f"temporary files left by the interrupted write: {left}"



# ----- the command line -----------------------------------------------------------------------------


def test_pinned_ctrl_c_in_the_cli_says_cancelled_and_writes_no_image(tmp_path, monkeypatch, capsys):
    """Pinned: ``klein-generate --demo`` interrupted by Ctrl+C (``KeyboardInterrupt``) during its second
    denoising step exits with 130 and one line "cancelled" (no traceback), and writes no image (a
    half-made output never lands at ``--out``)."""
    from klein_core import cli
    from klein_core.pipeline import sampling

    real = sampling._velocity
    steps = []

    def velocity(job, latents, i):
        steps.append(i)
        if i == 1:
            raise KeyboardInterrupt
        return real(job, latents, i)

    monkeypatch.setattr(sampling, "_velocity", velocity)
    out = tmp_path / "out" / "fox.png"
    rc = cli.main(["--demo", "--width", "64", "--height", "64", "--steps", "3", "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 130 and steps == [0, 1]
    assert err.strip().endswith("cancelled") and "Traceback" not in err
    assert not out.exists()
