"""``klein_core.transfer`` on the CPU, and the pipeline's results through it.

The page-locked, queued copies themselves only exist with CUDA; ``tests/gpu`` checks there that a
generation makes no pageable copy and gives the bytes of plain blocking copies
(``test_generate_copies_only_through_page_locked_memory``). Here: the CPU branch is exactly
``.to()`` (the same tensor when nothing changes, as ``.to()`` returns it), and the decode path that
now checks, clamps and rounds where the pixels were decoded gives what the old order gave.
"""

from __future__ import annotations

import numpy as np
import torch

import klein_core as kc
from klein_core.pipeline.images import to_pil, to_pil_and_host
from klein_core.pipeline.vae_io import decode_to_pixels
from klein_core.testing.tiny import build_tiny_components
from klein_core.transfer import to_device, to_host


def test_to_device_on_the_cpu_is_to():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(3, 5, generator=g)
    assert to_device(t, "cpu") is t  # nothing to do: no copy, as .to() returns self
    half = to_device(t, torch.device("cpu"), torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, t.to(torch.bfloat16))
    ids = to_device(torch.arange(6).view(2, 3).t(), "cpu", torch.long)
    assert ids.stride() == (1, 3) and torch.equal(ids, torch.arange(6).view(2, 3).t())


def test_to_host_keeps_cpu_tensors():
    a, b = torch.ones(2), torch.zeros(3, dtype=torch.uint8)
    out = to_host(a, b)
    assert out[0] is a and out[1] is b
    assert to_host() == ()


def _bytes(pixels: torch.Tensor) -> list[bytes]:
    """The 8-bit images of ``pixels`` [B, 3, H, W] as numpy makes them (diffusers' numpy_to_pil):
    float32 times 255, round half to even, HWC; independent of klein_core's conversion."""
    arr = np.round(pixels.numpy().astype(np.float32) * np.float32(255)).astype(np.uint8)
    return [a.transpose(1, 2, 0).tobytes() for a in arr]


def test_pixels_and_images_as_before():
    """Decode on the device's side (check, clamp, 8-bit rounding there) equals the old order:
    pixels copied to the host unclamped, then clamped and rounded on the host."""
    tr, te, vae = build_tiny_components()
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 128, 4, 6, generator=g) * 3  # large values: the decoder overshoots [0, 1]
    # one image at a time, as the engine decodes (a batched convolution may round differently)
    raw = torch.cat([decode_to_pixels(vae, latents[i : i + 1], clamp=False) for i in range(2)])
    assert float(raw.min()) < 0 or float(raw.max()) > 1  # the clamp has something to do
    old_pixels = raw.clamp(0, 1)
    assert [np.asarray(im).tobytes() for im in to_pil(old_pixels)] == _bytes(old_pixels)
    engine = kc.Engine(tr, te, vae)
    assert torch.equal(engine.decode(latents), old_pixels)
    pictures, pixels = to_pil_and_host(torch.cat([decode_to_pixels(vae, latents[i : i + 1], host=False)
                                                  for i in range(2)]))
    assert torch.equal(pixels, old_pixels)
    assert [np.asarray(im).tobytes() for im in pictures] == _bytes(old_pixels)
    res = kc.generate(tr, te, vae, prompt="a fox", width=96, height=64, steps=2, seed=3, cache=None, batch_size=2)
    assert res.pixels.device.type == "cpu" and res.pixels.dtype == torch.float32
    assert [np.asarray(im).tobytes() for im in res.images] == _bytes(res.pixels)


def test_host_copies_on_the_cpu_are_the_tensors():
    from klein_core.transfer import HostCopies

    copies = HostCopies()
    a, b = torch.ones(2), torch.arange(3)
    assert copies.add(a) == (a,) and copies.add(b)[0] is b
    copies.wait()
    copies.wait()  # nothing queued: harmless


def test_a_batch_decode_waits_once_after_its_last_image(monkeypatch):
    """Each image's copies are queued as it is decoded and the host waits once, after the last
    (a wait per image left the GPU idle while the host queued the next decode); the images and
    pixels are those of decoding each image on its own, in order."""
    import klein_core.pipeline.engine as engine_module
    from klein_core.transfer import HostCopies

    events: list[str] = []

    class Counted(HostCopies):
        def add(self, *tensors):
            events.append(f"add{len(tensors)}")
            return super().add(*tensors)

        def wait(self):
            events.append("wait")
            super().wait()

    monkeypatch.setattr(engine_module, "HostCopies", Counted)
    tr, te, vae = build_tiny_components()
    engine = kc.Engine(tr, te, vae)
    g = torch.Generator().manual_seed(2)
    latents = torch.randn(3, 128, 4, 6, generator=g) * 2
    alone = [decode_to_pixels(vae, latents[i : i + 1], clamp=True) for i in range(3)]
    assert not torch.equal(alone[0], alone[1])  # a mix-up of the order would show
    assert torch.equal(engine.decode(latents), torch.cat(alone))
    assert events == ["add1", "add1", "add1", "wait"]
    events.clear()
    res = kc.generate(tr, te, vae, prompt="a fox", width=96, height=64, steps=2, seed=3, cache=None, batch_size=3)
    assert events.count("wait") == 1 and events[-1] == "wait" and events.count("add2") == 3, events
    assert [np.asarray(im).tobytes() for im in res.images] == _bytes(res.pixels)
    for i in range(3):  # each image is its own latents' decode, in order
        assert torch.equal(res.pixels[i : i + 1], decode_to_pixels(vae, res.latents[i : i + 1], clamp=True))
