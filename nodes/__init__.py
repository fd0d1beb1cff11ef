"""ComfyUI V3 adapters over klein_core. Imported only inside a ComfyUI host."""

from comfy_api.latest import ComfyExtension, io


class KleinExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return []


async def comfy_entrypoint() -> KleinExtension:
    return KleinExtension()
