"""One worker's engine and how it runs one row: shared by the batch actors and the serve replicas.

Each row runs as its own :class:`~klein_core.pipeline.request.GenerationRequest` (one image, its own
seed), so its image depends only on the row and the models: rows are never fused into one forward,
because a fused forward is not bit-identical to a single one (measured on the CPU: off by 1/255).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image

from ..pipeline.engine import Engine, GenerationResult
from ..pipeline.request import GenerationRequest
from ..provenance import run_environment, strength_text
from .models import ModelSpec, open_engine, spec_dtype
from .rows import RowSpec, lora_path

logger = logging.getLogger(__name__)

# LoRAs a worker keeps loaded. A serve replica lives for days and may see many LoRA names: without a
# bound every one it ever loaded stayed in memory.
MAX_CACHED_LORAS = 8


def worker_name() -> str:
    """This process as ``host:pid`` (the manifest's ``worker``)."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class RowOutput:
    """What one row produced: the result, the PNG ``parameters`` and the seconds it took."""

    result: GenerationResult
    params: dict
    seconds: float


class RowRunner:
    """An :class:`Engine` loaded once from a :class:`ModelSpec`, running rows one at a time."""

    def __init__(self, spec: ModelSpec, engine: Engine | None = None) -> None:
        self.spec = spec
        self.engine = engine if engine is not None else open_engine(spec)
        self.worker = worker_name()
        # Keyed by the file and its stat, not the row's name: a LoRA file replaced on disk (an updated
        # style) must be read again, or a long-running replica kept generating with the old weights.
        self._loras: OrderedDict[tuple, object] = OrderedDict()

    def run(self, row: RowSpec, images: Sequence[Image.Image], *, callback=None) -> RowOutput:
        """Generate ``row`` (references already opened as ``images``); raises what the engine raises.
        ``callback(step, total, latents)``: after each step, False cancels."""
        t0 = time.perf_counter()
        request = GenerationRequest(row.prompt, row.negative_prompt, tuple(images), row.settings())
        handle = self._apply_loras(row) if row.loras else None
        try:
            result = self.engine.generate(request, callback=callback)
        finally:
            if handle is not None:
                handle.remove()  # restores the exact weights for the next row
        cfg = self.engine.kind == "base" and result.guidance > 1  # else the negative prompt changed nothing
        params = {"id": row.id, "prompt": row.prompt, "negative_prompt": row.negative_prompt if cfg else "",
                  "width": result.width, "height": result.height, "steps": result.steps,
                  "guidance": result.guidance, "seed": row.seed,
                  "references": list(row.references),
                  "reference_sizes": [list(size) for size in result.reference_sizes],
                  # the exact strength that ran ("%g" alone wrote 0.123457 for 0.123456789), as the CLI does
                  "loras": [f"{n}:{strength_text(s)}" for n, s in row.loras], **self.spec.png_params(),
                  "dtype": str(spec_dtype(self.spec, self.engine.device)).removeprefix("torch."),
                  "decode_tiles": result.decode_tiles, "environment": run_environment(self.engine.transformer)}
        return RowOutput(result, params, time.perf_counter() - t0)

    def _apply_loras(self, row: RowSpec):
        from ..lora import apply_loras, load_lora
        from ..lora.apply import exact_mode

        pairs = [(self._lora(load_lora, lora_path(self.spec.lora_dir, name)), strength)
                 for name, strength in row.loras]
        models = (self.engine.transformer, self.engine.text_encoder)
        return apply_loras(models, pairs, mode=exact_mode(*models))  # branches on GGUF / NVFP4 blocks

    def _lora(self, load_lora, path):
        """The LoRA at ``path``, from the cache while the file is unchanged (same inode, size and
        modification time), else loaded again; the least recently used beyond the bound is dropped."""
        resolved = path.resolve()
        st = resolved.stat()  # a missing file raises here, as load_lora would
        key = (str(resolved), st.st_ino, st.st_size, st.st_mtime_ns)
        lora = self._loras.get(key)
        if lora is None:
            lora = load_lora(resolved)
            # An older version of the same file is never used again: drop it now.
            for old in [k for k in self._loras if k[0] == key[0]]:
                del self._loras[old]
            self._loras[key] = lora
            while len(self._loras) > MAX_CACHED_LORAS:
                self._loras.popitem(last=False)
        else:
            self._loras.move_to_end(key)
        return lora
