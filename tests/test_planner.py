"""Memory planner: formulas against traced allocations, component sizes, the plan table, and the
CPU-safe parts of benchmarks/memory.py.

The activation formulas are checked against :func:`trace_activation_bytes`, which runs the real
forward pass of real-size Klein 4B/9B, Qwen3 and VAE configs on the meta device (no memory, no
compute) and counts the bytes the eager code allocates. That is a structural calibration, not a
GPU measurement (see the planner's docstring).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from script_module import load_script

from klein_core import testing as demo
from klein_core.memory.planner import (
    DEFAULT_RESERVE_BYTES,
    ComponentSize,
    MemoryPlan,
    MemoryRequest,
    ModelSizes,
    choose_plan,
    estimate,
    text_activation_bytes,
    transformer_activation_bytes,
    vae_decode_activation_bytes,
    vae_encode_activation_bytes,
)
from klein_core.memory.tiling import decode_tiled, encode_tiled
from klein_core.memory.trace import trace_activation_bytes
from klein_core.models.qwen3 import Qwen3Config, Qwen3TextEncoder
from klein_core.models.transformer import Flux2Transformer, TransformerConfig
from klein_core.models.vae import Flux2VAE, VAEConfig
from klein_core.pipeline.sampling import position_ids, text_position_ids
from klein_core.quant.fp8 import quantize_model_

REPO = Path(__file__).resolve().parent.parent
GB = 1e9

K4 = TransformerConfig(hidden_size=3072, num_heads=24, depth=5, depth_single=20, context_dim=7680,
                       mlp_hidden=9216)
K9 = TransformerConfig(hidden_size=4096, num_heads=32, depth=8, depth_single=24, context_dim=12288,
                       mlp_hidden=12288)
Q4 = Qwen3Config(hidden_size=2560, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 intermediate_size=9728, vocab_size=151936, num_layers_in_file=36)
Q8 = Qwen3Config(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 intermediate_size=12288, vocab_size=151936, num_layers_in_file=36)
VAE = VAEConfig()
EDIT = MemoryRequest(1024, 1024, references=((1024, 1024),))


# ---------------------------------------------------------------------------------------------
# Formulas against traced allocations


@pytest.mark.parametrize("cfg", [K4, K9], ids=["4B", "9B"])
@pytest.mark.parametrize("batch,image_tokens", [(1, 4096), (1, 8192), (2, 8192)])
def test_transformer_formula_matches_trace(cfg, batch, image_tokens, parity):
    with torch.device("meta"):
        model = Flux2Transformer(cfg).to(torch.bfloat16)
    L = 512
    ids = position_ids(1, image_tokens)
    rope = model.rope(text_position_ids(L), ids)  # the sampler computes RoPE once, outside the step
    kw = dict(img=torch.empty(batch, image_tokens, 128, device="meta", dtype=torch.bfloat16), img_ids=ids,
              txt=torch.empty(batch, L, cfg.context_dim, device="meta", dtype=torch.bfloat16),
              txt_ids=text_position_ids(L), timesteps=torch.empty(batch, device="meta"), rope=rope)
    traced = trace_activation_bytes(lambda: model(**kw))
    tokens = L + image_tokens
    formula = transformer_activation_bytes(tokens, batch, cfg.hidden_size, L, cfg.context_dim, image_tokens)
    # what the formula adds for the sampler's own tensors, made outside the traced forward
    sampler_terms = batch * L * cfg.context_dim * 2 + 2 * tokens * 128 * 4 + 16 * batch * image_tokens * 128
    rel = abs(formula - sampler_terms - traced) / traced
    parity(f"planner transformer {cfg.variant} B{batch} N{tokens}: |formula - trace| / trace", rel)
    assert rel < 0.02, (formula - sampler_terms, traced)


@pytest.mark.parametrize("cfg", [VAE, VAEConfig(decoder_block_channels=(96, 192, 384, 384)),
                                 VAEConfig(block_channels=(32,) * 4, decoder_block_channels=(32,) * 4)],
                         ids=["full", "small decoder", "tiny"])
def test_vae_formulas_match_trace(cfg, parity):
    with torch.device("meta"):
        vae = Flux2VAE(cfg).to(torch.bfloat16)
    for h, w in ((512, 512), (1024, 768)):
        z = torch.empty(1, 128, h // 16, w // 16, device="meta", dtype=torch.bfloat16)
        dec = trace_activation_bytes(lambda: vae.decode(z))
        px = torch.empty(1, 3, h, w, device="meta", dtype=torch.bfloat16)
        enc = trace_activation_bytes(lambda: vae.encode(px))
        f_dec = vae_decode_activation_bytes(h, w, 1, cfg.decoder_block_channels)
        f_enc = vae_encode_activation_bytes(h, w, 1, cfg.block_channels)
        parity(f"planner VAE decode {list(cfg.decoder_block_channels)} {h}x{w}: |formula - trace| / trace",
               abs(f_dec - dec) / dec)
        assert abs(f_dec - dec) / dec < 0.03, (f_dec, dec)
        assert abs(f_enc - enc) / enc < 0.03, (f_enc, enc)


def test_tiled_vae_formulas_match_trace(parity):
    with torch.device("meta"):
        vae = Flux2VAE(VAE).to(torch.bfloat16)
    tiny_transformer = TransformerConfig(hidden_size=64, num_heads=2, depth=1, depth_single=1, context_dim=96,
                                         mlp_hidden=192, axes_dim=(8, 8, 8, 8))
    for h, w, tile in ((2048, 2048, 64), (1024, 1536, 32)):
        z = torch.empty(1, 128, h // 16, w // 16, device="meta", dtype=torch.bfloat16)
        dec = trace_activation_bytes(lambda: decode_tiled(vae, z, tile=tile, overlap=tile // 4))
        px = torch.empty(1, 3, h, w, device="meta", dtype=torch.bfloat16)
        enc = trace_activation_bytes(lambda: encode_tiled(vae, px, tile=16 * tile, overlap=4 * tile))
        sizes = ModelSizes.from_configs(tiny_transformer, None, VAE)
        est = estimate(MemoryRequest(w, h, references=((w, h),)), sizes)
        f_dec, f_enc = est.stages["decode"].tiled[tile], est.stages["references"].tiled[tile]
        parity(f"planner tiled VAE decode {h}x{w} tile {tile}: formula / trace", f_dec / dec)
        assert 1.0 <= f_dec / dec < 1.15 and 1.0 <= f_enc / enc < 1.15, (f_dec / dec, f_enc / enc)


def test_text_formula_matches_trace(parity):
    # The full encoder forward reads its mask's values, so it runs on CPU with a narrow (but
    # 27-layer, 512-token) model; the formula's masks (L^2) weigh more here than at real size.
    cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=192, vocab_size=1000, num_layers_in_file=27)
    torch.manual_seed(0)
    te = Qwen3TextEncoder(cfg).to(torch.bfloat16).eval()
    for batch in (1, 2):
        ids = torch.randint(0, 1000, (batch, 512))
        traced = trace_activation_bytes(lambda: te.forward(ids, torch.ones_like(ids)))
        formula = text_activation_bytes(512, batch, 64, 192)
        parity(f"planner text encoder B{batch}: |formula - trace| / trace", abs(formula - traced) / traced)
        assert abs(formula - traced) / traced < 0.03, (formula, traced)


# ---------------------------------------------------------------------------------------------
# Component sizes


def test_component_sizes_from_configs_and_modules():
    c4 = ModelSizes.from_configs(K4, Q4, VAE)
    assert c4.transformer.total / 2 == pytest.approx(3.8755e9, rel=2e-5)  # SPEC §1.1: 3.8755 B params, bf16
    assert c4.transformer.nonblock + sum(c4.transformer.blocks) == c4.transformer.total
    assert len(c4.transformer.blocks) == 25 and c4.vae.total / 1e6 == pytest.approx(168.1, abs=0.1)
    assert ModelSizes.from_configs(K9, Q8, VAE).transformer.total / 2 == pytest.approx(9.0786e9, rel=2e-5)
    fp8 = ModelSizes.from_configs(K4, Q4, VAE, transformer_precision="fp8", text_precision="fp8")
    assert 4.0 < fp8.transformer.total / GB < 4.2  # BFL's flux-2-klein-4b-fp8 file is 4.07 GB
    # Configs and loaded modules agree, fp8 layers included.
    tr, te, vae = demo.build_tiny_components()
    tr, te, vae = tr.bfloat16(), te.bfloat16(), vae.bfloat16()
    vae.bn.float()
    for precision in ("bf16", "fp8"):
        if precision == "fp8":
            quantize_model_(tr)
            quantize_model_(te)
        a = ModelSizes.from_modules(tr, te, vae)
        b = ModelSizes.from_configs(tr.config, te.config, vae.config, transformer_precision=precision,
                                    text_precision=precision)
        assert a.transformer == b.transformer and a.text_encoder == b.text_encoder, precision
        assert a.vae.total == b.vae.total
    with pytest.raises(ValueError, match="precision"):
        ModelSizes.from_configs(K4, transformer_precision="int4")


def _sizes_by_torch(m: torch.nn.Module) -> ComponentSize:
    """A component's sizes counted by torch's own iterators (what from_modules' one walk replaces)."""
    blocks = [b for lst in m.children() if isinstance(lst, torch.nn.ModuleList) for b in lst]
    per_block = tuple(sum(t.nbytes for t in itertools.chain(b.parameters(), b.buffers())) for b in blocks)
    total = sum(t.nbytes for t in itertools.chain(m.parameters(), m.buffers()))
    params = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    return ComponentSize(total, total - sum(per_block), per_block, params)


def test_sizes_of_loaded_modules_match_torchs_own_count():
    """ModelSizes.from_modules walks each component once (block_footprint) for the bytes of each block,
    of the whole and the largest block's parameter count: the same sizes as torch's iterators give, on
    two tiny widths, fp8 layers with their scales, and a model with buffers inside its blocks, blocks of
    unequal sizes in two lists and none at all."""
    from klein_core.testing.tiny import TINY_9B, tiny_text_encoder, tiny_transformer

    class Stack(torch.nn.Module):
        config = None  # from_modules reads a component's shape parameters from it

        def __init__(self, blocks: bool = True) -> None:
            super().__init__()
            self.head = torch.nn.Linear(3, 4)
            if blocks:
                self.first = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Sequential(
                    torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))])
                self.second = torch.nn.ModuleList([torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 6, bias=False)])
            self.register_buffer("scale", torch.ones(5, dtype=torch.float64))

    models = [tiny_transformer(), tiny_transformer(TINY_9B), tiny_text_encoder(), tiny_text_encoder(TINY_9B),
              Stack(), Stack(blocks=False), tiny_transformer(TINY_9B)]
    quantize_model_(models[-1])
    for m in models:
        got = ModelSizes.from_modules(transformer=m).transformer
        assert got == _sizes_by_torch(m), type(m).__name__
    # a parameter tied in two places of a block: its parameters once (as torch counts them), its bytes
    # at each place (as module_bytes, what streaming a block copies, counts them)
    from klein_core.memory.placement import module_bytes

    tied = Stack()
    tied.first.append(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)))  # the largest block
    tied.first[2][1].weight = tied.first[2][0].weight
    got = ModelSizes.from_modules(transformer=tied).transformer
    blocks = [b for lst in (tied.first, tied.second) for b in lst]
    assert got.blocks == tuple(module_bytes(b) for b in blocks) and got.total == module_bytes(tied)
    assert got.blocks[2] == (2 * 1024 + 2 * 32) * 4 and got.block_params == 1024 + 2 * 32
    assert got.block_params == _sizes_by_torch(tied).block_params
    stack = ModelSizes.from_modules(transformer=Stack()).transformer
    assert len(stack.blocks) == 4 and stack.block_params == 4 * 16 + 16 + 2 * 16 + 16 * 4 + 4  # the Sequential
    assert stack.blocks[1] > stack.blocks[0] and stack.nonblock == (3 * 4 + 4) * 4 + 5 * 8
    assert ModelSizes.from_modules(transformer=Stack(blocks=False)).transformer.blocks == ()


