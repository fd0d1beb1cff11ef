"""Bug hunt in the Ray Serve HTTP endpoint as a script author uses it (docs/ray.md, "Serve").

No Ray cluster: one in-process replica (``_Replica``: :class:`KleinServer` without ``@serve.batch``)
on the tiny demo models, called with real Starlette requests (what Serve hands the replica), and the
replica's batch runner (``_run_jobs``) called directly for batches. An exception that escapes the
replica's handler is what Serve answers with a 500 (and a traceback in its log); :func:`_answer`
reports it so.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from test_serve_replica import _Replica  # KleinServer without @serve.batch, run in-process

pytest.importorskip("starlette")  # Ray Serve's HTTP layer (the ray extra)

from starlette.requests import Request

from klein_core import cli as kcli
from klein_core.distributed.models import ModelSpec
from klein_core.distributed.serve import MAX_BODY_BYTES, KleinServer, ServeOptions, parse_request

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = {"prompt": "a kite", "width": 64, "height": 64, "steps": 1}


# -- helpers ---------------------------------------------------------------------------------------------

def _request(path: str, method: str, body: bytes, *, receive=None, headers: dict | None = None) -> Request:
    """A Starlette request as Serve's proxy hands it to the replica."""
    hdrs = {"content-type": "application/json", "content-length": str(len(body)), **(headers or {})}
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "scheme": "http", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
             "http_version": "1.1", "headers": [(k.encode(), v.encode()) for k, v in hdrs.items()]}
    if receive is None:
        sent = []

        async def receive():
            if sent:
                return {"type": "http.disconnect"}
            sent.append(1)
            return {"type": "http.request", "body": body, "more_body": False}

    return Request(scope, receive)


