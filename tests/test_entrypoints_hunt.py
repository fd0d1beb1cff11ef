"""The same request through every entry point (hunt).

What is probed: one request (prompt, negative prompt, seed, size, steps, guidance, references, LoRA,
text options, model kind) given to the Python API (``kc.generate``), the CLI (``klein_core.cli.main``
in-process), the ComfyUI nodes (Klein Model Loader -> Qwen3 Layer-Concat Encoder -> Klein Reference
Stacker -> Klein Sampler), a batch row (``parse_row`` / ``prepare_rows`` and the worker's
``RowRunner``, no Ray) and a Serve request (``parse_request``): the defaults each fills in, whether
the latents / pixels agree, whether the recorded parameters agree, and whether a flag or field one
entry point takes is honoured, refused or silently dropped by another.

No defect found in: the defaults of steps, guidance, size (from the first reference, else 1024) and
seed (the same in all five); the model kind guessed from the file name (``base`` in the CLI, in
``batch``/``serve``'s ``spec_from_args`` and in the loader node); a base model with CFG, a negative
prompt and a reference through the nodes (bit for bit the Python API's latents); a CLI run on model
files against the same batch row (pixels bit for bit, every PNG ``parameters`` value equal except the
documented ``batch`` / ``step_cache`` / ``id``; the batch writes a row's LoRA as the row names it,
``style:0.5``, the CLI as the file, ``style.safetensors:0.5``); the text options (``--trim-padding``,
``--text-precision``, ``--max-tokens``) and ``--vae-tile`` of ``batch`` against the CLI's (same pixels,
same parameters); the names of speeds, memory modes, reference modes and dtypes each entry point
takes. Image to image and inpainting through Flux2 VAE Encode + Klein Sampler differ from
``kc.generate(image=...)`` by one bf16 step in the latents, because the node encodes a channels-last
view of the IMAGE (about 2e-6 in the VAE latents); no exactness is promised there.

Each ``Was a bug:`` test failed on the code it was written against because of the defect it names (fixed since); each
``Pinned:`` test holds behaviour that already works and is not tested elsewhere. Tiny random models
on the CPU: float32 for the engine-only tests; the nodes compute in bf16 (their encoder always does),
so their latents are compared with the Python API on the same files loaded in bf16, at 64 px.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from test_nodes import M4B, M4B_BASE, Q4B, VAE, _as_loadimage, _random_image, comfy  # noqa: F401 (fixture)

import klein_core as kc
from klein_core import cli as kcli
from klein_core.cli import CLIError
from klein_core.distributed import cli as dcli
from klein_core.distributed.batch import BatchConfig, prepare_rows
from klein_core.distributed.manifest import Manifest, png_bytes
from klein_core.distributed.models import ModelSpec
from klein_core.distributed.rows import check_row, parse_row
from klein_core.distributed.runner import RowRunner
from klein_core.distributed.serve import parse_request
from klein_core.pipeline.prompts import TRIM_MULTIPLE
from klein_core.testing import write_tiny_model_files
from klein_core.testing.tiny import tiny_transformer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRIMMED = "512, padding trimmed (approximate)"  # the encoder node's max_tokens choice
LONG_NEGATIVE = "blurry, " * 40  # about 90 tokens: past one multiple of 64, well under 512


# -- helpers ----------------------------------------------------------------------------------------

def _load(comfy, model=M4B):  # noqa: F811
    with torch.inference_mode():
        return comfy.pack.KleinModelLoader.execute(model, VAE, "bf16", "auto", "auto", "fast").args[:2]


def _encode(comfy, prompt, negative="", max_tokens="512"):  # noqa: F811
    with torch.inference_mode():
        return comfy.pack.KleinTextEncode.execute(Q4B, prompt, negative, "model dtype", max_tokens).args[0]


def _sample(comfy, model, cond, **kw):  # noqa: F811
    kw = {"width": 64, "height": 64, "steps": 2, "guidance": 0.0, "seed": 7, "batch_size": 1, **kw}
    with torch.inference_mode():
        return comfy.pack.KleinSampler.execute(model, cond, **kw).args[0]["samples"]


@pytest.fixture(scope="module")
def api_bf16(comfy):  # noqa: F811
    """The nodes' files loaded with the Python API as the nodes compute on the CPU: transformer and
    encoder in bf16, the VAE in the host's VAE dtype."""
    tr4 = kc.load_transformer(comfy.paths["klein_4b"], dtype=torch.bfloat16)
    base = kc.load_transformer(comfy.paths["klein_base_4b"], dtype=torch.bfloat16)
    te = kc.load_text_encoder(comfy.paths["qwen_4b"], dtype=torch.bfloat16)
    vae = kc.load_vae(comfy.paths["vae"], dtype=comfy.host.vae_dtype(torch.device("cpu")))
    return {"distilled": tr4, "base": base, "te": te, "vae": vae}


def _batch_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    dcli.add_batch_args(p)
    return p


# -- bugs -------------------------------------------------------------------------------------------

