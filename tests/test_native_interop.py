"""Native interop (issue #32 items 2-3): ComfyUI's own CONDITIONING and VAE in and out of the pack's
nodes, in the real ComfyUI 0.3.75 host (``--cpu``), with the tiny models of test_nodes.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_nodes import (  # noqa: F401
    M4B,
    M4B_BASE,
    Q4B,
    Q8B,
    VAE,
    _as_loadimage,
    _load,
    _random_image,
    _sample,
    _stack,
    comfy,
)

REPO = Path(__file__).resolve().parents[1]


def _encode_all(comfy, prompt="a red fox", negative="", encoder=Q4B):  # noqa: F811
    with torch.inference_mode():
        return comfy.pack.KleinTextEncode.execute(encoder, prompt, negative).args


def _reference_latent(cond, latent):
    from comfy_extras.nodes_edit_model import ReferenceLatent

    return ReferenceLatent.execute(cond, {"samples": latent}).args[0]


def _native_vae(comfy):  # noqa: F811
    with torch.inference_mode():
        return comfy.pack.KleinModelLoader.execute(M4B, VAE, "bf16", "auto").args[2]


def _images():
    return [_as_loadimage(_random_image(80, 64, seed=1)), _as_loadimage(_random_image(64, 96, seed=2))]


# ----- schemas ----------------------------------------------------------------------------------------


def test_sockets_take_both_types_and_new_outputs_come_last(comfy):  # noqa: F811
    from comfy_execution.validation import validate_node_input

    info = {n.GET_NODE_INFO_V1()["name"]: n.GET_NODE_INFO_V1() for n in comfy.pack.NODES}
    sampler = info["KleinSampler"]["input"]
    assert sampler["required"]["conditioning"][0] == "KLEIN_COND,CONDITIONING"
    assert sampler["optional"]["negative"][0] == "CONDITIONING"
    assert info["KleinSampler"]["input_order"]["optional"][-1] == "negative"
    for node in ("KleinVAEDecode", "KleinVAEEncode", "KleinReferenceStacker"):
        assert info[node]["input"]["required"]["vae"][0] == "KLEIN_VAE,VAE", node
    for received in ("KLEIN_COND", "CONDITIONING"):  # what ComfyUI's graph validation accepts
        assert validate_node_input(received, sampler["required"]["conditioning"][0])
    assert not validate_node_input("MODEL", sampler["required"]["conditioning"][0])
    assert info["KleinTextEncode"]["output"] == ["KLEIN_COND", "CONDITIONING", "CONDITIONING"]
    assert info["KleinTextEncode"]["output_name"] == ["conditioning", "positive", "negative"]
    assert info["KleinModelLoader"]["output"] == ["KLEIN_MODEL", "KLEIN_VAE", "VAE"]


# ----- CONDITIONING both ways ---------------------------------------------------------------------------


def test_encoder_gives_native_conditioning_that_core_nodes_take(comfy):  # noqa: F811
    cond, positive, negative = _encode_all(comfy, "a red fox", "blurry")
    assert len(positive) == 1 and positive[0][0] is cond.positive and negative[0][0] is cond.negative
    assert positive[0][1] == {"pooled_output": None, "klein_encoder": Q4B}
    chained = _reference_latent(positive, torch.ones(1, 128, 4, 5))
    assert [r.shape for r in chained[0][1]["reference_latents"]] == [(1, 128, 4, 5)]
    assert "reference_latents" not in positive[0][1]  # ReferenceLatent copies; our output is not changed


@pytest.mark.parametrize("case", ["distilled", "base_cfg"])
def test_native_conditioning_samples_exactly_as_the_pack_conditioning(comfy, case):  # noqa: F811
    model, _ = _load(comfy, M4B_BASE if case == "base_cfg" else M4B)
    cond, positive, negative = _encode_all(comfy, "a lighthouse", "fog")
    kw = {"guidance": 3.0} if case == "base_cfg" else {}
    ours = _sample(comfy, model, cond, **kw)
    native = _sample(comfy, model, positive, negative=negative if case == "base_cfg" else None, **kw)
    assert (ours - native).abs().max().item() == 0.0
    if case == "base_cfg":  # the negative really takes part: another negative, another image
        zero = [[torch.zeros_like(negative[0][0]), dict(negative[0][1])]]
        assert not torch.equal(_sample(comfy, model, positive, negative=zero, **kw), ours)


def test_a_native_negative_on_a_distilled_model_is_said_to_be_unused_when_written(comfy):  # noqa: F811
    """A distilled model ignores the negative: the sampler says so for a written one (our encoder's
    negative output with text, or another encoder's that is not ConditioningZeroOut's zeros), and
    stays quiet for our encoder's empty negative or a zeroed one."""
    model, _ = _load(comfy)
    _, positive, written = _encode_all(comfy, "a lighthouse", "fog")
    _, _, empty = _encode_all(comfy, "a lighthouse", "")
    foreign = [[written[0][0].clone(), {"pooled_output": None}]]  # CLIPTextEncode's has no marker
    zeroed = [[torch.zeros_like(written[0][0]), dict(written[0][1])]]
    said = {}
    for name, negative in (("written", written), ("empty", empty), ("foreign", foreign), ("zeroed", zeroed)):
        with torch.inference_mode():
            out = comfy.pack.KleinSampler.execute(model, positive, width=64, height=64, steps=1, guidance=0.0,
                                                  seed=1, batch_size=1, negative=negative)
        said[name] = any("negative prompt is not used" in w for w in (out.ui or {}).get("warnings", []))
    assert said == {"written": True, "empty": False, "foreign": True, "zeroed": False}