def _answer(server: KleinServer, body: dict | bytes, path: str = "/generate", method: str = "POST",
            request: Request | None = None):
    """``(status, payload dict or None, response)``; an exception escaping the handler is Serve's 500."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        response = asyncio.run(server(request or _request(path, method, data)))
    except Exception as exc:  # noqa: BLE001 - what Serve turns into "500 Internal Server Error"
        return 500, {"unhandled": f"{type(exc).__name__}: {exc}"[:300]}, None
    try:
        payload = json.loads(response.body)
    except ValueError:
        payload = None
    return response.status_code, payload, response


def _job(server: KleinServer, body: dict):
    spec = server.spec
    return parse_request(json.dumps(body).encode(), kind=spec.kind, max_tokens=spec.max_tokens, lora_dir=spec.lora_dir)


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)))


def _png(size=(96, 80), color=(200, 30, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _lora_file(path, engine, seed: int) -> None:
    """A LoRA touching one transformer module and one text-encoder module (so it changes the prompt's
    embedding too)."""
    qkv = engine.transformer.double_blocks[0].img_attn.qkv.weight
    q = engine.text_encoder.layers[0].self_attn.q_proj.weight
    g = torch.Generator().manual_seed(seed)
    save_file({
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": torch.randn(2, qkv.shape[1], generator=g),
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": torch.randn(qkv.shape[0], 2, generator=g),
        "text_encoder.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(2, q.shape[1], generator=g),
        "text_encoder.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(q.shape[0], 2, generator=g),
    }, path)


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    loras = tmp_path_factory.mktemp("loras")
    server = _Replica(ModelSpec(demo=True, lora_dir=loras), ServeOptions())
    deadline = time.monotonic() + 120
    while server.runner is None and server.load_error is None:
        assert time.monotonic() < deadline, "models never loaded"
        time.sleep(0.02)
    assert server.load_error is None
    engine = server.runner.engine
    _lora_file(loras / "style.safetensors", engine, 0)
    _lora_file(loras / "other.safetensors", engine, 1)
    _lora_file(loras / "detail_v1.5.safetensors", engine, 2)
    return server


def _weights(server: KleinServer) -> dict:
    e = server.runner.engine
    return {**{f"t.{k}": v.clone() for k, v in e.transformer.state_dict().items()},
            **{f"te.{k}": v.clone() for k, v in e.text_encoder.state_dict().items()}}


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- bugs ------------------------------------------------------------------------------------------------

def test_guidance_as_a_huge_json_integer_is_a_400(replica):
    """Was a bug: ``POST /generate`` with ``"guidance": 1000...0`` (a JSON integer of 400 digits; valid JSON,
    which Python reads as an exact int) is not answered 400: ``_float`` (rows.py) calls ``float(v)``,
    which raises OverflowError ("int too large to convert to float"), and ``_float`` catches only
    TypeError/ValueError, so the exception escapes ``parse_row`` -> ``parse_request`` ->
    ``KleinServer.__call__``: Serve answers 500 with a traceback in its log. The same value written
    ``1e400`` is a clean 400 ("guidance must be a finite number >= 0, got inf"). docs/ray.md: a bad
    field is a 400 with its message; 500 is the server's fault. (A JSONL batch row with that guidance
    stops the whole job the same way.)"""
    body = b'{"prompt": "a kite", "width": 64, "height": 64, "steps": 1, "guidance": 1' + b"0" * 400 + b"}"
    status, payload, _ = _answer(replica, body)
    assert status == 400, payload
    assert "guidance" in payload["error"], payload


@pytest.mark.parametrize("field", ["references", "loras"])
def test_a_list_field_sent_as_a_string_of_deeply_nested_json_is_a_400(replica, field):
    """Was a bug: ``POST /generate`` with ``{"<field>": "[[[[...]]]]"}`` (a *string* holding 100,000 nested
    brackets; the body itself is shallow, valid JSON) is a 500: ``_list`` (rows.py) parses a string
    field that starts with ``[`` as JSON, and ``json.loads`` raises RecursionError, which ``_list``
    does not catch (only ValueError): it escapes ``parse_request`` and ``KleinServer.__call__``.
    docs/ray.md: "400 ...: a bad request (not JSON, JSON nested too deeply, a bad field)";
    ``parse_request`` catches RecursionError for the body, but not for this second parse. Expected:
    a 400 naming the field. (A CSV batch cell of that kind stops the whole job the same way.)"""
    body = json.dumps({**SMALL, field: "[" * 100_000 + "]" * 100_000}).encode()
    status, payload, _ = _answer(replica, body)
    assert status == 400, payload
    assert field in payload["error"], payload


def test_a_lora_name_with_a_dot_gets_safetensors_added(replica):
    """Was a bug: the LoRA folder holds ``detail_v1.5.safetensors``; ``POST /generate`` with
    ``"loras": ["detail_v1.5:0.8"]`` is answered 400 ``LoRA 'detail_v1.5' not found in <lora dir>``.
    docs/ray.md (row fields): ``loras``: "list of NAME[:STRENGTH], files in --lora-dir (.safetensors
    added)", but ``lora_path`` (rows.py) adds ``.safetensors`` only when ``Path(name).suffix`` is
    empty, and ``detail_v1.5`` has the "suffix" ``.5``: a version number in a LoRA's name (very common:
    ``_v1.5``, ``-1.0``) makes it unreachable by its name. Expected: the file is found (add
    ``.safetensors`` unless the name already ends in it) and the request answers 200; the same
    request naming ``detail_v1.5.safetensors`` does."""
    full = _answer(replica, {**SMALL, "loras": ["detail_v1.5.safetensors:0.8"]})
    assert full[0] == 200, full[1]  # the file is a working LoRA
    status, payload, _ = _answer(replica, {**SMALL, "loras": ["detail_v1.5:0.8"]})
    assert status == 200, payload


def test_a_huge_body_is_refused_before_it_is_buffered(replica):
    """Was a bug: a client POSTs ``/generate`` with ``Content-Length: 16 GiB`` (a runaway upload, or a script
    that sends a video file as a reference). ``KleinServer.__call__`` first does ``await
    request.body()``, which buffers the *whole* body in the replica's memory, and only then does
    ``parse_request`` compare its length with ``MAX_BODY_BYTES`` (64 MiB): the limit bounds nothing,
    the replica runs out of memory (simulated here: the body read raises MemoryError once 512 MiB are
    held) and every request it holds fails with it. Expected: a 400 (the documented status for a bad
    request) or 413 once more than 64 MiB are announced or received, reading no further (check
    ``Content-Length`` first, and read ``request.stream()`` up to the limit)."""
    chunk = b" " * (1 << 20)  # JSON allows leading whitespace: every chunk is a valid prefix
    declared = 16 << 30
    received = [0]

    async def receive():
        if received[0] >= 512 << 20:
            raise MemoryError("simulated: the replica cannot hold the body it is buffering")
        received[0] += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": received[0] < declared}

    request = _request("/generate", "POST", b"", receive=receive, headers={"content-length": str(declared)})
    status, payload, _ = _answer(replica, b"", request=request)
    assert status in (400, 413), payload
    assert received[0] <= MAX_BODY_BYTES + len(chunk), f"read {received[0] >> 20} MiB of the body"


@pytest.mark.parametrize("literal, exact", [
    (b"9007199254740993.0", 9007199254740993),  # 2^53 + 1, an integer written with ".0"
    (b"5.0000000000000001", None),  # not an integer
], ids=["integer-past-2^53", "fraction-past-float-precision"])
def test_a_json_seed_is_read_exactly_or_refused(replica, literal, exact):
    """Was a bug: ``POST /generate`` with ``"seed": 9007199254740993.0`` is answered 200 with ``"seed":
    9007199254740992``, another seed than the one asked, and ``"seed": 5.0000000000000001`` (not an
    integer) runs seed 5: ``json.loads`` (serve.py ``parse_request``) reads JSON numbers with a
    fraction as binary floats, and ``_int`` (rows.py) takes any integral float. The same values as
    text are read exactly ("9007199254740993.0" -> ...993) or refused ("5.0000000000000001": seed must
    be an integer), as tests/test_ray_hunt2.py requires of strings ("a fraction past float precision
    ... refused"). docs/ray.md: seed is an integer 0 .. 2^64-1, and a request's seed is what makes it
    reproducible. Expected: the exact integer (``json.loads(..., parse_float=decimal.Decimal)``) or
    a 400 ``seed must be an integer``, never a silently different seed."""
    body = b'{"prompt": "a kite", "width": 64, "height": 64, "steps": 1, "seed": ' + literal + b"}"
    status, payload, _ = _answer(replica, body)
    if exact is None:
        assert status == 400 and "seed must be an integer" in payload["error"], (status, payload)
    else:
        assert status == 400 or (status == 200 and payload["seed"] == exact), (status, payload.get("seed"))


def test_an_id_of_null_is_generated_like_a_missing_one(replica):
    """Was a bug: ``POST /generate`` with ``"id": null`` (what a script sends for an optional field it left
    unset, e.g. Python ``dict(id=None, ...)``) is answered 400 ``request (id None): id is missing (a
    string naming the output file)``. docs/ray.md's field table: ``id`` is "required in batch; HTTP:
    generated", and every other optional field takes ``null`` as its default (``width``, ``height``,
    ``steps``, ``guidance``, ``seed``, ``references``, ``loras``: ``_int`` / ``_float`` / ``_list`` in
    rows.py). The message is also wrong twice over HTTP: the id is not required there and names no
    file. Cause: ``obj.setdefault("id", ...)`` in ``parse_request`` (serve.py) generates an id only
    when the key is absent. Expected: 200 with a generated ``req-...`` id."""
    status, payload, _ = _answer(replica, {**SMALL, "id": None})
    assert status == 200, payload
    assert payload["id"].startswith("req-")


@pytest.mark.parametrize("method, path", [("POST", "/health"), ("DELETE", "/ready")])
def test_a_wrong_method_on_a_known_route_is_a_405(replica, method, path):
    """Was a bug: ``POST /health`` (or ``DELETE /ready``) is answered 404 ``no route '/health'; POST /generate,
    GET /health, GET /ready``, a message that says the route does not exist while it lists it.
    docs/ray.md: "404/405: wrong route or method"; ``/generate`` gets its 405 for a wrong method, the
    other two routes do not: ``KleinServer.__call__`` (serve.py) checks ``health`` / ``ready`` only
    together with GET, and everything else that is not ``generate`` falls to the 404. Expected: 405
    for a known route and a wrong method (an ``Allow: GET`` header would help)."""
    status, payload, response = _answer(replica, b"", path=path, method=method)
    assert status == 405, payload
    assert response.headers["allow"] == "GET"


def test_review_the_exact_numbers_stay_plain_in_messages_and_other_suffixes_are_found(replica):
    """Review of the fixes above: a fraction where a list goes is named as the number it is (not
    ``Decimal('1.5')``); a 1e308 size is "far too large" as in a batch row; a LoRA file with another
    suffix (``style.sft``, a safetensors file) is found by the name as given."""
    status, payload, _ = _answer(replica, {**SMALL, "references": 1.5})
    assert status == 400 and "Decimal" not in payload["error"], payload
    status, payload, _ = _answer(replica, {**SMALL, "width": 1e308})
    assert status == 400 and "far too large" in payload["error"], payload
    lora_dir = replica.spec.lora_dir
    (lora_dir / "style.sft").write_bytes((lora_dir / "style.safetensors").read_bytes())
    status, payload, _ = _answer(replica, {**SMALL, "loras": ["style.sft:0.5"]})
    assert status == 200, payload


# -- pins ------------------------------------------------------------------------------------------------

def test_pinned_paths_and_urls_as_references_or_loras_are_never_read(replica, tmp_path):
    """Pinned: a reference is base64 data only: a path to an image that exists on the server, a
    ``file://`` or ``http://`` URL are answered 400 "not valid base64" (no server file is opened); a
    LoRA name outside the LoRA folder (``../``, an absolute path to a real LoRA file) is "not found"."""
    secret = tmp_path / "secret.png"
    secret.write_bytes(_png())
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((replica.spec.lora_dir / "style.safetensors").read_bytes())
    for ref in (str(secret), f"file://{secret}", "http://127.0.0.1:1/x.png", "/etc/passwd"):
        status, payload, _ = _answer(replica, {**SMALL, "references": [ref]})
        assert (status, payload["error"]) == (
            400, "references[1]: not valid base64 (send the image file's bytes base64-encoded)"), ref
    for name in (f"../{tmp_path.name}/outside", str(outside), "../" * 12 + "etc/passwd"):
        status, payload, _ = _answer(replica, {**SMALL, "loras": [name]})
        assert status == 400 and payload["error"].startswith(f"LoRA {name!r} not found"), (name, payload)


@pytest.mark.parametrize("fields, message", [
    ({"width": "96", "height": 64.0, "steps": " 1 "}, None),  # numbers as strings and integral floats
    ({"steps": True}, "request: steps must be an integer, got True"),
    ({"width": [64]}, "request: width must be an integer, got [64]"),
    ({"seed": {"value": 1}}, "request: seed must be an integer, got {'value': 1}"),
    ({"guidance": False}, "request: guidance must be a number, got False"),
    ({"prompt": ["a", "b"]}, "request: prompt must be a string, got list"),
    ({"references": [None]}, "request: references must be a list of strings, got [None]"),
    ({"steps": 2, "step": 3}, ("request: unknown field(s) 'step'; the fields are id, prompt, negative_prompt, "
                               "width, height, steps, guidance, seed, references, loras")),
    ({"response": "PNG"}, "response must be one of ('json', 'png'), got 'PNG'"),
])
def test_pinned_wrong_json_types_are_400s_with_the_field_named(replica, fields, message):
    """Pinned: what a script author's type mistakes get (parsed only; nothing runs): strings holding
    integers are read, booleans / lists / objects where a number goes, unknown (misspelt) fields and a
    wrong ``response`` are refused naming the field."""
    body = json.dumps({**SMALL, **fields}).encode()
    spec = replica.spec
    if message is None:
        job = parse_request(body, kind=spec.kind, max_tokens=spec.max_tokens, lora_dir=spec.lora_dir)
        assert (job.row.width, job.row.height, job.row.steps) == (96, 64, 1)
        return
    with pytest.raises(ValueError) as info:
        parse_request(body, kind=spec.kind, max_tokens=spec.max_tokens, lora_dir=spec.lora_dir)
    assert str(info.value) == message


def test_pinned_a_request_equals_klein_generate_and_says_what_ran(replica, tmp_path):
    """Pinned: the same settings as ``klein-generate`` (a reference sent base64 vs ``--ref`` a file, a
    distilled model given guidance 3, a size from the reference) give the same pixels; the answer says
    what ran (size from the reference, guidance 1 as the engine ran it, the seed); the PNG carries the
    CLI's parameters with equal values for every setting (``speed`` included: both run ``fast``)."""
    ref = tmp_path / "ref.png"
    ref.write_bytes(_png((100, 70)))
    out = tmp_path / "cli.png"
    assert kcli.main(["--demo", "--prompt", "a red fox", "--steps", "1", "--seed", "77", "--guidance", "3",
                      "--ref", str(ref), "--out", str(out), "-q"]) == 0
    status, payload, _ = _answer(replica, {"prompt": "a red fox", "steps": 1, "seed": 77, "guidance": 3,
                                           "references": [base64.b64encode(ref.read_bytes()).decode()]})
    assert status == 200, payload
    assert (payload["width"], payload["height"], payload["steps"], payload["guidance"], payload["seed"]) == (
        96, 64, 1, 1.0, 77)
    served = Image.open(io.BytesIO(base64.b64decode(payload["image_base64"])))
    cli = Image.open(out)
    assert np.array_equal(np.asarray(served), np.asarray(cli))
    sp, cp = json.loads(served.text["parameters"]), json.loads(cli.text["parameters"])
    for key in ("prompt", "negative_prompt", "width", "height", "steps", "guidance", "seed", "reference_sizes",
                "loras", "model_kind", "dtype", "quantize", "max_tokens", "ref_mode", "vae_tile", "decode_tiles",
                "speed"):
        assert sp[key] == cp[key], key
    assert served.text["Software"] == cli.text["Software"]