def test_device_census_holds_and_counts_as_held_on_and_the_bytes_there():
    """device_census (the planner's one walk for both) against held_on and a count by torch's iterators:
    modules partly on another device (meta stands in for the GPU here), a tensor shared between two
    modules counted once, a module with nothing there, and the same modules asked about the other device."""
    from klein_core.memory.placement import device_census, held_on

    def bytes_on(modules, device):
        tensors = {id(t): t for m in modules for t in itertools.chain(m.parameters(), m.buffers())
                   if t.device == torch.device(device)}
        return sum(t.nbytes for t in tensors.values())

    a = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2, device="meta"))
    b = torch.nn.Linear(3, 5)
    b.register_buffer("steps", torch.zeros(7, dtype=torch.int64))
    c = torch.nn.Linear(6, 6, device="meta")
    shared = torch.nn.Sequential(b, torch.nn.Linear(5, 5))  # b's tensors also belong to `shared`
    modules = [a, b, c, shared]
    for device in ("cpu", "meta"):
        held, nbytes = device_census(modules, device)
        assert held == [held_on(m, device) for m in modules], device
        assert nbytes == bytes_on(modules, device) > 0, device
    assert device_census(modules, "cpu")[0] == [False, True, False, True]
    assert device_census([], "cpu") == ([], 0)