def test_a_negative_prompt_a_distilled_model_ignores_does_not_change_its_trimmed_prompt(comfy, api_bf16):  # noqa: F811
    """Was a bug: with the encoder node's max_tokens "512, padding trimmed", the negative prompt changes the image
    of a distilled model, which ignores it. ``Engine._text_groups`` (klein_core/pipeline/engine.py)
    encodes the prompt and the negative prompt in one batch whenever prompts are cut
    (``TextOptions.truncate``), so with ``trim`` both are padded to the *longer* one's length, and
    ``KleinTextEncode.execute`` (nodes/encode.py) always passes the negative prompt (it cannot know the
    model). A 5-token prompt with a 90-token negative prompt gives a positive embedding of 128 rows
    instead of 64, and the Klein Sampler on a distilled model (or a base model at guidance <= 1) samples
    with those 64 extra rows: other latents than ``kc.generate`` / ``klein-generate --trim-padding``
    (which never encode the negative without CFG) and than the same node with the negative prompt left
    empty, though docs/comfyui.md says the negative prompt is "used only by base models with guidance
    > 1". Expected: the prompt's embedding does not depend on the negative prompt (e.g. encode each in
    its own group when ``trim`` is set, as for whole prompts), so the node equals the Python API."""
    tr, te = api_bf16["distilled"], api_bf16["te"]
    model, _ = _load(comfy)
    direct = kc.generate(tr, te, prompt="a fox", negative_prompt=LONG_NEGATIVE, text=kc.TextOptions(trim=TRIM_MULTIPLE),
                         width=64, height=64, steps=1, seed=7, output="latent", cache=None).latents
    alone = _sample(comfy, model, _encode(comfy, "a fox", "", TRIMMED), steps=1)
    assert torch.equal(alone, direct.float())  # the node equals the Python API without a negative prompt
    with_negative = _sample(comfy, model, _encode(comfy, "a fox", LONG_NEGATIVE, TRIMMED), steps=1)
    assert torch.equal(with_negative, direct.float())


@pytest.mark.parametrize("entry", ["serve", "batch"])
def test_a_long_negative_prompt_a_distilled_model_ignores_does_not_refuse_the_row(tmp_path, entry):
    """Was a bug: a batch row or a served request for a distilled model whose ``negative_prompt`` is over 512
    tokens is refused ("negative_prompt is N tokens; the limit is 512"), though a distilled model never
    encodes the negative prompt: ``check_row`` (klein_core/distributed/rows.py) counts the tokens of
    ``prompt`` and ``negative_prompt`` alike, whatever ``kind`` and guidance it was given. The same
    request runs with ``klein-generate`` and ``kc.generate`` without a word (nothing is cut: the
    negative is not used), and docs/ray.md's reason for refusing long rows is that the CLI would cut
    them. A rows file written for a base model (long negative prompts) thus fails every row on a
    distilled model. Expected: the negative prompt's length is checked only where CFG runs (a base
    model with guidance > 1, as ``check_row``'s resolved settings say: ``run.cfg``)."""
    row = {"id": "r1", "prompt": "a fox", "negative_prompt": "blurry " * 600, "width": 64, "height": 64, "steps": 1}
    if entry == "serve":
        job = parse_request(json.dumps(row).encode(), kind="distilled", max_tokens=512, lora_dir=None)
        assert job.row.id == "r1"
    else:
        src = tmp_path / "rows.jsonl"
        src.write_text(json.dumps(row) + "\n", encoding="utf-8")
        out = tmp_path / "out"
        todo, bad, _, _ = prepare_rows(BatchConfig(src, out, ModelSpec(demo=True)), Manifest(out))
        assert ([r.id for r in todo], [e.error for e in bad]) == (["r1"], [])


@pytest.mark.parametrize("flags", [["--quantize", "q8"], ["--models-dir", "MODELS"], ["--transformer", "MODEL"]],
                         ids=["quantize", "models-dir", "transformer"])
def test_batch_and_serve_demo_refuse_model_flags_it_would_not_use(tmp_path, flags):
    """Was a bug: ``python -m klein_core batch|serve --demo --quantize q8`` (or with ``--models-dir`` /
    ``--transformer``) runs the tiny random models and drops the other flags without a word:
    ``spec_from_args`` (klein_core/distributed/cli.py) returns ``ModelSpec(demo=True, **common)`` before
    looking at the model files, and ``open_engine`` (distributed/models.py) never quantises the demo
    models, while every PNG's ``parameters`` still record ``"quantize": "q8"``, a quantisation that did
    not run. ``klein-generate`` refuses the same flags ("--demo runs tiny random models built in memory;
    --quantize would not be used", docs/cli.md: "model files and --quantize are refused with it, since
    they would not be used"), and docs/ray.md gives batch and serve the CLI's model flags. Expected:
    ``spec_from_args`` refuses them with the CLI's message."""
    md = tmp_path / "models"
    paths = write_tiny_model_files(md) if flags[0] != "--quantize" else {}
    value = {"MODELS": str(md), "MODEL": str(paths.get("klein_4b", ""))}.get(flags[1], flags[1])
    cli_out = kcli.main(["--demo", flags[0], value, "--out", str(tmp_path / "cli.png"), "-q"])
    assert cli_out == 2  # the CLI refuses it before anything runs
    args = _batch_parser().parse_args([str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "out"), "--demo",
                                       flags[0], value])
    with pytest.raises(CLIError, match=rf"^--demo runs tiny random models built in memory; {flags[0]} would not be "
                                       "used"):
        dcli.spec_from_args(args)


