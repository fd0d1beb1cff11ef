"""CUDA-graph replay of the text encoder under ``speed="compile"`` (klein_core.accel.text_graph), on the CPU.

A CUDA graph cannot be recorded here, so the recording step (``GraphedTextForward._record``) is
replaced by a stand-in that "replays" by running the eager forward on the static inputs into the
static output, the contract a real graph keeps. Everything around it runs as on a GPU: when a call
may replay, which graph it takes, re-recording when the weights move, the limit on graphs, a
capture failure, the copy handed to the caller. The real recording is compared with the plain path
on a GPU (tests/gpu/test_gpu_fast.py::test_text_encoder_graph_replay).
"""

from __future__ import annotations

import contextlib
import importlib
import logging

import pytest
import torch
from text_encoder_files import fresh_dynamo, tokens  # noqa: F401 - fresh_dynamo is autouse

import klein_core
from klein_core import testing as demo
from klein_core.accel import fast, speed, text_graph
from klein_core.accel.text_encoder import disable_fast_text_encoder, enable_fast_text_encoder
from klein_core.accel.text_graph import (
    MAX_GRAPHS,
    MAX_MOVES,
    GraphedTextForward,
    graphed_forward,
    release_text_graphs,
)
from klein_core.lora import load_lora
from klein_core.lora.apply import with_loras
from klein_core.memory.placement import StagePlacer


@pytest.fixture
def cpu_graphs(monkeypatch):
    """Replay allowed on the CPU, with a stand-in recorder; returns the list of recordings."""
    recorded = []
    original = GraphedTextForward._check

    def check(self, input_ids, attention_mask, activations, left_padded):
        why, weights = original(self, input_ids, attention_mask, activations, left_padded)
        return (None if why == "not on a CUDA device" else why), weights

    def record(self, ids, mask, left_padded):
        out = self._eager(ids, mask, None, left_padded=left_padded)
        recorded.append((ids, mask))

        def replay():  # a real graph writes its output's memory whatever the mode: no inference-tensor check
            with torch.inference_mode():
                out.copy_(self._eager(ids, mask, None, left_padded=left_padded))
        return replay, out

    monkeypatch.setattr(GraphedTextForward, "_check", check)
    monkeypatch.setattr(GraphedTextForward, "_record", record)
    return recorded


@contextlib.contextmanager
def _graphed(te, compiled=False):
    """Replay set up on ``te`` for the block (its forward yielded; the plain path again after):
    over its plain forward (no tracing: fast), or ``compiled`` as under speed="compile" (dynamo's
    eager backend, with the compile timer's hooks)."""
    if compiled:
        enable_fast_text_encoder(te, compile_backend="eager")
    else:
        enable_fast_text_encoder(te, compile=False, graphs=True)
    forward = graphed_forward(te)
    assert forward is not None
    try:
        yield forward
    finally:
        disable_fast_text_encoder(te)


def test_compile_and_fast_set_up_replay_and_plain_removes_it():
    te = demo.tiny_text_encoder()
    speed.apply_speed(None, None, "compile", te)
    assert isinstance(graphed_forward(te), GraphedTextForward)
    speed.apply_speed(None, None, "fast", te)  # replay of the plain forward, nothing compiled
    assert isinstance(graphed_forward(te), GraphedTextForward) and not fast.is_compiled(te.layers[0])
    speed.apply_speed(None, None, "plain", te)
    assert graphed_forward(te) is None and "forward" not in te.__dict__
    enable_fast_text_encoder(te, compile_backend="eager", graphs=False)
    assert graphed_forward(te) is None
    enable_fast_text_encoder(te, compile=False)  # the plain path, as before graphs existed
    assert graphed_forward(te) is None and not fast.is_compiled(te.layers[0])
    enable_fast_text_encoder(te, compile=False, graphs=True)  # replay of the plain forward
    assert graphed_forward(te) is not None and not fast.is_compiled(te.layers[0])
    disable_fast_text_encoder(te)
    assert graphed_forward(te) is None


def test_on_the_cpu_it_never_records_and_gives_the_plain_features():
    te = demo.tiny_text_encoder()
    ids, mask = tokens()
    plain = te.encode(ids, mask)
    with _graphed(te, compiled=True) as forward:
        assert torch.equal(te.encode(ids, mask), plain)
        with torch.no_grad():
            assert forward.ineligible(ids, mask, None, False) == "not on a CUDA device"
        assert (forward.captures, forward.replays) == (0, 0)