# ---------------------------------------------------------------------------------------------
# The plan table


def _est(t, q, req, precision="bf16"):
    sizes = ModelSizes.from_configs(t, q, VAE, transformer_precision=precision, text_precision=precision)
    return estimate(req, sizes)


# (model, precision, request, free GB, expected plan, expected tile)
# Weights: 4B bf16 = transformer 7.75 + text encoder 6.23 + VAE 0.17 GB; fp8 4.07 + 3.50 + 0.17;
# 9B bf16 18.16 + 11.66 + 0.17; fp8 9.43 + 6.45 + 0.17. Denoise activations at 1024^2 + one
# reference: 1.8 GB (4B), 2.4 GB (9B). DEFAULT_RESERVE_BYTES (0.8 GB) of every card stays unplanned.
TABLE = [
    ("4B", "bf16", EDIT, 80, "resident", None),
    ("4B", "bf16", EDIT, 24, "resident", None),
    ("4B", "bf16", EDIT, 16, "swap text encoder and transformer", None),
    ("4B", "bf16", EDIT, 12, "swap text encoder and transformer", None),
    ("4B", "bf16", EDIT, 8, "stream transformer blocks", None),  # target: 4B edit in 8 GB
    ("4B", "bf16", EDIT, 6, "stream all blocks", None),
    ("4B", "fp8", EDIT, 12, "resident", None),
    ("4B", "fp8", EDIT, 8, "swap text encoder and transformer", None),  # target with fp8 weights
    ("4B", "fp8", EDIT, 6, "stream transformer blocks", None),
    ("9B", "bf16", EDIT, 40, "resident", None),
    ("9B", "bf16", EDIT, 24, "swap text encoder and transformer", None),
    ("9B", "bf16", EDIT, 12, "stream all blocks", None),  # target: 9B edit in 12 GB
    ("9B", "fp8", EDIT, 24, "resident", None),
    ("9B", "fp8", EDIT, 12, "stream transformer blocks", None),
    ("4B", "bf16", MemoryRequest(encode_text=False), 12, "swap text encoder and transformer", None),
    # 2048^2: untiled decode needs 6.45 GB of activations an image (the denoise step 3.4 GB), so
    # tiles of 64 latents let everything stay resident on cards that would otherwise swap.
    ("4B", "fp8", MemoryRequest(2048, 2048), 16, "resident", None),
    ("4B", "fp8", MemoryRequest(2048, 2048), 14, "resident", 64),
    ("4B", "bf16", MemoryRequest(2048, 2048), 20, "resident", 64),
    # a batch decodes one image at a time: its decode needs no more than one image's
    ("4B", "fp8", MemoryRequest(2048, 2048, batch=2), 13, "swap text encoder and transformer", None),
    ("4B", "fp8", MemoryRequest(2048, 2048, batch=2), 10, "stream transformer blocks", None),
    ("9B", "bf16", EDIT, 3, "stream all blocks", 16),  # does not fit at all: the smallest plan
]