# -- pinned -----------------------------------------------------------------------------------------

def test_pinned_a_base_cfg_edit_through_the_nodes_is_the_python_apis(comfy, api_bf16):  # noqa: F811
    """Pinned: Klein Model Loader (a file named ``...base...``, model_kind auto) -> Qwen3 Layer-Concat
    Encoder with a negative prompt -> Klein Reference Stacker -> Klein Sampler with width/height/steps/
    guidance left at 0 for the defaults, on an 80x96 reference: the sampler takes the base defaults
    (50 steps and CFG 4 unless given; 2 steps here) and reference 1's size, and its latents equal
    ``kc.generate(kind=None)`` on the same files with the same prompt, negative prompt and reference,
    bit for bit (the kind read from the file name in both)."""
    model, vae = _load(comfy, M4B_BASE)
    picture = _random_image(80, 96, seed=3)
    with torch.inference_mode():
        refs = comfy.pack.KleinReferenceStacker.execute(_as_loadimage(picture), vae).args[0]
    cond = _encode(comfy, "a fox", "blurry")
    latents = _sample(comfy, model, cond, width=0, height=0, steps=2, guidance=0.0, seed=11, references=refs)
    direct = kc.generate(api_bf16["base"], api_bf16["te"], api_bf16["vae"], prompt="a fox", negative_prompt="blurry",
                         references=[picture], steps=2, seed=11, output="latent", cache=None)
    assert (direct.width, direct.height, direct.guidance) == (80, 96, 4.0)
    assert latents.shape == (1, 128, 6, 5)
    assert torch.equal(latents, direct.latents.float())


def test_pinned_a_cli_run_on_model_files_equals_the_same_batch_row(tmp_path):
    """Pinned: ``klein-generate --models-dir D --model flux-2-klein-base-4b.safetensors`` (kind from the
    name, text encoder picked by its shapes) with a negative prompt, a reference, a LoRA at 0.5,
    guidance 3 and ``--dtype fp32``, against the batch row with the same fields run by a worker built
    from ``batch``'s own flags (``spec_from_args``: ``--models-dir``/``--model``/``--dtype``, LoRAs from
    ``D/loras``): the same pixels, and PNG ``parameters`` with equal values for every key the two
    share (the LoRA strength included), the batch's ``id`` and the CLI's ``batch`` / ``step_cache``
    being the only keys of one and not the other."""
    md = tmp_path / "models"
    write_tiny_model_files(md)
    qkv = tiny_transformer().double_blocks[0].img_attn.qkv.weight
    g = torch.Generator().manual_seed(0)
    save_file({"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": torch.randn(2, qkv.shape[1], generator=g),
               "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": torch.randn(qkv.shape[0], 2, generator=g)},
              md / "loras" / "style.safetensors")
    ref = tmp_path / "ref.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (80, 96, 3), dtype=np.uint8)).save(ref)
    files = ["--models-dir", str(md), "--model", "flux-2-klein-base-4b.safetensors", "--dtype", "fp32"]
    out = tmp_path / "cli.png"
    assert kcli.main([*files, "--prompt", "a fox", "--negative-prompt", "blurry", "--ref", str(ref), "--lora",
                      f"{md / 'loras' / 'style.safetensors'}:0.5", "--steps", "2", "--seed", "9", "--guidance", "3",
                      "--out", str(out), "-q"]) == 0
    spec = dcli.spec_from_args(_batch_parser().parse_args([str(tmp_path / "rows.jsonl"), "--out",
                                                           str(tmp_path / "out"), *files]))
    row = parse_row({"id": "x", "prompt": "a fox", "negative_prompt": "blurry", "references": [str(ref)],
                     "loras": ["style:0.5"], "steps": 2, "seed": 9, "guidance": 3}, 1)
    image = Image.open(ref)
    check_row(row, [image], kind=spec.kind, max_tokens=spec.max_tokens, lora_dir=spec.lora_dir)
    ran = RowRunner(spec).run(row, [image])
    served = Image.open(io.BytesIO(png_bytes(ran.result.images[0], ran.params)))
    cli = Image.open(out)
    assert np.array_equal(np.asarray(served), np.asarray(cli))
    bp, cp = json.loads(served.text["parameters"]), json.loads(cli.text["parameters"])
    assert (set(bp) - set(cp), set(cp) - set(bp)) == ({"id"}, {"batch", "step_cache"})
    assert bp["model_kind"] == "base" and bp["negative_prompt"] == "blurry"
    assert [s.rpartition(":")[2] for s in bp["loras"]] == [s.rpartition(":")[2] for s in cp["loras"]] == ["0.5"]
    differ = {k: (bp[k], cp[k]) for k in set(bp) & set(cp) if k not in ("loras", "references") and bp[k] != cp[k]}
    assert differ == {}
    assert Path(bp["references"][0]) == Path(cp["references"][0]) == ref
