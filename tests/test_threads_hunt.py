"""Bug hunt: thread safety where klein_core and the pack really run on more than one thread.

* A Ray Serve replica (:class:`~klein_core.distributed.serve.KleinServer`) parses requests in worker
  threads (``asyncio.to_thread(parse_request, ...)``: references decoded, prompts counted) while a
  batch thread runs generations on the replica's one engine; Serve's own ``@serve.batch`` decides how
  many batches run at once. Here one replica runs in-process without a cluster: the class that
  :func:`~klein_core.distributed.serve.deployment` deploys, with Serve's real batch wrapper, and a
  stand-in for the replica context that the wrapper asks for (``max_ongoing_requests``).
* One :class:`~klein_core.pipeline.engine.Engine`, or the same loaded models, used by two threads at once.
* The bounded caches (:mod:`klein_core.pipeline.bounded_cache`: the prompt cache, the reference KV
  cache), documented as thread-safe and shared by every engine of a process.

Interleavings are forced with events and barriers (a function patched to wait at the critical
point), never by sleeping and hoping; every thread is joined with a timeout, so that a deadlock
fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import types
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from test_serve_replica import _Request  # what the replica reads of a Starlette request

from klein_core.distributed import serve as serve_module
from klein_core.distributed.models import ModelSpec
from klein_core.distributed.rows import RowError, parse_row
from klein_core.distributed.serve import ServeOptions, parse_request

pytest.importorskip("starlette")  # Ray Serve's HTTP layer (the ray extra)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WAIT = 5.0  # seconds a forced interleaving waits at most for a step that is known to come
PEER = 1.0  # seconds one thread waits for another to reach its critical point (never reached once fixed)


# -- helpers ---------------------------------------------------------------------------------------------

def _serve_class(monkeypatch, options: ServeOptions) -> type:
    """The replica class :func:`deployment` deploys (Serve's real ``@serve.batch`` on
    ``generate_batch``), usable in-process: the batch wrapper asks the replica context for
    ``max_ongoing_requests``, which a replica run without Ray does not have."""
    serve = pytest.importorskip("ray.serve")
    context = types.SimpleNamespace(_deployment_config=types.SimpleNamespace(max_ongoing_requests=options.max_ongoing))
    monkeypatch.setattr(serve, "get_replica_context", lambda: context)
    app = serve_module.deployment(ModelSpec(demo=True), options)
    return app._bound_deployment.func_or_class


def _loaded(server) -> None:
    done = threading.Event()

    def poll():
        while server.runner is None and server.load_error is None:
            done.wait(0.02)
        done.set()

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    t.join(60)
    assert server.load_error is None and server.runner is not None, "the replica's models never loaded"


async def _post_as(server, model_id: str, body: dict):
    """One ``POST /generate`` carrying ``serve_multiplexed_model_id: model_id`` (Serve's proxy puts the
    header's value in the request context, which ``@serve.batch`` reads)."""
    from ray.serve.context import _RequestContext, _serve_request_context

    _serve_request_context.set(_RequestContext(multiplexed_model_id=model_id))
    return await server(_Request("/generate", "POST", body))


def _pixels(response) -> np.ndarray:
    payload = json.loads(response.body)
    assert response.status_code == 200, payload
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(payload["image_base64"]))))


def _style_lora(folder, transformer) -> None:
    """A transformer-only LoRA on the first double block's image qkv, strong enough to change pixels."""
    qkv = transformer.double_blocks[0].img_attn.qkv.weight
    g = torch.Generator().manual_seed(0)
    save_file({"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": torch.randn(2, qkv.shape[1], generator=g),
               "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": torch.randn(qkv.shape[0], 2, generator=g)},
              folder / "style.safetensors")