def test_pinned_one_batch_of_mixed_loras_failures_and_a_cancel_answers_each_on_its_own(replica):
    """Pinned: one ``@serve.batch`` call (``_run_jobs``) holding a request with LoRA ``style`` (which also
    changes the text encoder), one with ``other``, two without (one of them with the same prompt and
    seed as the ``style`` one), a request whose 1x1 reference fails inside the engine, and one whose
    client went away before it ran: the failing one is a 400, the abandoned one a 499 that never ran,
    the others are 200 and equal the same requests run alone; no LoRA is left in the weights and the
    prompt cache gives no LoRA's embedding to a plain request."""
    before = _weights(replica)
    tiny = base64.b64encode(_png((1, 1))).decode()
    bodies = [
        {**SMALL, "id": "plain-a", "prompt": "a lighthouse", "seed": 5},
        {**SMALL, "id": "style", "prompt": "a lighthouse", "seed": 5, "loras": ["style"]},
        {**SMALL, "id": "bad-ref", "references": [tiny]},
        {**SMALL, "id": "other", "prompt": "a lighthouse", "seed": 5, "loras": ["other:0.7"], "width": 80},
        {**SMALL, "id": "gone", "seed": 9},
        {**SMALL, "id": "plain-b", "prompt": "a lighthouse", "seed": 5},
    ]
    jobs = [_job(replica, b) for b in bodies]
    jobs[4].cancelled.set()
    ran = []
    real = replica.runner.run

    def recording(row, images, *, callback=None):
        ran.append(row.id)
        return real(row, images, callback=callback)

    replica.runner.run = recording
    try:
        outcomes = replica._run_jobs(jobs)
    finally:
        del replica.runner.run
    assert [o.get("status", 200) for o in outcomes] == [200, 200, 400, 200, 499, 200], outcomes
    assert [o.get("id") for o in outcomes] == ["plain-a", "style", None, "other", None, "plain-b"]
    assert "gone" not in ran and "both sides must be at least 64 px" in outcomes[2]["error"]
    assert {o["batch_size"] for o in outcomes if "png" in o} == {6}
    images = {o["id"]: _pixels(o["png"]) for o in outcomes if "png" in o}
    assert np.array_equal(images["plain-a"], images["plain-b"])
    assert not np.array_equal(images["plain-a"], images["style"])
    for i in (1, 3, 0):  # alone, after the batch: the LoRA ones first, then a plain one
        (alone,) = replica._run_jobs([_job(replica, bodies[i])])
        assert np.array_equal(_pixels(alone["png"]), images[bodies[i]["id"]]), bodies[i]["id"]
    assert _same_weights(before, _weights(replica))


