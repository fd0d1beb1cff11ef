"""ComfyUI V3 adapters over klein_core. Imported only inside a ComfyUI host (as ``<pack>.nodes``)."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from klein_core.memory import pinned

from . import cache, host
from .encode import KleinTextEncode
from .inpaint import KleinInpaintCrop, KleinInpaintStitch
from .loaders import KleinModelLoader
from .lora import KleinLoraLoader
from .native_model import KleinModelToMODEL
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
    pinned.other_locked = host.comfy_pinned_bytes  # our page-locked memory and ComfyUI's share one bound
    return KleinExtension()