def test_reference_latent_chain_equals_the_stacker(comfy):  # noqa: F811
    model, vae = _load(comfy)
    cond, positive, _ = _encode_all(comfy, "put image 2 into image 1")
    first, second = _images()
    stack, _ = _stack(comfy, first, vae)
    both, _ = _stack(comfy, second, vae, stack)
    lat1, lat2 = (r.latent for r in both.items)
    ours = _sample(comfy, model, cond, references=both, width=0, height=0)
    chained = _reference_latent(_reference_latent(positive, lat1), lat2)
    native = _sample(comfy, model, chained, width=0, height=0)
    assert ours.shape == (1, 128, lat1.shape[-2], lat1.shape[-1])
    assert (ours - native).abs().max().item() == 0.0
    # stacker references first, then ReferenceLatent's ("index" method: their order is kept)
    mixed = _sample(comfy, model, _reference_latent(positive, lat2), references=stack, width=0, height=0)
    assert torch.equal(mixed, ours)
    swapped = _sample(comfy, model, _reference_latent(_reference_latent(positive, lat2), lat1), width=64, height=64)
    assert not torch.equal(swapped, _sample(comfy, model, chained, width=64, height=64))


def test_bad_conditioning_is_refused_naming_both_nodes(comfy):  # noqa: F811
    model, _ = _load(comfy)
    clip_like = [[torch.randn(1, 77, 50), {"pooled_output": None}]]  # another encoder's width
    with pytest.raises(ValueError) as err:
        _sample(comfy, model, clip_like)
    msg = str(err.value)
    assert msg.startswith("Klein Sampler: the conditioning was encoded with CLIPTextEncode or another core encoder "
                          "(not Qwen3 Layer-Concat Encoder)")
    assert "(text width 50) does not fit" in msg and "which expects 96" in msg
    assert f"set text_encoder in Qwen3 Layer-Concat Encoder to {Q4B} and connect its positive output" in msg
    _, positive_9b, _ = _encode_all(comfy, encoder=Q8B)  # the pack's own native output, wrong size
    with pytest.raises(ValueError, match=rf"Klein Sampler: the conditioning was encoded with {Q8B} \(Qwen3"):
        _sample(comfy, model, positive_9b)
    _, positive, _ = _encode_all(comfy)
    with pytest.raises(ValueError, match=r"Klein Sampler: conditioning must be one CONDITIONING entry .* got 2 "):
        _sample(comfy, model, positive + positive)
    offset = [[positive[0][0], {**positive[0][1], "reference_latents": [torch.zeros(1, 128, 4, 4)],
                                "reference_latents_method": "offset"}]]
    with pytest.raises(ValueError, match=r"reference_latents_method 'offset' \(set by "
                                         r"FluxKontextMultiReferenceLatentMethod\).*index"):
        _sample(comfy, model, offset)
    with pytest.raises(ValueError, match=r"reference latent 1 \(from ReferenceLatent\) must be one FLUX.2 latent "
                                         r"\[1, 128, h, w\].*got \[1, 16, 8, 8\]"):
        _sample(comfy, model, _reference_latent(positive, torch.zeros(1, 16, 8, 8)))
    base, _ = _load(comfy, M4B_BASE)
    with pytest.raises(ValueError, match=r"Klein Sampler: guidance 3 on a base model needs a negative: connect "
                                         r"negative \(Qwen3 Layer-Concat Encoder's negative output"):
        _sample(comfy, base, positive, guidance=3.0)


# ----- VAE both ways ------------------------------------------------------------------------------------