@pytest.mark.parametrize("model,precision,req,free_gb,plan_name,tile", TABLE)
def test_plan_table(model, precision, req, free_gb, plan_name, tile):
    t, q = (K4, Q4) if model == "4B" else (K9, Q8)
    est = _est(t, q, req, precision)
    plan = choose_plan(est, int(free_gb * GB))
    assert (plan.name, plan.vae_tile) == (plan_name, tile), plan.reason
    assert plan.fits == (free_gb > 3), plan.reason
    assert plan.name in plan.reason and "GB" in plan.reason
    if plan.fits:
        assert plan.peak_bytes <= free_gb * GB - DEFAULT_RESERVE_BYTES


def test_reasons_forced_modes_and_request_checks():
    est = _est(K4, Q4, EDIT)
    big = choose_plan(est, int(80 * GB))
    assert big.reason.startswith("resident: estimated peak 15.9") and big.fits
    small = choose_plan(est, int(8 * GB))
    assert "everything resident would need 15.9" in small.reason
    none = choose_plan(est, int(2 * GB))
    assert not none.fits and "short by" in none.reason and "fp8" in none.reason
    forced = choose_plan(est, int(80 * GB), mode="blocks")
    assert forced.name == "stream transformer blocks" and forced.placements["transformer"] == "blocks"
    assert forced.peak_bytes < big.peak_bytes
    with pytest.raises(ValueError, match="memory mode"):
        choose_plan(est, int(GB), mode="lowvram")
    cfg = _est(K4, Q4, MemoryRequest(1024, 1024, cfg=True)).stages["denoise"].activations
    plain = _est(K4, Q4, MemoryRequest(1024, 1024)).stages["denoise"].activations
    assert 1.9 < cfg / plain < 2.05  # CFG doubles the transformer batch
    with pytest.raises(ValueError, match="multiple of 16"):
        MemoryRequest(1000, 1024)
    stages = est.stage_peaks(big)
    assert set(stages) == {"text", "references", "denoise", "decode"}
    assert max(stages.values()) == big.peak_bytes


def test_a_pinned_vae_tile_is_kept_and_only_the_placement_is_searched():
    """vae_tile pins the tiling: None never tiles (at 2048^2 on 14 GB the plan moves weights where auto
    tiled, TABLE), a side always tiles (even with 80 GB free); a bad value names the choices."""
    est = _est(K4, Q4, MemoryRequest(2048, 2048), "fp8")
    auto = choose_plan(est, int(14 * GB))
    assert (auto.name, auto.vae_tile) == ("resident", 64)
    whole = choose_plan(est, int(14 * GB), vae_tile=None)
    assert whole.vae_tile is None and whole.fits and whole.name != "resident", whole.reason
    assert whole.peak_bytes <= 14 * GB - DEFAULT_RESERVE_BYTES
    pinned = choose_plan(est, int(80 * GB), vae_tile=32)
    assert (pinned.name, pinned.vae_tile) == ("resident", 32) and "VAE tiles of 32" in pinned.reason
    blocks = choose_plan(est, int(80 * GB), mode="blocks", vae_tile=16)
    assert (blocks.name, blocks.vae_tile) == ("stream transformer blocks", 16)
    assert choose_plan(est, int(80 * GB), vae_tile=np.int64(32)).vae_tile == 32  # any integer type
    for bad in (17, "64", 0, True, "whole", 32.0):
        with pytest.raises(ValueError, match="vae_tile must be 'auto', None"):
            choose_plan(est, int(80 * GB), vae_tile=bad)


def test_a_pinned_vae_tile_applies_off_cuda_too():
    from klein_core.memory.planner import plan_for

    tr, te, vae = demo.build_tiny_components()
    req = MemoryRequest(512, 512)
    assert plan_for(req, tr, te, vae, device="cpu").vae_tile is None
    plan = plan_for(req, tr, te, vae, device="cpu", vae_tile=32)
    assert plan.vae_tile == 32 and plan.name == "resident" and "VAE tiles of 32 latents (pinned)" in plan.reason
    forced = plan_for(req, tr, te, vae, device="cpu", mode="swap", vae_tile=16)
    assert forced.vae_tile == 16 and "VAE tiles of 16" in forced.reason


# ---------------------------------------------------------------------------------------------
# benchmarks/memory.py (its CPU-safe parts)


def _memory_module():
    return load_script("klein_memory_benchmark", REPO / "benchmarks" / "memory.py")


