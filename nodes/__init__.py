"""ComfyUI V3 adapters over klein_core. Imported only inside a ComfyUI host (as ``<pack>.nodes``)."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from . import cache
from .encode import KleinTextEncode
from .inpaint import KleinInpaintCrop, KleinInpaintStitch
from .loaders import KleinModelLoader
from .native_model import KleinModelToMODEL
from .lora import KleinLoraLoader
from .references import KleinReferenceStacker
from .sampler import KleinSampler
from .train import KleinLoraTrainer
from .vae import KleinVAEDecode, KleinVAEEncode

NODES: list[type[io.ComfyNode]] = [
    KleinModelLoader, KleinTextEncode, KleinReferenceStacker, KleinSampler, KleinVAEDecode, KleinVAEEncode,
    KleinLoraLoader, KleinInpaintCrop, KleinInpaintStitch, KleinModelToMODEL, KleinLoraTrainer,
]


class KleinExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> KleinExtension:
    cache.install_free_hook()  # POST /free (and ComfyUI's other "unload everything") releases our models
    return KleinExtension()