def test_pinned_a_request_abandoned_mid_run_takes_its_lora_with_it(replica):
    """Pinned: a client that goes away while its request runs with a LoRA merged (the replica's cancel
    flag set after its first step): the run stops (499), the LoRA is removed, and the next request
    without a LoRA gives the image it gave before."""
    plain_body = {**SMALL, "id": "p", "prompt": "a harbour", "seed": 11}
    (first,) = replica._run_jobs([_job(replica, plain_body)])
    before = _weights(replica)
    job = _job(replica, {**plain_body, "id": "s", "loras": ["style"], "steps": 50})
    steps = []
    real = replica.runner.run

    def client_leaves(row, images, *, callback=None):
        def each(step, total, latents, **kw):
            steps.append(step)
            job.cancelled.set()  # what the handler's CancelledError does
            return callback(step, total, latents, **kw)

        return real(row, images, callback=each)

    replica.runner.run = client_leaves
    try:
        (outcome,) = replica._run_jobs([job])
    finally:
        del replica.runner.run
    assert outcome == {"error": "cancelled by the client", "status": 499} and steps == [1]
    assert _same_weights(before, _weights(replica))
    (after,) = replica._run_jobs([_job(replica, plain_body)])
    assert np.array_equal(_pixels(after["png"]), _pixels(first["png"]))