def test_memory_benchmark_arguments_and_builders():
    mem = _memory_module()
    args = mem.parse_args(["--out", "x.json", "--models", "9b", "--precision", "fp8", "--modes", "auto,swap",
                           "--cap-gb", "12"])
    assert args.models == ["9b"] and args.precision == ["fp8"] and args.modes == ["auto", "swap"]
    assert args.cap_gb == 12
    with pytest.raises(SystemExit):
        mem.parse_args(["--out", "x.json", "--models", "30b"])
    with pytest.raises(SystemExit):
        mem.parse_args(["--out", "x.json", "--modes", "turbo"])
    # by default it runs what the nodes and the CLI run
    assert args.speed == "fast" and not args.uncapped_resident
    args = mem.parse_args(["--out", "x.json", "--speed", "plain", "--uncapped-resident", "--cap-gb", "12"])
    assert args.speed == "plain" and args.uncapped_resident
    with pytest.raises(SystemExit):
        mem.parse_args(["--out", "x.json", "--speed", "turbo"])
    # The fast builder on CPU at a small size: meta -> to_empty -> random init, bf16, no NaN.
    small = TransformerConfig(hidden_size=64, num_heads=2, depth=1, depth_single=1, context_dim=96,
                              mlp_hidden=192, axes_dim=(8, 8, 8, 8))
    tr = mem._on(lambda: Flux2Transformer(small), torch.device("cpu"), torch.bfloat16)
    assert tr.dtype == torch.bfloat16 and not any(p.is_meta for p in tr.parameters())
    assert float(tr.img_in.weight.float().std()) == pytest.approx(0.02, rel=0.2)
    assert ModelSizes.from_modules(tr).transformer.total == ModelSizes.from_configs(small).transformer.total


def test_memory_benchmark_tiny_cpu(tmp_path, capsys):
    mem = _memory_module()
    out = tmp_path / "memory.json"
    report = mem.main(["--tiny", "--device", "cpu", "--steps", "1", "--cases", "edit1024", "--precision",
                       "fp8", "--modes", "auto,minimum", "--out", str(out)])
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(report)) and saved["env"]["device"] == "cpu"
    rows = saved["results"]
    assert [r["mode"] for r in rows] == ["auto", "minimum"] and "stream all blocks" in printed
    assert saved["summary"]["groups"] == [{"model": "tiny", "precision": "fp8", "case": "edit1024"}]
    for r in rows:
        assert r["finite"] and r["fits"] and set(r["time_s"]) == {"text", "references", "denoise", "decode"}
        assert r["peak_total"] is None  # no CUDA memory statistics on the CPU
        assert r["estimated_peak"] == max(r["estimated_stages"].values())


def test_memory_benchmark_uncapped_resident_tiny_cpu(tmp_path, capsys):
    """--uncapped-resident: resident first with no cap, then every mode under the cap, each timed
    against it (rows, printed table and summary)."""
    mem = _memory_module()
    out = tmp_path / "memory.json"
    mem.main(["--tiny", "--device", "cpu", "--steps", "1", "--cases", "edit1024", "--modes",
              "auto,resident,minimum", "--cap-gb", "12", "--uncapped-modes", "blocks", "--out", str(out)])
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    rows = saved["results"]
    assert [(r["mode"], r["cap_gb"], r["uncapped_run"]) for r in rows] == [
        ("resident", None, True), ("blocks", None, True), ("auto", 12, False), ("resident", 12, False),
        ("minimum", 12, False)]
    assert rows[1]["free_bytes"] == 64 * 10**9 and rows[1]["plan"] == "stream transformer blocks"
    rows = [rows[0], *rows[2:]]  # the capped rows below, against the resident reference
    assert saved["env"]["speed"] == "fast" and all(r["speed"] == "fast" for r in rows)
    assert saved["env"]["speed_resolved"]["tiny bf16"].startswith("fast")
    base = rows[0]
    assert base["time_reference"] and base["free_bytes"] == 64 * 10**9  # measured free, not the 12 GB cap
    assert all(r["free_bytes"] == 12 * 10**9 for r in rows[1:])
    for r in rows:
        assert r["finite"] and r["total_s"] > 0
        assert r["time_over_uncapped_resident"] > 0 and r["denoise_over_uncapped_resident"] > 0
        assert r["time_over_uncapped_resident"] == pytest.approx(r["total_s"] / base["total_s"])
        assert r["denoise_over_uncapped_resident"] == pytest.approx(
            r["time_s"]["denoise"] / base["time_s"]["denoise"])
    assert base["time_over_uncapped_resident"] == 1.0
    (group,) = saved["summary"]["groups"]
    assert group["uncapped_resident_s"] == base["total_s"]
    assert set(group["time_over_uncapped_resident"]) == {
        "resident(uncapped)", "blocks(uncapped)", "auto", "resident", "minimum"}
    assert group["time_over_uncapped_resident"]["minimum"] == rows[3]["time_over_uncapped_resident"]
    assert "no cap" in printed and "cap 12G" in printed and "x uncapped resident" in printed
    assert "minimum/uncapped-resident" in saved["summary"]["lines"][0]


