"""Write the example workflows from one description, in both ComfyUI formats.

    python example_workflows/make_workflows.py           # (re)write the files
    python example_workflows/make_workflows.py --check   # exit 1 if a committed file differs

Each workflow becomes ``example_workflows/<name>.json`` (the UI format the frontend loads; ComfyUI lists
these as the pack's templates) and ``example_workflows/api/<name>.api.json`` (the API format that
``POST /prompt`` takes; kept in a subfolder so the template browser does not offer it). Both come from
the same :class:`Node` list, so they cannot disagree; so does each workflow's thumbnail
``example_workflows/<name>.jpg`` (the picture ComfyUI's template browser shows; drawn with Pillow).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
API_DIR = HERE / "api"

_HF = "https://huggingface.co/Comfy-Org"
MODEL_URLS = {
    "flux-2-klein-4b.safetensors": f"{_HF}/flux2-klein/resolve/main/split_files/diffusion_models/",
    "flux-2-klein-base-4b.safetensors": f"{_HF}/flux2-klein/resolve/main/split_files/diffusion_models/",
    "qwen_3_4b.safetensors": f"{_HF}/flux2-klein/resolve/main/split_files/text_encoders/",
    "flux2-vae.safetensors": f"{_HF}/flux2-dev/resolve/main/split_files/vae/",
    "flux-2-klein-9b-kv-fp8.safetensors": "https://huggingface.co/black-forest-labs/FLUX.2-klein-9b-kv-fp8/resolve/main/",
    "qwen_3_8b_fp8mixed.safetensors": f"{_HF}/flux2-klein-9B/resolve/main/split_files/text_encoders/",
}


@dataclass(frozen=True)
class Spec:
    """What the UI format needs to know of a node type (checked against the live /object_info by the
    e2e tests). ``widgets`` in input order; ``frontend_extra`` maps a widget to the frontend-only value
    stored right after it (the seed's control_after_generate, LoadImage's upload button)."""

    sockets: tuple[tuple[str, str, bool], ...] = ()  # (name, type, optional)
    widgets: tuple[str, ...] = ()
    outputs: tuple[tuple[str, str], ...] = ()
    frontend_extra: tuple[tuple[str, str], ...] = ()
    size: tuple[int, int] = (320, 120)
    virtual: bool = False  # frontend-only node (notes): not in the API format


ANY_VAE = "KLEIN_VAE,VAE"  # the pack's VAE sockets take either VAE
SPECS = {
    "KleinModelLoader": Spec(
        widgets=("model_name", "vae_name", "weight_dtype", "model_kind", "memory_mode", "speed"),
        outputs=(("model", "KLEIN_MODEL"), ("vae", "KLEIN_VAE"), ("native_vae", "VAE")), size=(340, 150)),
    "KleinTextEncode": Spec(
        widgets=("text_encoder", "prompt", "negative_prompt", "precision", "max_tokens", "lora_name", "lora_strength",
                 "speed"),
        outputs=(("conditioning", "KLEIN_COND"), ("positive", "CONDITIONING"), ("negative", "CONDITIONING")),
        size=(420, 375)),
    "KleinReferenceStacker": Spec(
        sockets=(("image", "IMAGE", False), ("vae", ANY_VAE, False), ("references", "KLEIN_REFS", True)),
        outputs=(("references", "KLEIN_REFS"), ("sizes", "STRING")), size=(300, 100)),
    "KleinSampler": Spec(
        sockets=(("model", "KLEIN_MODEL", False), ("conditioning", "KLEIN_COND,CONDITIONING", False),
                 ("references", "KLEIN_REFS", True), ("latent", "LATENT", True), ("mask", "MASK", True),
                 ("negative", "CONDITIONING", True)),
        widgets=("width", "height", "steps", "guidance", "seed", "batch_size", "denoise", "latent_as_reference",
                 "reference_mode"),
        outputs=(("latent", "LATENT"),), frontend_extra=(("seed", "randomize"),), size=(320, 350)),
    "KleinVAEEncode": Spec(
        sockets=(("pixels", "IMAGE", False), ("vae", ANY_VAE, False)), widgets=("size",),
        outputs=(("latent", "LATENT"),), size=(300, 90)),
    "KleinInpaintCrop": Spec(
        sockets=(("image", "IMAGE", False), ("mask", "MASK", False)), widgets=("padding", "megapixels"),
        outputs=(("image", "IMAGE"), ("mask", "MASK"), ("stitch", "KLEIN_STITCH")), size=(300, 130)),
    "KleinInpaintStitch": Spec(
        sockets=(("stitch", "KLEIN_STITCH", False), ("image", "IMAGE", False)), widgets=("feather", "composite"),
        outputs=(("image", "IMAGE"),), size=(300, 110)),
    "ImagePadForOutpaint": Spec(
        sockets=(("image", "IMAGE", False),), widgets=("left", "top", "right", "bottom", "feathering"),
        outputs=(("IMAGE", "IMAGE"), ("MASK", "MASK")), size=(300, 190)),
    "KleinVAEDecode": Spec(
        sockets=(("samples", "LATENT", False), ("vae", ANY_VAE, False)), outputs=(("image", "IMAGE"),),
        size=(240, 60)),
    "LoadImage": Spec(widgets=("image",), outputs=(("IMAGE", "IMAGE"), ("MASK", "MASK")),
                      frontend_extra=(("image", "image"),), size=(320, 330)),
    "SaveImage": Spec(sockets=(("images", "IMAGE", False),), widgets=("filename_prefix",), size=(420, 460)),
    "PreviewAny": Spec(sockets=(("source", "*", False),), size=(340, 120)),
    "Note": Spec(widgets=("text",), size=(340, 140), virtual=True),
    "KleinLoraTrainer": Spec(
        widgets=("dataset", "model_name", "vae_name", "text_encoder", "preset", "rank", "steps", "learning_rate",
                 "seed", "lora_name", "resolution", "base_precision", "sample_prompts", "sample_every",
                 "sample_steps", "memory_mode", "text_encoder_rank", "checkpoint_every", "speed"),
        outputs=(("lora_name", "STRING"), ("loss_curve", "IMAGE"), ("samples", "IMAGE")), size=(380, 520)),
    "KleinLoraLoader": Spec(sockets=(("model", "KLEIN_MODEL", False),), widgets=("lora_name", "strength"),
                            outputs=(("model", "KLEIN_MODEL"),), size=(320, 110)),
    "ReferenceLatent": Spec(sockets=(("conditioning", "CONDITIONING", False), ("latent", "LATENT", True)),
                            outputs=(("CONDITIONING", "CONDITIONING"),), size=(240, 60)),
    "KleinModelToMODEL": Spec(sockets=(("model", "KLEIN_MODEL", False),), outputs=(("MODEL", "MODEL"),),
                              size=(260, 60)),
    "CFGGuider": Spec(sockets=(("model", "MODEL", False), ("positive", "CONDITIONING", False),
                               ("negative", "CONDITIONING", False)), widgets=("cfg",),
                      outputs=(("GUIDER", "GUIDER"),), size=(270, 100)),
    "RandomNoise": Spec(widgets=("noise_seed",), outputs=(("NOISE", "NOISE"),),
                        frontend_extra=(("noise_seed", "fixed"),), size=(270, 90)),
    "KSamplerSelect": Spec(widgets=("sampler_name",), outputs=(("SAMPLER", "SAMPLER"),), size=(270, 60)),
    "Flux2Scheduler": Spec(widgets=("steps", "width", "height"), outputs=(("SIGMAS", "SIGMAS"),), size=(270, 110)),
    "EmptyFlux2LatentImage": Spec(widgets=("width", "height", "batch_size"), outputs=(("LATENT", "LATENT"),),
                                  size=(270, 110)),
    "SamplerCustomAdvanced": Spec(
        sockets=(("noise", "NOISE", False), ("guider", "GUIDER", False), ("sampler", "SAMPLER", False),
                 ("sigmas", "SIGMAS", False), ("latent_image", "LATENT", False)),
        outputs=(("output", "LATENT"), ("denoised_output", "LATENT")), size=(280, 330)),
    "VAEDecode": Spec(sockets=(("samples", "LATENT", False), ("vae", "VAE", False)), outputs=(("IMAGE", "IMAGE"),),
                      size=(240, 60)),
    "EasyCache": Spec(sockets=(("model", "MODEL", False),),
                      widgets=("reuse_threshold", "start_percent", "end_percent", "verbose"),
                      outputs=(("MODEL", "MODEL"),), size=(270, 150)),
}
# Room each node needs below its position beyond its saved size: the sampler's latent preview grows
# it to about 454 px (ComfyUI with --preview-method auto), Save Image shows the picture.
GROWS = {"KleinSampler": 460, "SaveImage": 560}
NODE_TITLE_HEIGHT = 30  # LiteGraph draws a node's title bar above its position
VIEW = (1280, 720)  # the saved view fits the graph into this canvas, below the tab bar
TAB_BAR = 56
DISPLAY_NAMES = {
    "KleinLoraTrainer": "Klein LoRA Trainer", "KleinLoraLoader": "Klein LoRA Loader",
    "KleinModelLoader": "Klein Model Loader", "KleinTextEncode": "Qwen3 Layer-Concat Encoder",
    "KleinReferenceStacker": "Klein Reference Stacker", "KleinSampler": "Klein Sampler",
    "KleinVAEDecode": "Flux2 VAE Decode", "LoadImage": "Load Image", "SaveImage": "Save Image",
    "PreviewAny": "Preview as Text", "Note": "Note", "KleinVAEEncode": "Flux2 VAE Encode",
    "KleinInpaintCrop": "Klein Inpaint Crop", "KleinInpaintStitch": "Klein Inpaint Stitch",
    "ImagePadForOutpaint": "Pad Image for Outpainting", "ReferenceLatent": "ReferenceLatent",
    "KleinModelToMODEL": "Klein Model to MODEL", "CFGGuider": "CFGGuider", "RandomNoise": "RandomNoise",
    "KSamplerSelect": "KSamplerSelect", "Flux2Scheduler": "Flux2Scheduler",
    "EmptyFlux2LatentImage": "Empty Flux 2 Latent", "SamplerCustomAdvanced": "SamplerCustomAdvanced",
    "VAEDecode": "VAE Decode", "EasyCache": "EasyCache",
}


@dataclass
class Node:
    id: int
    type: str
    pos: tuple[int, int]
    values: dict = field(default_factory=dict)  # widget name -> value
    links: dict = field(default_factory=dict)  # socket name -> (source node id, source output slot)
    title: str | None = None


@dataclass
class Workflow:
    name: str
    nodes: list[Node]


# ----- the workflows ----------------------------------------------------------------------------------

def _loader(nid: int, model: str) -> Node:
    return Node(nid, "KleinModelLoader", (40, 80), {"model_name": model, "vae_name": "flux2-vae.safetensors",
                                                     "weight_dtype": "bf16", "model_kind": "auto",
                                                     "memory_mode": "auto", "speed": "fast"})


def _encoder(nid: int, prompt: str, negative: str = "", encoder: str = "qwen_3_4b.safetensors") -> Node:
    return Node(nid, "KleinTextEncode", (40, 290),
                {"text_encoder": encoder, "prompt": prompt, "negative_prompt": negative,
                 "precision": "model dtype", "max_tokens": "512", "lora_name": "none", "lora_strength": 1.0,
                 "speed": "fast"})


def _sampler(nid: int, size: int, steps: int, guidance: float, refs: tuple[int, int] | None = None,
             latent: tuple[int, int] | None = None, mask: tuple[int, int] | None = None,
             denoise: float = 1.0, conditioning: tuple[int, int] = (2, 0)) -> Node:
    links = {"model": (1, 0), "conditioning": conditioning, **({"references": refs} if refs else {}),
             **({"latent": latent} if latent else {}), **({"mask": mask} if mask else {})}
    return Node(nid, "KleinSampler", (520, 80), {"width": size, "height": size, "steps": steps,
                                                  "guidance": guidance, "seed": 42, "batch_size": 1,
                                                  "denoise": denoise, "latent_as_reference": True,
                                                  "reference_mode": "auto"}, links)


def _inpaint_chain(image: tuple[int, int], mask: tuple[int, int], padding: int, prefix: str) -> list[Node]:
    """Crop around the mask -> encode -> sample -> decode -> stitch back -> save."""
    return [
        Node(9, "KleinInpaintCrop", (-380, 470), {"padding": padding, "megapixels": 1.0},
             {"image": image, "mask": mask}),
        Node(8, "KleinVAEEncode", (-380, 660), {"size": "crop to 16"}, {"pixels": (9, 0), "vae": (1, 1)}),
        _sampler(3, 0, 4, 1.0, latent=(8, 0), mask=(9, 1)),
        Node(4, "KleinVAEDecode", (900, 80), links={"samples": (3, 0), "vae": (1, 1)}),
        Node(10, "KleinInpaintStitch", (900, 200), {"feather": 8, "composite": True},
             {"stitch": (9, 2), "image": (4, 0)}),
        Node(5, "SaveImage", (900, 370), {"filename_prefix": prefix}, {"images": (10, 0)}),
    ]


def _decode_save(prefix: str, sampler: int = 3) -> list[Node]:
    # Right of the sampler, not below it: its latent preview grows it downwards while it runs.
    return [Node(4, "KleinVAEDecode", (900, 80), links={"samples": (sampler, 0), "vae": (1, 1)}),
            Node(5, "SaveImage", (900, 200), {"filename_prefix": prefix}, {"images": (4, 0)})]


INPAINT_NOTE = ("Load your picture in Load Image, then right-click it > Open in MaskEditor and paint what "
                "to change (or load a PNG whose transparent pixels mark it). Klein Inpaint Crop paints the "
                "masked region (plus padding) at about 1 megapixel; Klein Inpaint Stitch puts it back, "
                "changing only masked pixels (feathered edge). The picture also guides Klein as a reference.")

WORKFLOWS = [
    Workflow("klein_4b_text_to_image", [
        _loader(1, "flux-2-klein-4b.safetensors"),
        _encoder(2, "A red fox sitting in fresh snow at sunrise, soft golden light, shallow depth of field, "
                    "detailed fur"),
        _sampler(3, 1024, 4, 1.0),
        *_decode_save("Klein-4B"),
        Node(6, "Note", (40, 700), {"text": "FLUX.2 Klein 4B distilled: 4 steps, no CFG (guidance 1). Files: "
                                            "diffusion_models/flux-2-klein-4b.safetensors, text_encoders/"
                                            "qwen_3_4b.safetensors, vae/flux2-vae.safetensors."}),
    ]),
    Workflow("klein_4b_base_cfg", [
        _loader(1, "flux-2-klein-base-4b.safetensors"),
        _encoder(2, "A cozy reading corner in a sunlit library, wooden shelves, a green armchair, dust "
                    "floating in the light beams, photorealistic",
                 "blurry, low quality, distorted, watermark, text"),
        _sampler(3, 1024, 50, 4.0),
        *_decode_save("Klein-4B-base"),
        Node(6, "Note", (40, 700), {"text": "FLUX.2 Klein base 4B: classifier-free guidance 4 with the "
                                            "negative prompt, 50 steps (two transformer passes per step). "
                                            "Fewer steps (20-30) are faster at some cost in detail."}),
    ]),
    Workflow("klein_4b_two_reference_edit", [
        _loader(1, "flux-2-klein-4b.safetensors"),
        _encoder(2, "Place the object from image 2 into the scene of image 1, keeping the lighting and "
                    "perspective of image 1."),
        Node(7, "LoadImage", (-380, 80), {"image": "klein_reference_1.png"},
             title="Reference 1 (sets the size)"),
        Node(8, "LoadImage", (-380, 470), {"image": "klein_reference_2.png"}, title="Reference 2"),
        Node(9, "KleinReferenceStacker", (40, 700), links={"image": (7, 0), "vae": (1, 1)}),
        Node(10, "KleinReferenceStacker", (40, 840),
             links={"image": (8, 0), "vae": (1, 1), "references": (9, 0)}),
        _sampler(3, 0, 4, 1.0, refs=(10, 0)),
        *_decode_save("Klein-4B-edit"),
        Node(11, "PreviewAny", (520, 700), links={"source": (10, 1)}, title="Reference sizes"),
        Node(6, "Note", (520, 870), {"text": "Replace klein_reference_1.png and klein_reference_2.png with "
                                             "your own images (upload them in the Load Image nodes). Width "
                                             "and height 0 = the size of reference 1 (scaled to at most 1 "
                                             "megapixel, multiples of 16), shown in Reference sizes after a "
                                             "run. Chain more stackers for more references (up to 4)."}),
    ]),
    Workflow("klein_9b_kv_edit", [
        _loader(1, "flux-2-klein-9b-kv-fp8.safetensors"),
        _encoder(2, "Put the person from image 1 into the street scene of image 2, evening light",
                 encoder="qwen_3_8b_fp8mixed.safetensors"),
        Node(7, "LoadImage", (-380, 80), {"image": "klein_reference_1.png"}, title="Reference 1 (sets the size)"),
        Node(8, "LoadImage", (-380, 470), {"image": "klein_reference_2.png"}, title="Reference 2"),
        Node(9, "KleinReferenceStacker", (40, 700), links={"image": (7, 0), "vae": (1, 1)}),
        Node(10, "KleinReferenceStacker", (40, 840),
             links={"image": (8, 0), "vae": (1, 1), "references": (9, 0)}),
        _sampler(3, 0, 4, 1.0, refs=(10, 0)),
        *_decode_save("Klein-9B-KV-edit"),
        Node(6, "Note", (520, 700), {"text": "Klein 9B-KV: the references' keys and values are computed once "
                                             "(model_kind auto reads 'kv' from the file name) and every step, "
                                             "and the next run with the same pictures, reuses them: a new "
                                             "prompt or seed skips the reference pass. Needs "
                                             "qwen_3_8b_fp8mixed.safetensors (or qwen_3_8b) in text_encoders."}),
    ]),
    Workflow("klein_4b_img2img", [
        _loader(1, "flux-2-klein-4b.safetensors"),
        _encoder(2, "The same scene as a watercolour painting, soft washes of colour, paper texture"),
        Node(7, "LoadImage", (-380, 80), {"image": "klein_img2img_input.png"}, title="Picture to start from"),
        Node(8, "KleinVAEEncode", (-380, 470), {"size": "fit 1 megapixel"}, {"pixels": (7, 0), "vae": (1, 1)}),
        _sampler(3, 0, 4, 1.0, latent=(8, 0), denoise=0.6),
        *_decode_save("Klein-4B-img2img"),
        Node(6, "Note", (40, 700), {"text": "Image to image: denoise 0.6 keeps the composition of the picture "
                                            "and repaints its style and details; 1.0 repaints fully, 0.3 "
                                            "changes little. The output takes the picture's size (about 1 "
                                            "megapixel, sides multiples of 16)."}),
    ]),
    Workflow("klein_4b_inpaint", [
        _loader(1, "flux-2-klein-4b.safetensors"),
        _encoder(2, "A vase of sunflowers on the table"),
        Node(7, "LoadImage", (-380, 80), {"image": "klein_inpaint_input.png"}, title="Picture + mask"),
        *_inpaint_chain((7, 0), (7, 1), 32, "Klein-4B-inpaint"),
        Node(6, "Note", (40, 700), {"text": INPAINT_NOTE}),
    ]),
    Workflow("klein_4b_outpaint", [
        _loader(1, "flux-2-klein-4b.safetensors"),
        _encoder(2, "A wide mountain landscape continuing the scene, same light and style"),
        Node(7, "LoadImage", (-760, 80), {"image": "klein_outpaint_input.png"}, title="Picture to extend"),
        Node(11, "ImagePadForOutpaint", (-380, 80), {"left": 0, "top": 0, "right": 256, "bottom": 0,
                                                     "feathering": 40}, {"image": (7, 0)}),
        *_inpaint_chain((11, 0), (11, 1), 64, "Klein-4B-outpaint"),
        Node(6, "Note", (40, 700), {"text": "Outpainting: Pad Image for Outpainting adds the new area (here "
                                            "256 px on the right; feathering repaints a soft seam into the "
                                            "picture), and the inpaint chain fills it. Only the new area and "
                                            "the feathered seam change."}),
    ]),
    Workflow("klein_core_reference_chain", [
        _loader(1, "flux-2-klein-4b.safetensors"),
        _encoder(2, "Place the object from image 2 into the scene of image 1, keeping the lighting and "
                    "perspective of image 1."),
        Node(7, "LoadImage", (-380, 80), {"image": "klein_reference_1.png"}, title="Reference 1 (sets the size)"),
        Node(8, "LoadImage", (-380, 470), {"image": "klein_reference_2.png"}, title="Reference 2"),
        Node(9, "KleinVAEEncode", (40, 700), {"size": "fit 1 megapixel"}, {"pixels": (7, 0), "vae": (1, 1)}),
        Node(10, "KleinVAEEncode", (40, 830), {"size": "fit 1 megapixel"}, {"pixels": (8, 0), "vae": (1, 1)}),
        Node(11, "ReferenceLatent", (520, 620), links={"conditioning": (2, 1), "latent": (9, 0)}),
        Node(12, "ReferenceLatent", (520, 730), links={"conditioning": (11, 0), "latent": (10, 0)}),
        _sampler(3, 0, 4, 1.0, conditioning=(12, 0)),
        *_decode_save("Klein-4B-core-refs"),
        Node(6, "Note", (520, 850), {"text": "ComfyUI's own ReferenceLatent nodes chained on the encoder's "
                                             "positive CONDITIONING: the Klein Sampler takes their references "
                                             "in order (after any Reference Stacker's), as Klein's index "
                                             "method. Width and height 0 = the size of reference 1."}),
    ]),
    Workflow("klein_core_sampler", [
        _loader(1, "flux-2-klein-base-4b.safetensors"),
        _encoder(2, "A cozy reading corner in a sunlit library, wooden shelves, a green armchair, dust floating "
                    "in the light beams, photorealistic", "blurry, low quality, distorted, watermark, text"),
        Node(3, "KleinModelToMODEL", (520, 80), links={"model": (1, 0)}),
        Node(4, "CFGGuider", (520, 190), {"cfg": 4.0}, {"model": (3, 0), "positive": (2, 1), "negative": (2, 2)}),
        Node(5, "RandomNoise", (520, 330), {"noise_seed": 42}),
        Node(6, "KSamplerSelect", (520, 450), {"sampler_name": "euler"}),
        Node(7, "Flux2Scheduler", (520, 540), {"steps": 50, "width": 1024, "height": 1024}),
        Node(8, "EmptyFlux2LatentImage", (520, 680), {"width": 1024, "height": 1024, "batch_size": 1}),
        Node(9, "SamplerCustomAdvanced", (860, 80), links={"noise": (5, 0), "guider": (4, 0), "sampler": (6, 0),
                                                           "sigmas": (7, 0), "latent_image": (8, 0)}),
        Node(10, "VAEDecode", (1180, 80), links={"samples": (9, 0), "vae": (1, 2)}),
        Node(11, "SaveImage", (1180, 200), {"filename_prefix": "Klein-core-sampler"}, {"images": (10, 0)}),
        Node(12, "Note", (40, 700), {"text": "The base model through ComfyUI's own sampler: Klein Model to MODEL "
                                             "gives a native MODEL, so any sampler, scheduler, guider or model "
                                             "patch (EasyCache, ...) works on it. The encoder's positive and "
                                             "negative outputs are native CONDITIONING; the loader's native_vae "
                                             "is ComfyUI's own VAE."}),
    ]),
    Workflow("klein_base_dpmpp_2m_easycache", [
        _loader(1, "flux-2-klein-base-4b.safetensors"),
        _encoder(2, "A red vintage bicycle leaning on a stone wall covered in ivy, morning light, photorealistic",
                 "blurry, low quality, distorted, watermark, text"),
        Node(3, "KleinModelToMODEL", (520, 80), links={"model": (1, 0)}),
        Node(13, "EasyCache", (520, 190), {"reuse_threshold": 0.2, "start_percent": 0.15, "end_percent": 0.95,
                                           "verbose": True}, {"model": (3, 0)}),
        Node(4, "CFGGuider", (520, 370), {"cfg": 4.0}, {"model": (13, 0), "positive": (2, 1), "negative": (2, 2)}),
        Node(5, "RandomNoise", (520, 500), {"noise_seed": 42}),
        Node(6, "KSamplerSelect", (520, 620), {"sampler_name": "dpmpp_2m"}),
        Node(7, "Flux2Scheduler", (860, 450), {"steps": 30, "width": 1024, "height": 1024}),
        Node(8, "EmptyFlux2LatentImage", (860, 590), {"width": 1024, "height": 1024, "batch_size": 1}),
        Node(9, "SamplerCustomAdvanced", (860, 80), links={"noise": (5, 0), "guider": (4, 0), "sampler": (6, 0),
                                                           "sigmas": (7, 0), "latent_image": (8, 0)}),
        Node(10, "VAEDecode", (1180, 80), links={"samples": (9, 0), "vae": (1, 2)}),
        Node(11, "SaveImage", (1180, 200), {"filename_prefix": "Klein-base-dpmpp2m-easycache"}, {"images": (10, 0)}),
        Node(12, "Note", (40, 700), {"text": "The base model with a core sampler (dpmpp_2m) and EasyCache, which "
                                             "skips steps whose change it can predict (the log says how many). "
                                             "Lower reuse_threshold to skip fewer steps."}),
    ]),
    Workflow("klein_train_then_generate", [
        Node(7, "KleinLoraTrainer", (-420, 80), {
            "dataset": "input/klein_lora_dataset", "model_name": "flux-2-klein-base-4b.safetensors",
            "vae_name": "flux2-vae.safetensors", "text_encoder": "qwen_3_4b.safetensors", "preset": "style",
            "rank": 32, "steps": 1000, "learning_rate": 0.0001, "seed": 0, "lora_name": "klein_lora",
            "resolution": 1024, "base_precision": "default",
            "sample_prompts": "A lighthouse on a rocky coast at dusk, in the trained style", "sample_every": 250,
            "sample_steps": 20, "memory_mode": "resident", "text_encoder_rank": 0,
            "checkpoint_every": 250, "speed": "fast"}, title="Klein LoRA Trainer (base model)"),
        Node(8, "PreviewAny", (-420, 640), links={"source": (7, 0)}, title="Trained LoRA file"),
        Node(9, "SaveImage", (-880, 80), {"filename_prefix": "Klein-LoRA-loss"}, {"images": (7, 1)},
             title="Loss curve"),
        Node(11, "SaveImage", (-1340, 80), {"filename_prefix": "Klein-LoRA-samples"}, {"images": (7, 2)},
             title="LoRA samples (every 250 steps)"),
        _loader(1, "flux-2-klein-4b.safetensors"),
        Node(10, "KleinLoraLoader", (520, 600), {"lora_name": "klein_lora.safetensors", "strength": 1.0},
             {"model": (1, 0)}),
        _encoder(2, "A lighthouse on a rocky coast at dusk, in the trained style"),
        dataclasses.replace(_sampler(3, 1024, 4, 1.0), links={"model": (10, 0), "conditioning": (2, 0)}),
        *_decode_save("Klein-4B-LoRA"),
        Node(6, "Note", (40, 700), {"text": "Put your training images with a .txt caption beside each in the "
                                            "dataset folder on the server (here ComfyUI/input/klein_lora_dataset). "
                                            "The trainer writes models/loras/klein_lora.safetensors from the BASE "
                                            "model; the LoRA works on the distilled 4B too, and shows samples of "
                                            "its sample_prompts every 250 steps. The first run trains "
                                            "(the LoRA Loader reports the file missing until then): refresh (R) "
                                            "and queue again to generate with the new LoRA."}),
    ]),
]


# ----- the two formats ----------------------------------------------------------------------------------

def _execution_order(wf: Workflow) -> dict[int, int]:
    order: dict[int, int] = {}
    pending = list(wf.nodes)
    while pending:
        for node in pending:
            if all(src in order for src, _ in node.links.values()):
                order[node.id] = len(order)
                pending.remove(node)
                break
        else:
            raise ValueError(f"{wf.name}: the links form a cycle or name a missing node")
    return order


def to_ui(wf: Workflow) -> dict:
    by_id = {n.id: n for n in wf.nodes}
    order = _execution_order(wf)
    links, out_links = [], {}
    for node in sorted(wf.nodes, key=lambda n: order[n.id]):
        spec = SPECS[node.type]
        for slot, (name, typ, _) in enumerate(spec.sockets):
            if name in node.links:
                src, src_slot = node.links[name]
                out_type = SPECS[by_id[src].type].outputs[src_slot][1]
                if typ != "*" and out_type not in typ.split(","):
                    raise ValueError(f"{wf.name}: node {node.id}.{name} ({typ}) linked to a different type")
                links.append([len(links) + 1, src, src_slot, node.id, slot, out_type])
                out_links.setdefault((src, src_slot), []).append(len(links))
    link_of = {(lk[3], lk[4]): lk[0] for lk in links}
    nodes = []
    for node in sorted(wf.nodes, key=lambda n: n.id):
        spec = SPECS[node.type]
        extra = dict(spec.frontend_extra)
        widgets = []
        for w in spec.widgets:
            widgets.append(node.values[w])
            if w in extra:
                widgets.append(extra[w])
        entry = {
            "id": node.id, "type": node.type, "pos": list(node.pos), "size": list(spec.size), "flags": {},
            "order": order[node.id], "mode": 0,
            "inputs": [{"name": n, "type": t, "link": link_of.get((node.id, slot)),
                        **({"shape": 7} if opt else {})}  # 7: the frontend's optional-socket shape
                       for slot, (n, t, opt) in enumerate(spec.sockets)],
            "outputs": [{"name": n, "type": t, "links": out_links.get((node.id, slot), []),
                         "slot_index": slot} for slot, (n, t) in enumerate(spec.outputs)],
            "properties": {"Node name for S&R": node.type},
            "widgets_values": widgets,
        }
        models = [{"name": v, "url": MODEL_URLS[v] + v, "directory": _folder(w)}
                  for w, v in node.values.items() if v in MODEL_URLS]
        if models:
            entry["properties"]["models"] = models
        if node.title:
            entry["title"] = node.title
        nodes.append(entry)
    return {
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"klein-nodes/example_workflows/{wf.name}")),
        "revision": 0, "last_node_id": max(by_id), "last_link_id": len(links), "nodes": nodes, "links": links,
        "groups": [], "config": {}, "extra": {"ds": view(wf)}, "version": 0.4,
    }


def bounds(wf: Workflow) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of everything drawn: title bars, and the room nodes grow into."""
    boxes = [(n.pos[0], n.pos[1] - NODE_TITLE_HEIGHT, n.pos[0] + SPECS[n.type].size[0],
              n.pos[1] + max(SPECS[n.type].size[1], GROWS.get(n.type, 0))) for n in wf.nodes]
    return min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes), max(b[3] for b in boxes)