# -- left alone last session, now mended ---------------------------------------------------------------

def test_a_reference_in_line_wrapped_base64_is_read_as_the_same_image(replica):
    """Was a bug: a reference encoded as ``base64 ref.png`` writes it (76 columns, ``\\n``) or as MIME
    writes it (``\\r\\n``) was a 400 "not valid base64". The line breaks are layout: the request now
    answers with the same pixels as the unwrapped one; a character outside the alphabet is still a
    400 naming the reference."""
    ref = base64.b64encode(_png((80, 64))).decode()
    wrapped = "\n".join(ref[i:i + 76] for i in range(0, len(ref), 76)) + "\n"
    mime = "\r\n".join(ref[i:i + 76] for i in range(0, len(ref), 76))
    answers = [_answer(replica, {**SMALL, "references": [r], "response": "json"}) for r in (ref, wrapped, mime)]
    assert [a[0] for a in answers] == [200, 200, 200], [a[1] for a in answers]
    first = _pixels(base64.b64decode(answers[0][1]["image_base64"]))
    for _, payload, _ in answers[1:]:
        assert np.array_equal(_pixels(base64.b64decode(payload["image_base64"])), first)
    status, payload, _ = _answer(replica, {**SMALL, "references": [ref[:40] + "*" + ref[40:]]})
    assert status == 400 and payload["error"].endswith("references[1]: not valid base64 (send the image file's "
                                                       "bytes base64-encoded)"), payload