def test_the_reasons_to_run_eagerly():
    te = demo.tiny_text_encoder()
    ids, mask = tokens()
    with _graphed(te, compiled=True) as forward:
        assert forward.ineligible(ids, mask, None, False) == "autograd is on"  # outside encode's no_grad
        with torch.no_grad():
            assert forward.ineligible(ids, mask, torch.float64, False).startswith("an activations dtype")
            assert forward.ineligible(ids, mask, None, None).startswith("the padding side")
            # the compile timer's own hooks do not count; a LoRA branch's do
            assert forward.ineligible(ids, mask, None, False) == "not on a CUDA device"
            handle = te.layers[3].mlp.register_forward_hook(lambda *a: None)
            assert forward.ineligible(ids, mask, None, False) == "a hook on Qwen3MLP"
            handle.remove()
            forward.disabled = "capture failed (stand-in)"
            assert forward.ineligible(ids, mask, None, False) == "capture failed (stand-in)"


def test_replays_other_prompts_of_the_same_shape_and_hands_out_copies(cpu_graphs):
    te = demo.tiny_text_encoder()
    ids, mask = tokens()
    other_ids, other_mask = tokens(("an old boat", "rain on a window"))  # same shape, other tokens
    plain, plain_other = te.encode(ids, mask), te.encode(other_ids, other_mask)
    with _graphed(te, compiled=True) as forward:
        first = te.encode(ids, mask)
        other = te.encode(other_ids, other_mask)
        again = te.encode(ids, mask)
    assert (forward.captures, forward.replays) == (1, 3)
    assert torch.equal(first, plain) and torch.equal(again, plain) and torch.equal(other, plain_other)
    assert not torch.equal(first, other)  # the first result was not overwritten by the later replays
    (entry,) = forward.graphs.values()
    assert first.data_ptr() != entry.out.data_ptr()


def test_one_graph_per_shape_at_most_max_graphs(cpu_graphs):
    te = demo.tiny_text_encoder()
    shapes = [(("a fox",), 40), (("a fox", "a cat"), 40), (("a fox",), 48)]
    with _graphed(te) as forward:
        outs = {}
        for prompts, length in shapes + shapes[:1]:
            ids, mask = tokens(prompts, length)
            outs[(prompts, length)] = (te.encode(ids, mask), ids, mask)
    assert MAX_GRAPHS == 2 and len(forward.graphs) == MAX_GRAPHS
    assert forward.captures == 4  # the first shape was evicted by the third, so recorded again
    for out, ids, mask in outs.values():
        assert torch.equal(out, te.encode(ids, mask))


def test_weights_at_new_addresses_are_recorded_again_then_replay_is_given_up(cpu_graphs, caplog):
    te = demo.tiny_text_encoder()
    ids, mask = tokens()
    layer = te.layers[0].mlp.down_proj
    with _graphed(te) as forward:
        te.encode(ids, mask)
        for move in range(1, MAX_MOVES + 2):
            # replaced by a tensor elsewhere (as a staged copy would be), with other values
            layer.weight = torch.nn.Parameter(layer.weight.detach() * 1.5, requires_grad=False)
            with caplog.at_level(logging.INFO, logger=text_graph.__name__):
                out = te.encode(ids, mask)
            assert forward.moves == move
            with torch.no_grad():
                ref = forward._eager(ids, mask, None, left_padded=False)
            assert torch.equal(out, ref), move  # never the old weights' result
        assert forward.captures == 1 + MAX_MOVES
        assert forward.disabled == "its weights move between calls"
        assert any("no CUDA graph replay" in r.getMessage() for r in caplog.records)


def test_a_weight_changed_in_place_is_read_at_replay(cpu_graphs):
    te = demo.tiny_text_encoder()
    ids, mask = tokens()
    with _graphed(te) as forward:
        before = te.encode(ids, mask)
        with torch.no_grad():
            te.layers[1].self_attn.o_proj.weight.mul_(2.0)  # as a merged LoRA changes it
        after = te.encode(ids, mask)
    assert forward.captures == 1 and forward.replays == 2
    assert not torch.equal(before, after)
    assert torch.equal(after, te.encode(ids, mask))