def _png_b64(side: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (120, 60, 30)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _parse(body: dict):
    return parse_request(json.dumps(body).encode(), kind="distilled", max_tokens=512, lora_dir=None)


# -- Serve: generations on the replica's one engine ---------------------------------------------------------

def test_a_plain_request_batched_beside_a_lora_request_of_another_model_id_gets_no_lora(monkeypatch, tmp_path):
    """Was a bug: a replica runs two generations at once on its one engine when requests carry different
    ``serve_multiplexed_model_id`` headers (any HTTP client or gateway may send one): ``@serve.batch``
    splits such a batch into sub-batches and runs them concurrently, each ``generate_batch`` in its own
    thread, and :class:`KleinServer` never serialises them. A LoRA merged into the shared weights for
    one request is then in the other request's image too: a plain request comes back styled."""
    options = ServeOptions(max_batch=2, batch_wait_s=1.0)
    cls = _serve_class(monkeypatch, options)
    spec = ModelSpec(demo=True, lora_dir=tmp_path)
    server = cls(spec, options)
    _loaded(server)
    engine = server.runner.engine
    _style_lora(tmp_path, engine.transformer)
    plain = {"prompt": "a lighthouse", "width": 64, "height": 64, "steps": 1}
    alone = engine.generate  # the unpatched method, for the reference image

    alone_plain = np.asarray(server.runner.run(parse_row({"id": "a", **plain, "seed": 7}), []).result.images[0])
    alone_styled = np.asarray(server.runner.run(parse_row({"id": "b", **plain, "seed": 7, "loras": ["style"]}),
                                                []).result.images[0])
    assert not np.array_equal(alone_plain, alone_styled)  # the LoRA shows in the pixels

    lora_in, plain_in, plain_done = threading.Event(), threading.Event(), threading.Event()

    def generate(request, **kw):
        if request.settings.seed == 1:  # the LoRA request, its LoRA merged now: let the plain one run first
            lora_in.set()
            if plain_in.wait(PEER):
                plain_done.wait(WAIT)
            return alone(request, **kw)
        if lora_in.wait(PEER):  # the plain request: runs while the LoRA request is inside its run, if it is
            plain_in.set()
        try:
            return alone(request, **kw)
        finally:
            plain_done.set()

    monkeypatch.setattr(engine, "generate", generate)

    async def both():
        return await asyncio.gather(
            _post_as(server, "styled", {"id": "styled", **plain, "seed": 1, "loras": ["style"]}),
            _post_as(server, "plain", {"id": "plain", **plain, "seed": 7}))

    styled, answered = asyncio.run(asyncio.wait_for(both(), 30))
    assert styled.status_code == 200, styled.body
    got = _pixels(answered)
    assert not np.array_equal(got, alone_styled), "the plain request's image is the one its seed gives with the LoRA"
    assert np.array_equal(got, alone_plain)


# -- Serve: requests parsed in threads ---------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_a_decompression_bomb_parsed_beside_another_request_is_still_refused(monkeypatch):
    """Was a bug: two requests parsed at once (each in its own worker thread) let a decompression bomb through.
    ``open_reference`` turns PIL's DecompressionBombWarning into an error with ``warnings.catch_warnings``,
    which swaps the process-wide filter list and is not thread-safe: when the other request's block
    ends first it restores the list it saved (without the error filter) while the bomb is being opened,
    so the bomb is decoded (up to twice PIL's limit: ~180 megapixels, half a GB) instead of a 400, and
    the error filter the other thread saved is left installed in the whole process afterwards."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 64 * 64)  # an 80 x 80 picture is then a "bomb"
    monkeypatch.setattr(warnings, "filters", list(warnings.filters))  # whatever happens is undone here
    with pytest.raises(RowError, match="too large to read safely"):
        _parse({"id": "bomb", "references": [_png_b64(80)]})  # alone: refused, as documented

    real_open = Image.open
    small_in, bomb_in, small_out = threading.Event(), threading.Event(), threading.Event()

    def gated_open(fp, *args, **kwargs):
        if threading.current_thread().name == "small":
            small_in.set()  # the small request is inside its catch_warnings block
            bomb_in.wait(PEER)  # and stays there until the bomb's request is inside its own
        else:
            bomb_in.set()
            small_out.wait(WAIT)  # the bomb is opened once the small request has left its block
        return real_open(fp, *args, **kwargs)

    monkeypatch.setattr(Image, "open", gated_open)

    def small():
        threading.current_thread().name = "small"
        try:
            return _parse({"id": "small", "references": [_png_b64(64)]})
        finally:
            small_out.set()

    def bomb():
        threading.current_thread().name = "bomb"
        small_in.wait(WAIT)
        return _parse({"id": "bomb", "references": [_png_b64(80)]})

    pool = ThreadPoolExecutor(2)
    try:
        small_job, bomb_job = pool.submit(small), pool.submit(bomb)
        assert small_job.result(10).row.id == "small"
        try:
            accepted = bomb_job.result(10)
        except RowError as exc:
            assert "too large to read safely" in str(exc)
        else:
            pytest.fail(f"a {accepted.images[0].size} picture over PIL's limit was decoded, not refused")
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# -- one Engine, two threads -------------------------------------------------------------------------------

def test_one_engine_generating_in_two_threads_at_once_gives_each_its_image(monkeypatch):
    """Was a bug: ``Engine.generate`` called from two threads at once on one engine (a replica's engine when
    two batches run, an app sharing one engine between request threads) fails with ``KeyError:
    'text_encoder'``. ``Engine._stage`` keeps the component it placed in ``self._placed``, one dict
    for every thread: both threads set the entry, the first to finish deletes it, the second's
    ``del`` raises. (In the other order a thread finds the other's entry and computes with a
    placement that the other thread takes away when its stage ends: on a GPU with a staged plan,
    weights moved back to the CPU under it.)"""
    import contextlib

    import klein_core as kc
    from klein_core.pipeline import engine as engine_module
    from klein_core.testing.tiny import build_tiny_components

    engine = kc.Engine(*build_tiny_components(), prompt_cache=None)

    def request(seed):
        return kc.GenerationRequest("a kite", settings=kc.Settings(64, 64, 1, None, seed, 1))

    alone = {seed: np.asarray(engine.generate(request(seed)).images[0]) for seed in (1, 2)}
    both_placed = threading.Barrier(2, timeout=PEER)
    placer = engine_module.StagePlacer

    class MeetingPlacer(placer):
        @contextlib.contextmanager
        def stage(self, component):
            with super().stage(component) as placed:
                if component == "text_encoder":
                    with contextlib.suppress(threading.BrokenBarrierError):
                        both_placed.wait()  # both threads have placed the encoder before either records it
                yield placed

    both_recorded = threading.Barrier(2, timeout=PEER)
    encode = engine_module.encode_prompts

    def meeting_encode(*args, **kwargs):  # inside the stage: both have recorded their placement
        with contextlib.suppress(threading.BrokenBarrierError):
            both_recorded.wait()
        return encode(*args, **kwargs)

    monkeypatch.setattr(engine_module, "StagePlacer", MeetingPlacer)
    monkeypatch.setattr(engine_module, "encode_prompts", meeting_encode)
    got: dict = {}

    def work(seed):
        try:
            got[seed] = np.asarray(engine.generate(request(seed)).images[0])
        except BaseException as exc:  # noqa: BLE001 - reported below
            got[seed] = exc

    threads = [threading.Thread(target=work, args=(seed,), daemon=True) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a run never finished"
    failed = {seed: repr(v) for seed, v in got.items() if isinstance(v, BaseException)}
    assert not failed, failed
    for seed in (1, 2):
        assert np.array_equal(got[seed], alone[seed]), seed


# -- the bounded caches ----------------------------------------------------------------------------------

def test_the_prompt_caches_size_can_be_read_while_another_thread_stores_an_embedding():
    """Was a bug: :class:`BoundedCache` is documented as thread-safe, and ``len(cache)`` takes its lock, but
    ``cache.nbytes()`` iterates the entries without it: a thread reporting the size of the prompt
    cache (a health or metrics endpoint, a log line) while a generation stores an embedding fails
    with ``RuntimeError: OrderedDict mutated during iteration``."""
    from klein_core.pipeline.prompts import PromptCache, TextOptions
    from klein_core.testing.tiny import tiny_text_encoder

    encoder = tiny_text_encoder()
    cache = PromptCache()
    options = TextOptions(max_tokens=64)
    cache.encode(encoder, ["a red fox", "a green owl"], options)
    one = cache.nbytes() // 2
    measuring, stored = threading.Event(), threading.Event()
    size = cache._size

    def gated_size(value):
        if threading.current_thread().name == "reporter":  # the reporter is part way through the entries
            measuring.set()
            stored.wait(PEER)
        return size(value)

    cache._size = gated_size  # the size function the cache was made with, made to wait in one thread
    result: list = []

    def report():
        threading.current_thread().name = "reporter"
        try:
            result.append(cache.nbytes())
        except RuntimeError as exc:
            result.append(exc)

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    assert measuring.wait(WAIT)
    try:
        cache.encode(encoder, ["a blue car"], options)  # a generation stores its embedding meanwhile
    finally:
        stored.set()
    reporter.join(WAIT)
    assert not reporter.is_alive(), "nbytes() never returned"
    assert not isinstance(result[0], Exception), f"nbytes() raised {result[0]!r}"
    assert result[0] in (2 * one, 3 * one)  # the size before the store, or after it


# -- Pinned ------------------------------------------------------------------------------------------------

def test_pinned_two_threads_generating_on_the_same_models_each_get_their_own_image(tmp_path):
    """Pinned: ``kc.generate`` called from two threads at once on the same loaded models (a threaded web
    app), one of them through a ``with_loras`` copy of the transformer (what the LoRA node makes), both
    inside their denoising loop at the same time and sharing the default prompt and KV caches: each
    thread gets exactly the image it gets alone, and the LoRA never reaches the plain run."""
    import klein_core as kc
    from klein_core.testing.tiny import build_tiny_components

    tr, te, vae = build_tiny_components()
    _style_lora(tmp_path, tr)
    styled_tr = kc.with_loras(tr, kc.load_lora(tmp_path / "style.safetensors"))
    base = {"prompt": "a lighthouse", "width": 64, "height": 64, "steps": 3, "seed": 5}

    def run(transformer, callback=None):
        return np.asarray(kc.generate(transformer, te, vae, callback=callback, **base).images[0])

    alone = {"plain": run(tr), "styled": run(styled_tr)}
    assert not np.array_equal(alone["plain"], alone["styled"])
    both_inside = threading.Barrier(2, timeout=WAIT)

    def callback(step, total, latents):
        if step == 1:
            both_inside.wait()  # the two runs are in their loops at once
        return True

    got: dict = {}

    def work(name, transformer):
        try:
            got[name] = run(transformer, callback)
        except BaseException as exc:  # noqa: BLE001 - reported below
            got[name] = exc

    threads = [threading.Thread(target=work, args=("plain", tr), daemon=True),
               threading.Thread(target=work, args=("styled", styled_tr), daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a run never finished"
    for name in ("plain", "styled"):
        assert isinstance(got[name], np.ndarray), got[name]
        assert np.array_equal(got[name], alone[name]), name


def test_pinned_requests_without_a_model_id_run_one_generation_at_a_time(monkeypatch):
    """Pinned: with Serve's real ``@serve.batch``, requests that carry no multiplexed model id (the
    usual case) are batched and their generations run one after another on the replica's engine,
    each answered with the image it gets alone."""
    options = ServeOptions(max_batch=2, batch_wait_s=1.0)
    cls = _serve_class(monkeypatch, options)
    server = cls(ModelSpec(demo=True), options)
    _loaded(server)
    runner = server.runner
    bodies = [{"id": f"r{i}", "prompt": "a kite", "width": 64, "height": 64, "steps": 1, "seed": i} for i in (1, 2)]
    alone = [np.asarray(runner.run(parse_row(b), []).result.images[0]) for b in bodies]
    real_run, running, most = runner.run, [0], [0]
    lock = threading.Lock()
    other_started = threading.Event()

    def run(row, images, **kw):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            other_started.wait(0.2)  # room for a second generation to start beside this one, if it could
            other_started.set()
            return real_run(row, images, **kw)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(runner, "run", run)

    async def both():
        return await asyncio.gather(*(_post_as(server, "", b) for b in bodies))

    answers = asyncio.run(asyncio.wait_for(both(), 30))
    assert most[0] == 1
    assert [json.loads(a.body)["batch_size"] for a in answers] == [2, 2]  # one batch of both
    for answer, expected in zip(answers, alone):
        assert np.array_equal(_pixels(answer), expected)


def test_pinned_an_encoder_freed_while_another_thread_is_inside_the_cache_neither_blocks_nor_stays():
    """Pinned: the prompt cache holds entries of an in-memory encoder under a weak reference whose
    callback may run in any thread (wherever the last reference goes) while another thread is inside
    the cache, holding its lock. The callback never waits for that lock (waiting would deadlock: here
    the thread inside waits for the freeing thread), and the freed encoder's entry is dropped at the
    next call, so no later encoder can be served it."""
    import gc

    from klein_core.pipeline.prompts import PromptCache, TextOptions
    from klein_core.testing.tiny import tiny_text_encoder

    cache = PromptCache()
    options = TextOptions(max_tokens=64)
    doomed, other = tiny_text_encoder(seed=1), tiny_text_encoder(seed=2)
    cache.encode(doomed, ["a red fox"], options)
    assert len(cache) == 1
    inside, freed = threading.Event(), threading.Event()
    lookup = cache._lookup

    def gated_lookup(key, owner=None):  # called with the cache's lock held
        if threading.current_thread().name == "inside":
            inside.set()
            freed.wait(WAIT)
        return lookup(key, owner)

    cache._lookup = gated_lookup
    errors: list = []

    def encode_other():
        threading.current_thread().name = "inside"
        try:
            cache.encode(other, ["a blue car"], options)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    holder = threading.Thread(target=encode_other, daemon=True)
    holder.start()
    assert inside.wait(WAIT)

    def free():
        nonlocal doomed
        doomed = None
        gc.collect()
        freed.set()

    freer = threading.Thread(target=free, daemon=True)
    freer.start()
    freer.join(WAIT)
    assert not freer.is_alive(), "freeing the encoder waited for the cache's lock"
    holder.join(WAIT)
    assert not holder.is_alive() and not errors, errors
    assert len(cache) == 1  # only the other encoder's entry; the freed one's is gone


def test_two_threads_never_have_one_model_placed_at_once():
    """Was a bug (with the one above): nothing kept two threads from staging the same model at the same
    time. Placing a model for a stage moves its tensors (copied in, streamed; on the CPU it is in
    place, so only a GPU showed it), and the first thread to finish put them back under the other.
    Stages of one model now follow each other, also across two engines over the same models."""
    import contextlib
    import time

    import klein_core as kc
    from klein_core.pipeline import engine as engine_module
    from klein_core.testing.tiny import build_tiny_components

    models = build_tiny_components()
    engines = [kc.Engine(*models, prompt_cache=None) for _ in range(2)]
    spans: list[tuple[str, float, float]] = []
    inside: dict[str, int] = {}
    second_in = {c: threading.Event() for c in ("text_encoder", "transformer", "vae")}
    lock = threading.Lock()
    placer = engine_module.StagePlacer

    class TimedPlacer(placer):
        @contextlib.contextmanager
        def stage(self, component):
            with super().stage(component) as placed:
                start = time.monotonic()
                with lock:
                    inside[component] = n = inside.get(component, 0) + 1
                if n == 1:  # the first in waits for the second: it comes in at once, were it let in
                    second_in[component].wait(0.25)
                else:
                    second_in[component].set()
                yield placed
                spans.append((component, start, time.monotonic()))

    def run(engine, seed):
        return engine.generate(kc.GenerationRequest("a kite", settings=kc.Settings(64, 64, 1, None, seed, 1)))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "StagePlacer", TimedPlacer)
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(run, e, s) for e, s in zip(engines, (1, 2))]
            results = [f.result(timeout=30) for f in futures]
    assert len(results) == 2
    for component in ("text_encoder", "transformer", "vae"):
        mine = sorted((a, b) for c, a, b in spans if c == component)
        assert len(mine) == 2, (component, spans)
        assert mine[0][1] <= mine[1][0], f"two threads had the {component} placed at once: {mine}"


def test_a_thread_never_computes_with_another_threads_placement_of_a_model(monkeypatch):
    """Was a bug (with the two above): one Engine kept the components its stages had placed in one dict
    for every thread, so a thread starting a stage while another thread's stage of the same model was
    open took that placement as its own and computed with it, without waiting: on a GPU with a staged
    plan, with weights the other thread then moved back. Each thread now places the model for its own
    stage, after the other's stage has ended."""
    import klein_core as kc
    from klein_core.pipeline import engine as engine_module
    from klein_core.testing.tiny import build_tiny_components

    engine = kc.Engine(*build_tiny_components(), prompt_cache=None)
    placements, a_inside, b_done = [], threading.Event(), threading.Event()
    placer, encode = engine_module.StagePlacer, engine_module.encode_prompts

    class CountingPlacer(placer):
        def stage(self, component):
            placements.append((component, threading.current_thread().name))
            return super().stage(component)

    def first_waits(*args, **kwargs):  # thread A, inside its stage, lets B start and waits for it a while
        if threading.current_thread().name == "A":
            a_inside.set()
            b_done.wait(0.3)
        return encode(*args, **kwargs)

    monkeypatch.setattr(engine_module, "StagePlacer", CountingPlacer)
    monkeypatch.setattr(engine_module, "encode_prompts", first_waits)
    out: dict = {}

    def run(name):
        try:
            out[name] = engine.encode_prompts([f"prompt {name}"]).positive
        finally:
            if name == "B":
                b_done.set()

    a = threading.Thread(target=run, args=("A",), name="A", daemon=True)
    a.start()
    assert a_inside.wait(WAIT)
    b = threading.Thread(target=run, args=("B",), name="B", daemon=True)
    b.start()
    for t in (a, b):
        t.join(30)
    assert not a.is_alive() and not b.is_alive()
    assert placements == [("text_encoder", "A"), ("text_encoder", "B")], placements
    assert set(out) == {"A", "B"}