def view(wf: Workflow, margin: int = 20) -> dict:
    """The saved canvas view (LiteGraph: screen = (graph + offset) * scale) that shows the whole graph
    in a VIEW-sized canvas below the tab bar."""
    left, top, right, bottom = bounds(wf)
    scale = min(1.0, (VIEW[0] - 2 * margin) / (right - left), (VIEW[1] - TAB_BAR - 2 * margin) / (bottom - top))
    scale = round(scale, 3)
    return {"scale": scale, "offset": [round(margin / scale - left, 1), round((TAB_BAR + margin) / scale - top, 1)]}


def _folder(widget: str) -> str:
    return {"model_name": "diffusion_models", "vae_name": "vae", "text_encoder": "text_encoders"}[widget]


def to_api(wf: Workflow) -> dict:
    graph = {}
    for node in sorted(wf.nodes, key=lambda n: n.id):
        if SPECS[node.type].virtual:
            continue
        inputs = {w: node.values[w] for w in SPECS[node.type].widgets}
        inputs.update({name: [str(src), slot] for name, (src, slot) in node.links.items()})
        graph[str(node.id)] = {"inputs": inputs, "class_type": node.type,
                               "_meta": {"title": node.title or DISPLAY_NAMES[node.type]}}
    return graph


TITLES = {"klein_train_then_generate": "Klein: train a LoRA, then generate with it",
          "klein_core_sampler": "Klein base with ComfyUI's core sampler",
          "klein_base_dpmpp_2m_easycache": "Klein base with dpmpp_2m and EasyCache",
          "klein_4b_text_to_image": "Klein 4B: text to image", "klein_4b_base_cfg": "Klein 4B base: CFG + negative",
          "klein_4b_two_reference_edit": "Klein 4B: edit with two references",
          "klein_4b_img2img": "Klein 4B: image to image", "klein_4b_inpaint": "Klein 4B: inpaint",
          "klein_4b_outpaint": "Klein 4B: outpaint", "klein_9b_kv_edit": "Klein 9B-KV: edit, references cached",
          "klein_core_reference_chain": "Core reference chain into the Klein Sampler"}