def test_a_capture_failure_runs_eagerly_from_then_on_with_one_warning(cpu_graphs, monkeypatch, caplog):
    def fail(self, ids, mask, left_padded):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing (stand-in)")

    monkeypatch.setattr(GraphedTextForward, "_record", fail)
    te = demo.tiny_text_encoder()
    ids, mask = tokens()
    plain = te.encode(ids, mask)
    with _graphed(te) as forward, caplog.at_level(logging.WARNING, logger=text_graph.__name__):
        outs = [te.encode(ids, mask) for _ in range(3)]
    assert all(torch.equal(o, plain) for o in outs)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "operation not permitted" in warnings[0], warnings
    assert forward.disabled.startswith("capture failed") and not forward.graphs


def test_a_lora_copy_gets_its_own_forward_and_runs_its_branches(cpu_graphs):
    te = demo.tiny_text_encoder()
    ids, mask = tokens()
    with _graphed(te, compiled=True) as forward:
        base = te.encode(ids, mask)
        proj = te.layers[0].self_attn.q_proj
        g = torch.Generator().manual_seed(1)
        lora = load_lora({"text_encoder.model.layers.0.self_attn.q_proj.lora_A.weight":
                          torch.randn(4, proj.in_features, generator=g),
                          "text_encoder.model.layers.0.self_attn.q_proj.lora_B.weight":
                          torch.randn(proj.out_features, 4, generator=g)})
        copy = with_loras(te, (lora, 1.0))
        copied = graphed_forward(copy)
        assert copied is not None and copied is not forward and copied.encoder is copy
        out = copy.encode(ids, mask)
        assert copied.captures == 0 and copied.replays == 0  # its LoRA branch is a hook: eager
        assert not torch.equal(out, base)
        assert torch.equal(te.encode(ids, mask), base)
        assert forward.captures == 1  # the base encoder still replays its own graph


def test_graphs_are_dropped_when_the_weights_leave_the_device(cpu_graphs, monkeypatch):
    """An offloaded encoder keeps no graph memory on the GPU: the first call that finds its weights
    elsewhere drops the graphs, and runs eagerly."""
    te = demo.tiny_text_encoder()
    ids, mask = tokens()
    with _graphed(te) as forward:
        te.encode(ids, mask)
        assert len(forward.graphs) == 1
        # the weights found off the input's device (a host offloaded part of the encoder)
        monkeypatch.setattr(GraphedTextForward, "_check", lambda self, *a: (None, None))
        out = te.encode(ids, mask)
        assert not forward.graphs and forward.replays == 1  # the first call's replay only
        with torch.no_grad():
            assert torch.equal(out, forward._eager(ids, mask, None, left_padded=False))


def test_replay_of_the_plain_forward_gives_the_plain_features(cpu_graphs):
    te = demo.tiny_text_encoder()
    ids, mask = tokens()
    other_ids, other_mask = tokens(("an old boat", "rain on a window"))
    plain, plain_other = te.encode(ids, mask), te.encode(other_ids, other_mask)
    with _graphed(te) as forward:  # enable_fast_text_encoder(te, compile=False, graphs=True)
        assert torch.equal(te.encode(ids, mask), plain)
        assert torch.equal(te.encode(other_ids, other_mask), plain_other)
    assert (forward.captures, forward.replays) == (1, 2)


@pytest.mark.parametrize("quantize", ["fp8", "q8"])
def test_quantised_encoders_replay_their_forward(cpu_graphs, tmp_path, quantize):
    """An encoder loaded with fp8 layers or GGML blocks (``quantize="q8"``, the layers a GGUF file
    gives) is as eligible for replay as a bf16 one: its layers carry no hooks, and their packed
    weights and scales are part of the weights' key (each one replaced at a new address is recorded
    again, never replayed from the old memory). The real capture of these forwards is checked on a
    GPU (tests/gpu/test_gpu_fp8.py::test_quantised_text_encoder_graph_replay)."""
    from safetensors.torch import save_file

    from klein_core.quant.fp8 import fp8_layers
    from klein_core.quant.ggml import ggml_layers

    path = tmp_path / "qwen_3_4b.safetensors"
    save_file({"model." + k: v.contiguous() for k, v in demo.tiny_text_encoder().state_dict().items()}, str(path))
    te = klein_core.load_text_encoder(path, device="cpu", dtype=torch.float32, quantize=quantize)
    assert (fp8_layers if quantize == "fp8" else ggml_layers)(te)
    ids, mask = tokens()
    other_ids, other_mask = tokens(("an old boat", "rain on a window"))
    plain, plain_other = te.encode(ids, mask), te.encode(other_ids, other_mask)
    layer = te.get_submodule(next(iter((fp8_layers if quantize == "fp8" else ggml_layers)(te))))
    packed = {"fp8": ("_parameters", "weight"), "q8": ("_buffers", "qweight")}[quantize]
    with _graphed(te) as forward:
        with torch.no_grad():  # as encode calls it
            assert forward.ineligible(ids, mask, None, False) is None
        assert torch.equal(te.encode(ids, mask), plain)
        assert torch.equal(te.encode(other_ids, other_mask), plain_other)
        assert (forward.captures, forward.replays) == (1, 2)
        replaced = [packed, ("_buffers", "weight_scale")] if quantize == "fp8" else [packed]
        for captures, (table, name) in enumerate(replaced, start=2):
            held = getattr(layer, table)
            held[name] = held[name].clone()  # the same values at a new address
            assert torch.equal(te.encode(ids, mask), plain)
            assert forward.captures == captures, name  # recorded again, not replayed from the old memory