def test_loader_native_vae_decodes_and_encodes_like_ours(comfy):  # noqa: F811
    import comfy.sd as comfy_sd

    _, vae = _load(comfy)
    native = _native_vae(comfy)
    assert isinstance(native, comfy_sd.VAE) and (native.latent_channels, native.downscale_ratio) == (128, 16)
    assert _native_vae(comfy) is native  # one object per file
    latents = torch.randn(2, 128, 4, 5, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        (ours,) = comfy.pack.KleinVAEDecode.execute({"samples": latents}, vae).args
        (through_native,) = comfy.pack.KleinVAEDecode.execute({"samples": latents}, native).args
        core = native.decode(latents)  # what ComfyUI's VAEDecode does with it
        pixels = torch.rand(1, 64, 80, 3, generator=torch.Generator().manual_seed(4))
        (enc_ours,) = comfy.pack.KleinVAEEncode.execute(pixels, vae).args
        (enc_native,) = comfy.pack.KleinVAEEncode.execute(pixels, native).args
    assert ours.shape == through_native.shape == (2, 64, 80, 3)
    assert torch.equal(through_native, core)
    assert (ours - through_native).abs().max().item() < 1e-5
    assert enc_ours["samples"].shape == enc_native["samples"].shape == (1, 128, 4, 5)
    assert (enc_ours["samples"] - enc_native["samples"]).abs().max().item() < 1e-5


# What current ComfyUI (0.38: comfy/model_patcher.py) runs on every node output, here under its
# module's name (0.3.75 has neither): its prompt's model tracker and its RAM-pressure cache ask.
_PROBE = """
def is_model_patcher_output(output):
    return getattr(output, "patcher", None) is not None

def add(output):
    return getattr(output, "patcher", None), getattr(output, "get_models", None)
"""


def test_comfyuis_model_probes_do_not_read_a_native_vae(comfy):  # noqa: F811
    host = comfy.host
    host.release_native_vaes()
    native = _native_vae(comfy)
    probes: dict = {"__name__": "comfy.model_patcher"}
    exec(_PROBE, probes)  # noqa: S102
    assert probes["is_model_patcher_output"](native) is False
    assert probes["add"](native) == (None, None)
    assert native.__dict__["_klein_pending"] is not None, "a probe read the VAE file"
    elsewhere: dict = {"__name__": "some_custom_node"}
    exec(_PROBE, elsewhere)  # noqa: S102
    patcher, _ = elsewhere["add"](native)  # a node that takes the VAE's patcher first (to load it) gets it
    assert patcher is not None and native.__dict__["_klein_pending"] is None
    assert probes["is_model_patcher_output"](native) is True  # once read, ComfyUI sees its model


def test_native_vae_mixes_with_the_pack_in_a_graph(comfy):  # noqa: F811
    model, vae = _load(comfy)
    native = _native_vae(comfy)
    _, positive, _ = _encode_all(comfy, "put image 2 into image 1")
    first, second = _images()
    ours, sizes = _stack(comfy, first, vae)
    theirs, native_sizes = _stack(comfy, first, native)
    assert native_sizes == sizes and len(theirs.items) == 1
    assert (ours.items[0].latent - theirs.items[0].latent).abs().max().item() < 1e-5
    with torch.inference_mode():  # ComfyUI's VAE encodes a reference, the Klein Sampler samples, ours decodes
        (latent,) = comfy.pack.KleinVAEEncode.execute(second, native, "fit 1 megapixel").args
        samples = _sample(comfy, model, _reference_latent(positive, latent["samples"]), references=theirs,
                          width=0, height=0)
        (image,) = comfy.pack.KleinVAEDecode.execute({"samples": samples}, vae).args
        (image_native,) = comfy.pack.KleinVAEDecode.execute({"samples": samples}, native).args
    assert image.shape == image_native.shape == (1, 64, 80, 3)  # reference 1's size
    assert (image - image_native).abs().max().item() < 1e-5


def test_non_flux2_native_vae_is_refused_naming_both_nodes(comfy):  # noqa: F811
    import comfy.sd as comfy_sd

    pixel_space = comfy_sd.VAE(sd={"pixel_space_vae": torch.tensor(1.0)})  # VAELoader's "pixel_space"
    msg = (r"vae is a ComfyUI VAE with 3 latent channels and 1 pixels per latent \(from Load VAE or a checkpoint "
           r"loader\), not the FLUX.2 VAE \(128 channels, 16 pixels\): pick flux2-vae.safetensors in Load VAE")
    with torch.inference_mode():
        with pytest.raises(ValueError, match="Flux2 VAE Decode: " + msg):
            comfy.pack.KleinVAEDecode.execute({"samples": torch.zeros(1, 128, 4, 4)}, pixel_space)
        with pytest.raises(ValueError, match="Flux2 VAE Encode: " + msg):
            comfy.pack.KleinVAEEncode.execute(torch.rand(1, 64, 64, 3), pixel_space)
        with pytest.raises(ValueError, match="Klein Reference Stacker: " + msg):
            comfy.pack.KleinReferenceStacker.execute(torch.rand(1, 64, 64, 3), pixel_space)


# ----- the workflow -------------------------------------------------------------------------------------


def test_core_reference_chain_workflow_feeds_reference_latents_into_the_sampler():
    api = json.loads((REPO / "example_workflows" / "api" / "klein_core_reference_chain.api.json").read_text())
    (sid,) = [k for k, n in api.items() if n["class_type"] == "KleinSampler"]
    src, slot = api[sid]["inputs"]["conditioning"]
    chain = []
    while api[src]["class_type"] == "ReferenceLatent":
        chain.append(api[api[src]["inputs"]["latent"][0]]["class_type"])
        src, slot = api[src]["inputs"]["conditioning"]
    assert chain == ["KleinVAEEncode", "KleinVAEEncode"]
    assert (api[src]["class_type"], slot) == ("KleinTextEncode", 1)  # the encoder's positive CONDITIONING
    assert "references" not in api[sid]["inputs"] and api[sid]["inputs"]["width"] == 0
