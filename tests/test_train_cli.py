"""``run_train`` end to end on tiny model files: a LoRA file that load_lora reads, and the
distilled base refused with exit code 2 before anything loads."""

from __future__ import annotations

import argparse
import re

import torch
from PIL import Image
from train_files import tiny_training_files

from klein_core.lora import load_lora
from klein_core.train.cli import add_train_args, run_train


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_train_args(p)
    return p.parse_args(list(argv))


def test_train_cli_tiny(tmp_path, capsys):
    paths, data = tiny_training_files(tmp_path)
    common = ["--dataset", str(data), "--vae", str(paths["vae"]), "--text-encoder", str(paths["qwen_4b"]),
              "--output", str(tmp_path / "out" / "l.safetensors"), "--steps", "2", "--resolution", "32",
              "--rank", "2", "--device", "cpu"]
    assert run_train(_args(*common, "--transformer", str(paths["klein_4b"]))) == 2
    assert "distilled Klein model" in capsys.readouterr().err
    assert run_train(_args(*common, "--transformer", str(paths["klein_base_4b"]))) == 0
    err = capsys.readouterr().err
    n = err.count("\rencoding dataset [")  # a bar while the dataset is encoded, ended before the steps
    assert n >= 1 and re.search(rf" {n}/{n} +\n\rstep 1/2 ", err), err
    lora = load_lora(tmp_path / "out" / "l.safetensors")
    assert lora.metadata["klein.steps"] == "2" and len(lora.metadata["klein.dataset_hash"]) == 64
    assert set(lora.ranks.values()) == {2} and not lora.skipped


def test_train_cli_memory_blocks_equals_resident(tmp_path):
    """``--memory blocks`` (the blocks stream from CPU memory, sample images included) writes the
    same LoRA and the same sample images as the resident run."""
    from safetensors.torch import load_file

    paths, data = tiny_training_files(tmp_path)
    outs = {}
    for memory in ("resident", "blocks"):
        out = tmp_path / memory / "l.safetensors"
        assert run_train(_args(
            "--dataset", str(data), "--vae", str(paths["vae"]), "--text-encoder", str(paths["qwen_4b"]),
            "--transformer", str(paths["klein_base_4b"]), "--output", str(out), "--steps", "2", "--resolution", "32",
            "--rank", "2", "--device", "cpu", "--preset", "full", "--lr", "1e-2", "--memory", memory,
            "--checkpoint-every", "2", "--sample-prompt", "a square", "--sample-steps", "2",
            "--sample-size", "64", "64", "--cache-dir", str(tmp_path / "cache"))) == 0
        sample = tmp_path / memory / "l-checkpoints" / "checkpoint-2" / "sample-0.png"
        outs[memory] = (load_file(str(out)), torch.from_numpy(__import__("numpy").array(Image.open(sample))))
    (res, img_res), (blk, img_blk) = outs["resident"], outs["blocks"]
    assert res.keys() == blk.keys() and all(torch.equal(res[k], blk[k]) for k in res)
    assert any(res[k].abs().sum() > 0 for k in res if "lora_B" in k)  # trained: B moved off zero
    assert torch.equal(img_res, img_blk)