def test_the_default_speed_on_the_cpu_is_exactly_the_plain_path():
    te = demo.tiny_text_encoder()
    ids, mask = tokens()
    plain = te.encode(ids, mask)
    speed.apply_speed(None, None, speed.DEFAULT_SPEED, te)
    forward = graphed_forward(te)
    assert forward is not None
    assert torch.equal(te.encode(ids, mask), plain) and (forward.captures, forward.replays) == (0, 0)


def test_a_graph_recorded_under_inference_mode_replays_under_no_grad(cpu_graphs):
    # ComfyUI runs its nodes under torch.inference_mode, a script under no_grad (Engine.encode):
    # the graph's static inputs, made under the first, are written under the second.
    te = demo.tiny_text_encoder()
    ids, mask = tokens()
    other_ids, other_mask = tokens(("an old boat", "rain on a window"))
    plain, plain_other = te.encode(ids, mask), te.encode(other_ids, other_mask)
    with _graphed(te) as forward:
        with torch.inference_mode():
            first = te.encode(ids, mask)
        other = te.encode(other_ids, other_mask)
        with torch.inference_mode():
            again = te.encode(ids, mask)
    assert torch.equal(first, plain) and torch.equal(other, plain_other) and torch.equal(again, plain)
    assert (forward.captures, forward.replays) == (1, 3)


def test_threads_sharing_an_encoder_each_get_their_own_prompt(cpu_graphs, monkeypatch):
    """A graph's inputs and output are shared buffers: two threads encoding at once (a serve replica
    running two batches) must not read each other's prompt. The stand-in replay yields to the other
    thread midway, as a host thread does while the GPU runs the graph."""
    import threading
    import time

    record = GraphedTextForward._record

    def slow_record(self, ids, mask, left_padded):
        replay, out = record(self, ids, mask, left_padded)

        def slow_replay():
            time.sleep(0.002)
            replay()
        return slow_replay, out

    monkeypatch.setattr(GraphedTextForward, "_record", slow_record)
    te = demo.tiny_text_encoder()
    prompts = [("a red fox in the snow", "two cats"), ("an old boat", "rain on a window")]
    encoded = [tokens(p) for p in prompts]
    expected = [te.encode(ids, mask) for ids, mask in encoded]
    wrong = []

    def work(k):
        ids, mask = encoded[k]
        for _ in range(20):
            if not torch.equal(te.encode(ids, mask), expected[k]):
                wrong.append(k)

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    with _graphed(te):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert wrong == []


def test_a_deep_copy_gets_its_own_forward(cpu_graphs):
    import copy

    te = demo.tiny_text_encoder()
    ids, mask = tokens()
    with _graphed(te) as forward:
        plain = te.encode(ids, mask)
        twin = copy.deepcopy(te)
        copied = graphed_forward(twin)
        assert copied is not None and copied is not forward and copied.encoder is twin
        assert not copied.graphs and torch.equal(twin.encode(ids, mask), plain)
        assert copied.captures == 1 and forward.captures == 1