def _stand_in_cuda(monkeypatch, mem, total: int) -> list:
    """CUDA as torch reports it on an 80 GiB card (no driver reached) for benchmarks/memory.py, with tiny
    components; returns a one-item list holding the allocator fraction last set."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    props = SimpleNamespace(name="stand-in GPU", total_memory=total)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * 10**9, total))
    monkeypatch.setattr(torch.cuda.memory, "_lazy_init", lambda: None)
    fraction = [None]
    monkeypatch.setattr(torch._C, "_cuda_setMemoryFraction", lambda f, index: fraction.__setitem__(0, f),
                        raising=False)
    monkeypatch.setattr(mem, "build_components", lambda *a: demo.build_tiny_components())
    monkeypatch.setattr(mem, "_home", lambda comps: None)
    return fraction


def _stand_in_device(monkeypatch, mem) -> list:
    """``on_device`` of benchmarks/memory.py recording instead of copying (the stand-in CUDA holds
    nothing); returns the list of the modules "on the device" now."""
    import contextlib

    on = []

    @contextlib.contextmanager
    def recorded(module, device):
        on.append(module)
        try:
            yield module
        finally:
            on.remove(module)

    monkeypatch.setattr(mem, "on_device", recorded)
    return on


def _timings(total_s: float) -> dict:
    return {"time_s": {"text": 0.1, "references": 0.1, "denoise": total_s - 0.3, "decode": 0.1},
            "total_s": total_s, "peak_total": 10**9, "peak_bytes": {}, "finite": True}


def test_memory_benchmark_uncapped_resident_runs_without_the_cap(monkeypatch, tmp_path):
    """The uncapped run really has the whole card (allocator fraction 1.0, the planner given the measured
    free memory); the modes after it run under --cap-gb."""
    mem = _memory_module()
    total = 80 * 2**30
    fraction = _stand_in_cuda(monkeypatch, mem, total)
    on = _stand_in_device(monkeypatch, mem)
    calls = []

    def fake_generation(components, req, plan, device, steps, seed=0):
        calls.append((plan.name, fraction[0]))
        # the plan's resident components are on the device for its runs, the others not
        here = {name for name, m in components.items() if any(m is o for o in on)}
        assert here == {c for c, where in plan.placements.items() if where == "resident"}, plan.name
        seen.append(here)
        return _timings(2.0 if fraction[0] == 1.0 else 3.0)  # the capped runs take longer

    seen: list[set] = []

    monkeypatch.setattr(mem, "run_generation", fake_generation)
    report = mem.main(["--out", str(tmp_path / "m.json"), "--models", "9b", "--cases", "edit1024",
                       "--modes", "auto,minimum", "--cap-gb", "12", "--uncapped-resident"])
    capped = 12 * 10**9 / total
    # a warm-up and a measured generation each: resident uncapped, then the modes under the cap
    assert [f for _, f in calls] == [1.0, 1.0, capped, capped, capped, capped]
    assert calls[0][0] == "resident" and calls[-1][0] == "stream all blocks"
    assert seen[0] == {"text_encoder", "transformer", "vae"} and seen[-1] < seen[0] and not on
    rows = report["results"]
    assert rows[0]["on_device"] == ["text_encoder", "transformer", "vae"]
    assert set(rows[-1]["on_device"]) == seen[-1]
    assert [r["free_bytes"] for r in rows] == [70 * 10**9, 12 * 10**9, 12 * 10**9]
    assert [r["time_over_uncapped_resident"] for r in rows] == [1.0, 1.5, 1.5]
    assert report["env"]["cap_gb"] == 12 and report["env"]["gpu"] == "stand-in GPU"


def test_memory_benchmark_keeps_the_rows_when_a_mode_fails_or_time_runs_out(monkeypatch, tmp_path, capsys):
    """One device call runs it: a mode that raises is recorded (exit code 1, the other rows kept) and the
    session's timeout (SIGINT) still writes the rows measured so far."""
    mem = _memory_module()
    _stand_in_cuda(monkeypatch, mem, 80 * 2**30)
    _stand_in_device(monkeypatch, mem)
    out = tmp_path / "m.json"
    argv = ["--out", str(out), "--models", "9b", "--cases", "edit1024", "--modes", "auto,minimum",
            "--cap-gb", "12", "--uncapped-resident"]

    def failing(components, req, plan, device, steps, seed=0):
        if plan.name == "stream all blocks":
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
        return _timings(2.0)

    monkeypatch.setattr(mem, "run_generation", failing)
    report = mem.main(argv)
    assert [("error" in r, "total_s" in r) for r in report["results"]] == [(False, True), (False, True),
                                                                           (True, False)]
    assert report["results"][2]["error"] == ("RuntimeError: CUDA error: an illegal memory access was "
                                             "encountered")  # its first line
    assert "ERROR" in capsys.readouterr().out
    assert json.loads(out.read_text())["results"][2]["error"].startswith("RuntimeError")

    def interrupted(components, req, plan, device, steps, seed=0):
        if plan.name == "stream all blocks":
            raise KeyboardInterrupt
        return _timings(2.0)

    monkeypatch.setattr(mem, "run_generation", interrupted)
    with pytest.raises(SystemExit) as exc:
        mem.main(argv)
    assert exc.value.code == 130
    saved = json.loads(out.read_text())
    assert saved["interrupted"] and [r["mode"] for r in saved["results"]] == ["resident", "auto"]
    ratios = saved["summary"]["groups"][0]["time_over_uncapped_resident"]
    assert ratios == {"resident(uncapped)": 1.0, "auto": 1.0}