def test_train_cli_resume_auto_continues_from_the_latest_checkpoint(tmp_path, capsys):
    """``--resume auto``: none yet starts at step 0; after 2 steps (a checkpoint each), 3 steps continue
    from checkpoint-2 and write the LoRA of an uninterrupted 3-step run, bit for bit."""
    from safetensors.torch import load_file

    paths, data = tiny_training_files(tmp_path)

    def run(out, steps, *extra):
        return run_train(_args(
            "--dataset", str(data), "--vae", str(paths["vae"]), "--text-encoder", str(paths["qwen_4b"]),
            "--transformer", str(paths["klein_base_4b"]), "--output", str(out), "--steps", str(steps),
            "--resolution", "32", "--rank", "2", "--device", "cpu", "--lr", "1e-2", "--checkpoint-every", "1",
            "--cache-dir", str(tmp_path / "cache"), *extra))

    resumed = tmp_path / "a" / "l.safetensors"
    assert run(resumed, 2, "--resume", "auto") == 0  # no checkpoint yet: from step 0
    capsys.readouterr()
    assert run(resumed, 3, "--resume", "auto") == 0
    err = capsys.readouterr().err
    assert "step 3/3" in err and "step 1/3" not in err and "step 2/3" not in err  # only step 3 ran
    assert run(tmp_path / "b" / "l.safetensors", 3) == 0
    a, b = load_file(str(resumed)), load_file(str(tmp_path / "b" / "l.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_train_cli_speed_fast_trains_the_same_lora(tmp_path, monkeypatch, capsys):
    """``--speed fast`` (comfy-kitchen's QK-norm + RoPE forward with klein_core's backward, here on the
    CPU through its eager backend) writes the LoRA of the plain run, to float32 rounding; the kernel
    ran under autograd. A speed that does not exist is refused before any model loads."""
    from extras import require
    from safetensors.torch import load_file

    from klein_core.accel import fast

    ck = require("comfy_kitchen")
    monkeypatch.setattr(fast, "KITCHEN_DEVICES", ("cuda", "cpu"))
    launches = []
    real = ck.rms_rope
    monkeypatch.setattr(ck, "rms_rope", lambda q, *a: launches.append(q.requires_grad) or real(q, *a))
    paths, data = tiny_training_files(tmp_path)
    common = ["--dataset", str(data), "--vae", str(paths["vae"]), "--text-encoder", str(paths["qwen_4b"]),
              "--transformer", str(paths["klein_base_4b"]), "--steps", "2", "--resolution", "32", "--rank", "2",
              "--device", "cpu", "--preset", "full", "--lr", "1e-2", "--cache-dir", str(tmp_path / "cache")]
    loras = {}
    with ck.use_backend("eager"):
        for speed in ("plain", "fast"):
            out = tmp_path / speed / "l.safetensors"
            assert run_train(_args(*common, "--output", str(out), "--speed", speed)) == 0
            loras[speed] = load_file(str(out))
    assert True in launches
    plain, fused = loras["plain"], loras["fast"]
    assert plain.keys() == fused.keys() and any(plain[k].abs().sum() > 0 for k in plain if "lora_B" in k)
    for k in plain:  # Adam's steps are lr-sized (1e-2) whatever the gradient: 2e-5 is 0.1 % of one
        torch.testing.assert_close(fused[k], plain[k], rtol=1e-3, atol=2e-5)

    capsys.readouterr()
    toml = tmp_path / "bad.toml"
    toml.write_text('speed = "fastest"\n')
    assert run_train(_args(str(toml), *common, "--output", str(tmp_path / "bad" / "l.safetensors"))) == 2
    err = capsys.readouterr().err
    assert "speed must be one of fast, compile, plain; got 'fastest'" in err, err
    assert not (tmp_path / "bad").exists()


def test_train_cli_speed_compile_with_streamed_blocks(tmp_path, monkeypatch):
    """``--speed compile`` (dynamo traces each block kind; its eager backend here, since inductor takes
    minutes on a small CPU) trains the plain run's LoRA, resident and with the blocks streamed from
    CPU memory (each block's weights swapped in around its compiled forward); sample images run
    through the compiled blocks too."""
    from safetensors.torch import load_file

    from klein_core.accel import speed as speed_mod

    real = speed_mod.enable_fast_paths
    compiled = []

    def eager_backend(model, **kw):
        compiled.append(kw.get("compile"))
        return real(model, **kw, compile_backend="eager")

    monkeypatch.setattr(speed_mod, "enable_fast_paths", eager_backend)
    paths, data = tiny_training_files(tmp_path)
    common = ["--dataset", str(data), "--vae", str(paths["vae"]), "--text-encoder", str(paths["qwen_4b"]),
              "--transformer", str(paths["klein_base_4b"]), "--steps", "2", "--resolution", "32", "--rank", "2",
              "--device", "cpu", "--preset", "full", "--lr", "1e-2", "--cache-dir", str(tmp_path / "cache"),
              "--checkpoint-every", "2", "--sample-prompt", "a square", "--sample-steps", "2",
              "--sample-size", "64", "64"]
    outs = {}
    for name, extra in (("plain", ["--speed", "plain"]), ("compile", ["--speed", "compile"]),
                        ("compile_blocks", ["--speed", "compile", "--memory", "blocks"])):
        out = tmp_path / name / "l.safetensors"
        assert run_train(_args(*common, *extra, "--output", str(out))) == 0
        sample = tmp_path / name / "l-checkpoints" / "checkpoint-2" / "sample-0.png"
        outs[name] = (load_file(str(out)), torch.from_numpy(__import__("numpy").array(Image.open(sample))))
    assert compiled == [True, True]
    plain, img_plain = outs["plain"]
    for name in ("compile", "compile_blocks"):
        lora, img = outs[name]
        assert lora.keys() == plain.keys()
        for k in plain:
            torch.testing.assert_close(lora[k], plain[k], rtol=1e-3, atol=2e-5)
        assert (img.int() - img_plain.int()).abs().max() <= 1, name  # 8-bit pixels


def test_train_cli_streamed_fp8_base_on_a_device_without_float8(tmp_path, monkeypatch):
    """``--memory blocks`` loads the base into CPU memory to stream it: on a device without float8
    (Apple's MPS; the CPU stands in, its answer patched) an fp8 base's layers load dequantised there,
    so no fp8 tensor is ever streamed to it, and the run writes its LoRA."""
    from safetensors.torch import load_file, save_file

    import klein_core.files.loaders as core_loaders
    from klein_core.files.fp8 import quantize_state_dict
    from klein_core.quant.fp8 import block_linear_names, fp8_layers
    from klein_core.train import job as job_mod

    paths, data = tiny_training_files(tmp_path)
    base = load_file(str(paths["klein_base_4b"]))
    layers = block_linear_names(job_mod.load_transformer(paths["klein_base_4b"], device="meta"))
    fp8_base = tmp_path / "flux-2-klein-base-4b-fp8.safetensors"
    save_file(quantize_state_dict(base, layers, style="comfy_quant"), str(fp8_base))
    monkeypatch.setattr(core_loaders, "holds_float8", lambda device: False)
    loaded = []
    real = job_mod.load_transformer

    def spy(*args, **kwargs):
        loaded.append(real(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(job_mod, "load_transformer", spy)
    out = tmp_path / "out" / "l.safetensors"
    assert run_train(_args("--dataset", str(data), "--vae", str(paths["vae"]), "--text-encoder", str(paths["qwen_4b"]),
                           "--transformer", str(fp8_base), "--output", str(out), "--steps", "1", "--resolution", "32",
                           "--rank", "2", "--device", "cpu", "--memory", "blocks")) == 0
    assert out.exists() and len(loaded) == 1 and not fp8_layers(loaded[0])