def test_a_request_with_more_loras_than_a_replica_keeps_loaded_is_a_400(replica):
    """Was a bug: a request could list any number of LoRAs (each read from disk and applied for that
    request; a replica keeps 8 loaded), so one small body could make a replica read files thousands
    of times. Nine are now a 400 saying at most 8; eight are taken."""
    status, payload, _ = _answer(replica, {**SMALL, "loras": ["style:0.1"] * 9})
    assert status == 400 and payload["error"] == "request: 9 LoRAs; at most 8", payload
    status, payload, _ = _answer(replica, {**SMALL, "loras": ["style:0.1"] * 8})
    assert status == 200, payload


def test_a_request_is_parsed_off_the_event_loop(replica, monkeypatch):
    """Was a bug: ``parse_request`` (which decodes up to 64 MiB of base64 references) ran on the
    replica's event loop, so while it ran, ``/health`` and every other request of the replica
    waited. It now runs in a worker thread, and the request is answered as before."""
    from klein_core.distributed import serve

    threads = []

    def recording(*args, **kwargs):
        threads.append(threading.current_thread())
        return parse_request(*args, **kwargs)

    monkeypatch.setattr(serve, "parse_request", recording)

    async def call():
        loop_thread = threading.current_thread()
        body = json.dumps(SMALL).encode()
        return loop_thread, await replica(_request("/generate", "POST", body))

    loop_thread, response = asyncio.run(call())
    assert response.status_code == 200
    assert len(threads) == 1 and threads[0] is not loop_thread