def test_memory_benchmark_runs_resident_components_on_the_device(monkeypatch):
    """A ``resident`` row measures what the planner estimates: the components it keeps resident on the
    device for the runs (copied from their pinned homes, which are kept), the others where they live;
    a plan that does not fit copies nothing (the engine refuses it); the text encoder's graphs, which
    point at the copies, are dropped with them. The meta device stands in for the GPU."""
    mem = _memory_module()
    tr, te, vae = demo.build_tiny_components()
    comps = {"text_encoder": te, "transformer": tr, "vae": vae}
    homes = {n: next(m.parameters()).data_ptr() for n, m in comps.items()}
    released = []
    monkeypatch.setattr(mem, "release_text_graphs", lambda m: released.append(m))
    plan = MemoryPlan({"text_encoder": "staged", "transformer": "resident", "vae": "resident"})
    meta = torch.device("meta")
    with mem.placed(comps, plan, meta) as names:
        assert names == ["transformer", "vae"]
        assert {p.device.type for p in tr.parameters()} == {"meta"} == {p.device.type for p in vae.parameters()}
        assert {p.device.type for p in te.parameters()} == {"cpu"}
    assert released == [tr, vae]
    for n, m in comps.items():  # the same home memory, not copies of it
        assert {p.device.type for p in m.parameters()} == {"cpu"}
        assert next(m.parameters()).data_ptr() == homes[n]
    refused = MemoryPlan({"text_encoder": "resident", "transformer": "resident", "vae": "resident"}, fits=False)
    with mem.placed(comps, refused, meta) as names:
        assert names == [] and {p.device.type for p in tr.parameters()} == {"cpu"}


def test_plan_for_loaded_components_on_cpu():
    from klein_core.memory.planner import plan_for

    tr, te, vae = demo.build_tiny_components()
    req = MemoryRequest(128, 128, references=((128, 128),))
    plan = plan_for(req, tr, te, vae, device="cpu")
    assert plan.name == "resident" and plan.fits and "no memory planning" in plan.reason
    tight = plan_for(req, tr, te, vae, device="cpu", free_bytes=plan.peak_bytes + DEFAULT_RESERVE_BYTES - 1)
    assert tight.name != "resident" and tight.fits  # one byte short of resident + reserve


def test_engine_tells_the_planner_the_prompt_length():
    """Long prompts (whole-prompt option) and given embeddings make the text part of the sequence
    longer than 512: the planner must count it, or it under-estimates and plans runs that do not fit."""
    import klein_core as kc
    from klein_core.memory.planner import ModelSizes, estimate

    tr, te, vae = demo.build_tiny_components()
    long_prompt = " ".join(["a small red fox in the snow"] * 120)  # about 840 tokens
    default = kc.Engine(tr, te, vae, prompt_cache=None)
    whole = kc.Engine(tr, te, vae, prompt_cache=None, text=kc.COMFYUI_TEXT)
    req = kc.GenerationRequest(prompt=long_prompt)
    assert default.memory_request(req).text_length == 512
    n = whole.memory_request(req).text_length
    assert n == kc.COMFYUI_TEXT.length([long_prompt]) > 800
    base = kc.Engine(tr, te, vae, kind="base", prompt_cache=None, text=kc.COMFYUI_TEXT)
    cfg = kc.GenerationRequest(prompt="a fox", negative_prompt=long_prompt)  # the negative is the longer one
    assert base.memory_request(cfg).text_length == n
    given = kc.GenerationRequest(conditioning=kc.Conditioning(torch.zeros(1, 700, tr.config.context_dim)))
    assert default.memory_request(given).text_length == 700  # given embeddings: their length
    assert not default.memory_request(given).encode_text  # and no text stage
    sizes = ModelSizes.from_modules(tr, te, vae)
    longer = estimate(whole.memory_request(req), sizes).stages
    shorter = estimate(default.memory_request(req), sizes).stages
    assert longer["text"].activations > shorter["text"].activations
    assert longer["denoise"].activations > shorter["denoise"].activations