def test_released_graphs_are_dropped_and_count_as_moves(cpu_graphs):
    """A host offloading the encoder releases its graphs (their memory goes with the weights); each
    release counts as a move, so an encoder offloaded for every run stops recording."""
    te = demo.tiny_text_encoder()
    ids, mask = tokens()
    plain = te.encode(ids, mask)
    with _graphed(te) as forward:
        release_text_graphs(torch.nn.Sequential(te))  # nothing held: nothing counted
        assert forward.moves == 0
        for i in range(1, MAX_MOVES + 2):
            assert torch.equal(te.encode(ids, mask), plain) and forward.captures == i and len(forward.graphs) == 1
            release_text_graphs(torch.nn.Sequential(te))  # the encoder inside another module, as ComfyUI holds it
            assert not forward.graphs and forward.moves == i
        assert forward.disabled == "its weights move between calls"
        assert torch.equal(te.encode(ids, mask), plain) and forward.captures == MAX_MOVES + 1
    release_text_graphs(torch.nn.Linear(2, 2))  # no encoder: nothing to do


def test_suspended_calls_run_eagerly_and_record_nothing(cpu_graphs):
    te = demo.tiny_text_encoder()
    ids, mask = tokens()
    plain = te.encode(ids, mask)
    with _graphed(te) as forward:
        te.encode(ids, mask)
        assert len(forward.graphs) == 1
        with forward.suspended():
            assert not forward.graphs  # dropped on entry
            assert torch.equal(te.encode(ids, mask), plain) and torch.equal(te.encode(ids, mask), plain)
            with torch.no_grad():
                assert forward.ineligible(ids, mask, None, False) == text_graph.STAGED
        assert (forward.captures, forward.replays, forward.moves) == (1, 1, 0)
        assert torch.equal(te.encode(ids, mask), plain) and forward.captures == 2  # recorded again after


@pytest.mark.parametrize("in_place", [True, False], ids=["resident", "staged"])
def test_the_engine_suspends_graphs_of_an_encoder_staged_for_the_stage(cpu_graphs, monkeypatch, in_place):
    """A memory plan that copies the text encoder in for its stage (or streams it) runs it without
    graphs: the plan does not count their memory, and the weights leave after the stage. Here the
    placer is told the encoder is not in place; the CPU has no staging of its own."""
    tr, te, vae = demo.build_tiny_components()
    engine = klein_core.Engine(tr, te, vae, speed="fast", prompt_cache=None)
    monkeypatch.setattr(StagePlacer, "in_place", lambda self, component: in_place)
    forward = graphed_forward(te)
    assert forward is not None
    first = engine.encode_prompts(["a red fox"]).positive
    again = engine.encode_prompts(["a red fox"]).positive
    assert torch.equal(first, again)
    assert (forward.captures, forward.replays) == ((1, 2) if in_place else (0, 0))


def test_comfyui_offloading_the_encoder_releases_its_graphs(cpu_graphs, comfy_pack):
    """ComfyUI offloads a model through its ModelPatcher's ``detach`` (``LoadedModel.model_unload``):
    the pack's patcher drops the text encoder's graphs there, so ComfyUI frees what it counts."""
    host = importlib.import_module("klein_pack_nodes.host")
    te = demo.tiny_text_encoder()
    ids, mask = tokens()
    plain = te.encode(ids, mask)
    with _graphed(te) as forward:
        te.encode(ids, mask)
        handle = host.register_model(te, "text_encoder", torch.device("cpu"))
        assert len(forward.graphs) == 1
        handle.detach()
        assert not forward.graphs and forward.moves == 1
        assert torch.equal(te.encode(ids, mask), plain) and forward.captures == 2


def test_comfyui_detaching_a_model_it_loads_again_keeps_its_graphs(cpu_graphs, comfy_pack):
    """``load_models_gpu`` detaches a model it is about to use again with ``unpatch_all=False``
    (its weights stay where they are): every node run does this, and dropping the graphs there
    made each run record again and replay be given up after MAX_MOVES runs."""
    host = importlib.import_module("klein_pack_nodes.host")
    te = demo.tiny_text_encoder()
    ids, mask = tokens()
    with _graphed(te) as forward:
        te.encode(ids, mask)
        handle = host.register_model(te, "text_encoder", torch.device("cpu"))
        for _ in range(MAX_MOVES + 1):
            handle.detach(unpatch_all=False)
            te.encode(ids, mask)
        assert (forward.captures, forward.moves, forward.disabled) == (1, 0, None)
        assert forward.replays == MAX_MOVES + 2 and len(forward.graphs) == 1
        handle.detach(False)  # positional, as LoadedModel.model_unload passes unpatch_weights
        assert len(forward.graphs) == 1
        handle.detach(True)
        assert not forward.graphs and forward.moves == 1