COLORS = {"KleinLoraTrainer": (160, 70, 90), "KleinLoraLoader": (70, 110, 170),
          "KleinModelLoader": (70, 110, 170), "KleinTextEncode": (90, 140, 90), "KleinSampler": (170, 100, 60),
          "KleinVAEDecode": (130, 90, 160), "KleinReferenceStacker": (60, 140, 140), "LoadImage": (110, 110, 110),
          "SaveImage": (110, 110, 110), "PreviewAny": (110, 110, 110), "Note": (150, 140, 80),
          "ReferenceLatent": (120, 120, 150)}


def thumbnail(wf: Workflow, size: tuple[int, int] = (512, 384)):
    """The template browser's picture of a workflow: its graph, drawn from the same description."""
    from PIL import Image, ImageDraw  # only for the thumbnails; the JSON files need the standard library

    img = Image.new("RGB", size, (32, 33, 38))
    draw = ImageDraw.Draw(img)
    draw.text((12, 10), TITLES.get(wf.name, wf.name), fill=(235, 235, 235))
    left, top, right, bottom = bounds(wf)
    scale = min((size[0] - 24) / (right - left), (size[1] - 44) / (bottom - top))

    def at(x: float, y: float) -> tuple[int, int]:
        return int(12 + (x - left) * scale), int(34 + (y - top) * scale)

    centre = {}
    for n in wf.nodes:
        w, h = SPECS[n.type].size
        x0, y0 = at(n.pos[0], n.pos[1] - NODE_TITLE_HEIGHT)
        x1, y1 = at(n.pos[0] + w, n.pos[1] + h)
        draw.rectangle((x0, y0, x1, y1), fill=COLORS.get(n.type, (90, 90, 90)), outline=(200, 200, 200))
        draw.text((x0 + 4, y0 + 3), (n.title or DISPLAY_NAMES[n.type])[: max(4, (x1 - x0) // 6)], fill=(250, 250, 250))
        centre[n.id] = ((x0 + x1) // 2, (y0 + y1) // 2)
    for n in wf.nodes:
        for src, _ in n.links.values():
            draw.line((centre[src], centre[n.id]), fill=(230, 200, 90), width=2)
    return img


def rendered() -> dict[Path, str]:
    """Every file this script writes, with its exact text."""
    files = {}
    for wf in WORKFLOWS:
        files[HERE / f"{wf.name}.json"] = json.dumps(to_ui(wf), indent=2) + "\n"
        files[API_DIR / f"{wf.name}.api.json"] = json.dumps(to_api(wf), indent=2) + "\n"
    return files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare the committed files")
    args = ap.parse_args(argv)
    texts = rendered()
    stale = [p for p, text in texts.items() if not p.is_file() or p.read_text() != text]
    # Thumbnails (same name, .jpg: what ComfyUI's template browser shows) are pictures: checked to
    # exist, rewritten whenever the workflows are.
    thumbs = {HERE / f"{wf.name}.jpg": wf for wf in WORKFLOWS}
    if args.check:
        for p in stale + [t for t in thumbs if not t.is_file()]:
            sys.stderr.write(f"out of date: {p.relative_to(HERE.parent)}\n")
        return 1 if stale or not all(t.is_file() for t in thumbs) else 0
    API_DIR.mkdir(exist_ok=True)
    for p in stale:
        p.write_text(texts[p])
        sys.stdout.write(f"wrote {p.relative_to(HERE.parent)}\n")
    for p, wf in thumbs.items():
        if stale or not p.is_file():
            thumbnail(wf).save(p, quality=90)
            sys.stdout.write(f"wrote {p.relative_to(HERE.parent)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