def _fake_cuda(monkeypatch, free: list[int]) -> None:
    """A CUDA device 0 whose driver reports ``free[0]`` bytes free (read at each query)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)


def test_components_already_on_the_gpu_count_as_free_for_the_plan_and_stay_there(monkeypatch):
    """plan_for's one census of the components on the GPU (stood in here: no CUDA tensors on the CPU)
    feeds three things: what the hook is asked for (the fastest peak less what the components hold
    there), the free memory (the driver's plus theirs: the estimate counts their weights) and the
    components that stay (held there, never planned off it), each by its own name."""
    from klein_core.memory import planner
    from klein_core.memory.planner import DEFAULT_RESERVE_BYTES, ModelSizes, plan_for

    tr, te, vae = demo.build_tiny_components()
    req = MemoryRequest(256, 256, batch=1, text_length=512)
    est = estimate(req, ModelSizes.from_modules(tr, te, vae))
    free = [1 << 20]
    _fake_cuda(monkeypatch, free)
    asked = []
    for held, held_bytes in (([False, True, False], 3 << 20), ([True, False, True], 5 << 20)):
        monkeypatch.setattr(planner, "device_census", lambda modules, device, held=held, n=held_bytes: (
            asked.append((len(modules), device)) or (held, n)))
        calls = []
        plan = plan_for(req, tr, te, vae, device="cuda", make_room=lambda n, d, calls=calls: calls.append(n))
        stay = frozenset(c for c, h in zip(("transformer", "text_encoder", "vae"), held) if h)
        fastest = choose_plan(est, 1 << 62, stay=stay)
        assert calls == [fastest.peak_bytes + DEFAULT_RESERVE_BYTES - held_bytes]
        assert plan.free_bytes == free[0] + held_bytes
        assert plan == choose_plan(est, free[0] + held_bytes, stay=stay)
        assert all(plan.placements[c] == "resident" for c in stay)
    # the components, as asked ("cuda": resolved only for CUDA tensors), and again after the hook ran
    assert asked == [(3, torch.device("cuda")), (3, torch.device("cuda", 0))] * 2


def test_a_hook_that_loads_the_components_onto_the_gpu_is_counted_after_it_ran(monkeypatch):
    """Was a bug (this session's review): plan_for counted what the components hold on the GPU before
    calling the host's make_room, and reused it after; the nodes' hook has ComfyUI load every model it
    is handed, ours too, so a component loaded back by the hook was counted in the estimate and again
    as memory no longer free (a slower plan, or a refusal). What they hold is counted again after a
    hook ran, and only then."""
    from klein_core.memory import planner
    from klein_core.memory.planner import plan_for

    tr, te, vae = demo.build_tiny_components()
    req = MemoryRequest(256, 256, batch=1, text_length=512)
    free, held_bytes, censuses = [1 << 20], [0], []
    _fake_cuda(monkeypatch, free)

    def census(modules, device):
        censuses.append(torch.device(device))
        return [False] * len(modules), held_bytes[0]

    def make_room(nbytes, device):  # frees the host's models, then loads ours: 3 MB of theirs on the GPU
        free[0] += nbytes - (3 << 20)
        held_bytes[0] = 3 << 20

    monkeypatch.setattr(planner, "device_census", census)
    plan = plan_for(req, tr, te, vae, device="cuda", make_room=make_room)
    assert plan.free_bytes == free[0] + (3 << 20)  # the driver's free memory and what ours hold there
    assert len(censuses) == 2
    censuses.clear()
    plan_for(req, tr, te, vae, device="cuda")  # no hook: one census
    assert len(censuses) == 1


def test_planning_for_a_gpu_with_a_given_free_size_asks_cuda_nothing(monkeypatch):
    """Was a bug (this session's review): plan_for(device="cuda", free_bytes=N) resolved the bare "cuda"
    to an index before looking at the components, which asks CUDA (and fails without it); the
    components here are on the CPU, so nothing needs CUDA."""
    from klein_core.memory.planner import plan_for

    def no_cuda(*args, **kwargs):
        raise AssertionError("CUDA was asked")

    monkeypatch.setattr(torch.cuda, "current_device", no_cuda)
    monkeypatch.setattr(torch.cuda, "mem_get_info", no_cuda)
    tr, te, vae = demo.build_tiny_components()
    req = MemoryRequest(256, 256, batch=1, text_length=512)
    plan = plan_for(req, tr, te, vae, device="cuda", free_bytes=8 << 30)
    assert plan.fits and plan.free_bytes == 8 << 30 and plan.name == "resident"
    assert not plan_for(req, tr, te, vae, device="cuda", free_bytes=1 << 10).fits


def test_the_host_is_asked_to_make_room_once_before_the_free_memory_is_measured(monkeypatch):
    import klein_core as kc
    from klein_core.memory.planner import DEFAULT_RESERVE_BYTES, ModelSizes, plan_for

    tr, te, vae = demo.build_tiny_components()
    req = MemoryRequest(256, 256, batch=1, text_length=512)
    fastest = choose_plan(estimate(req, ModelSizes.from_modules(tr, te, vae)), 1 << 62)
    free = [64 << 20]  # a host's own models hold the rest
    _fake_cuda(monkeypatch, free)
    assert not plan_for(req, tr, te, vae, device="cuda").fits  # without the hook nothing fits

    calls = []

    def make_room(nbytes: int, device: torch.device) -> None:
        calls.append((nbytes, device))
        free[0] += nbytes  # the host unloads its models

    plan = plan_for(req, tr, te, vae, device="cuda", make_room=make_room)
    # the components are on the CPU, so the fastest plan's whole peak (weights too) is asked for
    # with its index: a host compares it with its models' devices, and "cuda" != "cuda:0"
    assert calls == [(fastest.peak_bytes + DEFAULT_RESERVE_BYTES, torch.device("cuda", 0))]
    assert plan.fits and plan.name == "resident" and plan.free_bytes == free[0]

    calls.clear()
    free[0] = 64 << 20
    engine = kc.Engine(tr, te, vae, prompt_cache=None, make_room=make_room)
    engine.device = torch.device("cuda", 0)  # planned as if on the (fake) GPU; nothing runs
    assert engine.plan(req).fits and len(calls) == 1
    calls.clear()
    kc.Engine(tr, te, vae, prompt_cache=None, make_room=make_room).plan(req)  # on the CPU: nothing to free
    assert calls == []
