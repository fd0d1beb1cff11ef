"""The curated mutants: realistic one-line bugs in klein_core's maths and caches, each with the tests
that must catch it (run by tests/mutants/run.py, and by tests/test_mutants.py in the normal suite).

Each mutant is an exact text edit (``old`` must occur exactly once in ``file``) plus the test node ids
or files that must fail with it. Keep ``old`` a distinctive piece of code, not a line number, so it
follows the code through refactors; when the code changes, the check fails until the edit is updated.
Keep ``tests`` small and fast: the whole catalog runs in every test run. Test ids are relative to
the repository root.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    why: str = ""


ESC = "tests/test_escapes.py"
PIPE = "tests/test_pipeline_parity.py"

MUTANTS: tuple[Mutant, ...] = (
    # ----- the four escapes of issue #33 -----
    Mutant(
        "kv-cache-key-ignores-picture", "klein_core/pipeline/reference_kv.py",
        "_digest(refs.tokens, refs.ids)", "_digest(refs.ids)",
        (f"{ESC}::test_kv_cache_serves_a_new_picture_of_the_same_size_its_own_keys",),
        "a new picture of the same size would be edited with the previous picture's keys/values",
    ),
    Mutant(
        "text-encoder-output-layers", "klein_core/models/qwen3.py",
        "OUTPUT_LAYERS: tuple[int, ...] = (9, 18, 27)", "OUTPUT_LAYERS: tuple[int, ...] = (10, 19, 27)",
        ("tests/test_text_encoder.py::test_fp32_parity_every_layout[state_dict]",),
        "hidden states 10/19 instead of the spec's 9/18",
    ),
    Mutant(
        "schedule-mu-boundary", "klein_core/pipeline/sampling.py",
        "if image_seq_len > 4300:", "if image_seq_len > 4096:",
        (f"{ESC}::test_empirical_mu_equals_diffusers",),
        "sizes of 4097..4300 tokens (1024x1056) get the large-image mu",
    ),
    Mutant(
        "rslora-scale", "klein_core/lora/read.py",
        'lora_alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)', "lora_alpha / rank",
        (f"{ESC}::test_rslora_scale_matches_diffusers_and_peft",),
        "use_rslora LoRAs applied at alpha/r instead of alpha/sqrt(r)",
    ),
    # ----- sampling -----
    Mutant(
        "noise-ignores-seed", "klein_core/pipeline/sampling.py",
        'torch.Generator(device="cpu").manual_seed(seed)', 'torch.Generator(device="cpu").manual_seed(0)',
        ("tests/test_pipeline.py::test_noise_matches_comfyui_random_noise",),
        "every seed gives the same picture",
    ),
    Mutant(
        "schedule-time-shift", "klein_core/pipeline/sampling.py",
        "e = torch.full_like(sigmas, math.exp(mu))", "e = torch.full_like(sigmas, mu)",
        (f"{PIPE}::test_schedule_matches_published_table",),
        "mu used as the shift instead of e^mu",
    ),
    Mutant(
        "cfg-formula", "klein_core/pipeline/sampling.py",
        "    return v_neg + job.guidance * (v_pos - v_neg)", "    return v_pos + job.guidance * (v_pos - v_neg)",
        (f"{PIPE}::test_base_cfg_with_negative_prompt_batched",),
        "classifier-free guidance from the positive branch",
    ),
    Mutant(
        "euler-step-sign", "klein_core/pipeline/sampling.py",
        "latents = (latents.float() + job.dts[i] * v).to(dtype)",
        "latents = (latents.float() - job.dts[i] * v).to(dtype)",
        (f"{PIPE}::test_distilled_text_to_image",),
        "the Euler step walks the wrong way",
    ),
    Mutant(
        "reference-time-offset", "klein_core/pipeline/sampling.py",
        "REF_TIME_OFFSET = 10", "REF_TIME_OFFSET = 1",
        (f"{PIPE}::test_two_references_of_different_sizes",),
        "references at RoPE time 1, 2... instead of 10, 20...",
    ),
    Mutant(
        "position-ids-h-w-swapped", "klein_core/pipeline/sampling.py",
        "ids[:, 1] = hh.reshape(-1)\n    ids[:, 2] = ww.reshape(-1)",
        "ids[:, 1] = ww.reshape(-1)\n    ids[:, 2] = hh.reshape(-1)",
        (f"{PIPE}::test_distilled_text_to_image",),
        "image tokens' RoPE rows and columns exchanged (unseen on square images)",
    ),
    Mutant(
        "inpaint-keeps-the-wrong-region", "klein_core/pipeline/sampling.py",
        "return blend.known * proper + blend.keep * latents.float()",
        "return blend.keep * proper + blend.known * latents.float()",
        ("tests/test_inpaint_parity.py::test_inpaint_without_and_with_a_reference",),
        "the mask's meaning inverted after each step",
    ),
    # ----- transformer maths -----
    Mutant(
        "rope-theta", "klein_core/models/transformer_math.py",
        "ROPE_THETA = 2000.0", "ROPE_THETA = 10000.0",
        ("tests/test_transformer.py::test_fp32_parity_every_layout[bfl state dict]",),
        "FLUX.1's RoPE theta instead of FLUX.2's 2000",
    ),
    Mutant(
        "timestep-embedding-order", "klein_core/models/transformer_math.py",
        "torch.cat([torch.cos(args), torch.sin(args)], dim=-1)",
        "torch.cat([torch.sin(args), torch.cos(args)], dim=-1)",
        ("tests/test_transformer.py::test_fp32_parity_every_layout[bfl state dict]",),
        "[sin | cos] instead of [cos | sin]",
    ),
    Mutant(
        "modulation-scale", "klein_core/models/transformer_math.py",
        "return (1 + scale) * F.layer_norm(", "return scale * F.layer_norm(",
        ("tests/test_transformer.py::test_fp32_parity_every_layout[bfl state dict]",),
        "adaLN scale without the 1 +",
    ),
    Mutant(
        "transformer-norm-eps", "klein_core/models/transformer_math.py",
        "NORM_EPS = 1e-6", "NORM_EPS = 1e-5",
        (f"{ESC}::test_transformer_norm_eps_matches_diffusers_on_tiny_activations",),
        "LayerNorm / QK-RMSNorm eps of 1e-5 instead of FLUX.2's 1e-6",
    ),
    Mutant(
        "qwen3-rms-eps", "klein_core/models/qwen3.py",
        "theta, eps = 1e6, 1e-6", "theta, eps = 1e6, 1e-5",
        ("tests/test_text_encoder.py::test_fp32_parity_every_layout[comfy_file]",),
        "Qwen3's RMSNorm eps for files without a config.json",
    ),
    # ----- VAE -----
    Mutant(
        "vae-bn-eps", "klein_core/models/vae.py",
        "BN_EPS = 1e-4", "BN_EPS = 1e-5",
        ("tests/test_vae.py::test_parity_every_layout[diffusers-dict]",),
        "the latent BatchNorm's eps of the usual default, not FLUX.2's 1e-4",
    ),
    # ----- LoRA -----
    Mutant(
        "lora-alpha-over-rank", "klein_core/lora/read.py",
        "            scale = alpha / rank\n", "            scale = alpha\n",
        ("tests/test_lora.py::test_bfl_name_formats_every_linear[kohya]",),
        "Kohya / ai-toolkit alpha not divided by the rank",
    ),
    Mutant(
        "lora-strength-ignored", "klein_core/lora/apply.py",
        "delta[_rows(patch, base.shape[0])] += strength * patch.delta(base.device)",
        "delta[_rows(patch, base.shape[0])] += patch.delta(base.device)",
        ("tests/test_lora.py::test_stacking_order_and_sum_of_deltas",),
        "merged LoRAs always at strength 1",
    ),
    Mutant(
        "dora-row-norm-after-delta", "klein_core/lora/patches.py",
        "return scale / (torch.linalg.vector_norm(weight, dim=1) + torch.finfo(torch.float32).eps)",
        "return scale / (torch.linalg.vector_norm(weight + self.delta(weight.device), dim=1) + 1.2e-7)",
        ("tests/test_lora_comfy_native.py::test_dora_loras_match_comfyuis_own_lora_code",),
        "a LyCORIS DoRA scale per output row divides by the norm after the delta, not ComfyUI's before",
    ),
    # ----- quantisation -----
    Mutant(
        "fp8-dequantize-scale", "klein_core/quant/fp8.py",
        "return (q.float() * s).to(dtype)", "return q.float().to(dtype)",
        ("tests/test_quant.py::test_uint8_container_and_dequantize_mode",),
        "float8 weights used without their scale",
    ),
    Mutant(
        "gguf-qwen3-gate-up-swapped", "klein_core/files/gguf.py",
        '"ffn_gate": "mlp.gate_proj",\n    "ffn_up": "mlp.up_proj"',
        '"ffn_gate": "mlp.up_proj",\n    "ffn_up": "mlp.gate_proj"',
        ("tests/test_gguf.py::test_qwen3_gguf_in_llama_cpp_names",),
        "llama.cpp's ffn_gate/ffn_up read into each other (the test files were once written with this very "
        "table, so the swap went unseen)",
    ),
    Mutant(
        "gguf-q4_0-offset", "klein_core/quant/ggml.py",
        "(_nibbles(b[:, 2:]).to(torch.int8) - 8)", "(_nibbles(b[:, 2:]).to(torch.int8) - 7)",
        ("tests/test_gguf.py::test_dequantize_is_bit_identical_to_gguf",),
        "Q4_0 codes centred on 7",
    ),
    # ----- caches -----
    # Branch LoRA factors are buffers of their Linear now, which the key (weights_state) follows, so
    # the LoRA guard alone removed is no longer a bug; the guard inverted still is, both ways.
    Mutant(
        "kv-cache-lora-guard-inverted", "klein_core/pipeline/reference_kv.py",
        "if has_loras(model):  # branches:", "if not has_loras(model):  # branches:",
        ("tests/test_kv.py::test_reference_kv_reuse_gives_the_same_latents_and_saves_the_pass",
         "tests/test_kv.py::test_loras_on_the_model_bypass_the_kv_cache"),
        "models without LoRAs never served from the cache, models with them cached",
    ),
    Mutant(
        "bounded-cache-serves-other-owner", "klein_core/pipeline/bounded_cache.py",
        "if hit is None or (hit[0] is not None and hit[0]() is not owner):", "if hit is None:",
        (f"{ESC}::test_bounded_cache_serves_an_entry_only_to_its_owner",),
        "an entry served to another owner than the one it was made for",
    ),
    Mutant(
        "prompt-cache-ignores-activations", "klein_core/pipeline/prompts.py",
        "return (self.max_tokens, str(self.activations))", "return (self.max_tokens,)",
        ("tests/test_prompts.py::test_cache_keys_include_the_options",),
        "ComfyUI-way (fp32) embeddings served for the BFL way and back",
    ),
    Mutant(
        "prompt-disk-cache-ignores-mtime", "klein_core/files/source.py",
        'f"{f.name}:{(st := f.stat()).st_size}:{st.st_mtime_ns}"', 'f"{f.name}:{f.stat().st_size}"',
        ("tests/test_prompts.py::test_disk_cache_misses_when_the_encoder_file_changes",),
        "a replaced encoder file of the same size keeps serving the old file's embeddings",
    ),
    Mutant(
        "prompt-identity-ignores-dtype", "klein_core/pipeline/prompts.py",
        """return f"{files}|{str(dtype).removeprefix('torch.')}|{quantize}|{torch.device(device).type}\"""",
        """return f"{files}|{quantize}|{torch.device(device).type}\"""",
        (f"{ESC}::test_prompt_cache_identity_keys_on_dtype_and_quantisation",),
        "bf16 embeddings served to the same encoder file loaded in fp32",
    ),
    Mutant(
        "node-model-cache-ignores-mtime", "nodes/cache.py",
        "os.stat(path).st_mtime_ns", "0",
        ("tests/test_node_cache_identity.py::test_a_replaced_model_file_is_loaded_again",),
        "the pack keeps serving a model whose file was replaced under the same name",
    ),
    Mutant(
        "step-cache-keeps-state-across-runs", "klein_core/accel/step_cache.py",
        "        self._passes = {}\n        self._logged = False", "        self._logged = False",
        ("tests/test_step_cache.py::test_no_state_leaks_into_the_next_run",),
        "a new run starts from the last run's residuals",
    ),
    # ----- prompts and copies (thirteenth session) -----
    Mutant(
        "trim-length-not-rounded-up", "klein_core/pipeline/prompts.py",
        "trimmed = -(-longest // self.trim) * self.trim", "trimmed = longest // self.trim * self.trim",
        ("tests/test_prompts.py::test_trim_pads_to_a_multiple_of_its_value",),
        "trimmed padding rounds down and cuts the end of the prompt",
    ),
    Mutant(
        "batch-decode-waits-per-image", "klein_core/pipeline/engine.py",
        "                    frames.append(pixels)\n", "                    frames.append(pixels)\n                    copies.wait()\n",
        ("tests/test_transfer.py::test_a_batch_decode_waits_once_after_its_last_image",),
        "the host waits for each image's copy before queuing the next decode",
    ),
    # ----- VAE tiles (fourteenth session) -----
    Mutant(
        "pinned-vae-tile-ignored", "klein_core/memory/planner.py",
        "            tiles = (vae_tile,)  # type: ignore[assignment]", "            pass",
        ("tests/test_planner.py::test_a_pinned_vae_tile_is_kept_and_only_the_placement_is_searched",),
        "a pinned VAE tile is ignored: the plan tiles as memory allows",
    ),
    Mutant(
        "decode-tile-whole-by-the-shorter-side", "klein_core/memory/tiling.py",
        "max(h, w) <= tile else tile", "min(h, w) <= tile else tile",
        ("tests/test_vae_tiling.py::test_decode_tile_says_when_a_tiled_decode_is_whole",),
        "a latent wider than the tile is recorded as decoded whole",
    ),
    Mutant(
        "decode-tiles-record-the-plan", "klein_core/pipeline/engine.py",
        "tiles.append(tiling.decode_tile(tile, *latents.shape[-2:]))", "tiles.append(plan.vae_tile)",
        ("tests/test_memory_wiring.py::test_a_decode_that_runs_out_of_memory_records_the_smaller_tiles_it_retried_in",),
        "the result names the planned tile, not the one an out-of-memory retry decoded in",
    ),
    # ----- ComfyUI's model patches on Klein Model to MODEL (fifteenth session) -----
    Mutant(
        "controlnet-output-residual-on-text-tokens", "nodes/model_patches.py",
        'h = self._add_control("output", i, h, n_txt)', 'h = self._add_control("output", i, h, 0)',
        ("tests/test_native_model.py::test_controlnet_residuals_match_comfyuis_flux",),
        "a ControlNet's single-block residuals land on the text tokens instead of the image's",
    ),
    Mutant(
        "single-block-replacement-ignored", "nodes/model_patches.py",
        'h = blocks.single(i, h) if ("single_block", i) not in self.replace else self._single(blocks, i, h)',
        "h = blocks.single(i, h)",
        ("tests/test_native_model.py::test_block_replacements_match_comfyuis_flux",
         "tests/test_native_model.py::test_skip_layer_guidance_node_matches_comfyuis_flux"),
        "SkipLayerGuidanceDiT's single layers run instead of being skipped",
    ),
    # ----- ComfyUI's LoRA loaders on the bridged MODEL of packed / fp8 weights (seventeenth session) -----
    Mutant(
        "packed-layer-unpatch-keeps-the-lora", "nodes/host.py",
        "_restored(self.model, restored - set(self.backup))", "_restored(self.model, set())",
        ("tests/test_native_lora_packed.py::test_comfyui_lora_on_a_gguf_model_is_applied_per_call",),
        "after ComfyUI unpatches a GGUF model, its layers still add the LoRA",
    ),
    Mutant(
        "packed-layer-without-a-weight-key", "nodes/native_model.py",
        "if isinstance(view, _PackedWeightPatches):", "if False:",
        ("tests/test_native_lora_packed.py::test_comfyui_lora_on_a_gguf_model_is_applied_per_call",),
        "ComfyUI finds no key for a GGUF layer: every LoRA key 'not loaded', the LoRA silently ignored",
    ),
    # ----- the text encoder's CUDA graphs in ComfyUI (nineteenth session) -----
    Mutant(
        "graphs-dropped-on-every-detach", "nodes/host.py",
        "            if unpatch_all:\n                release_text_graphs(self.model)",
        "            if True:\n                release_text_graphs(self.model)",
        ("tests/test_text_graph.py::test_comfyui_detaching_a_model_it_loads_again_keeps_its_graphs",
         "tests/test_nodes_host.py::test_the_encoder_node_replays_its_graph_run_after_run"),
        "every node run drops the encoder's graphs, records again, and gives replay up after two runs",
    ),
    Mutant(
        "graphs-kept-on-offload", "nodes/host.py",
        "            if unpatch_all:\n                release_text_graphs(self.model)",
        "            if False:\n                release_text_graphs(self.model)",
        ("tests/test_text_graph.py::test_comfyui_offloading_the_encoder_releases_its_graphs",),
        "ComfyUI offloads the encoder but its graphs keep device memory ComfyUI does not count",
    ),
    # ----- measurements and the nodes' host work (twentieth session) -----
    Mutant(
        "memory-benchmark-resident-left-in-cpu-memory", "benchmarks/memory.py",
        'names = [c for c, where in plan.placements.items() if where == "resident" and c in components]',
        'names = []',
        ("tests/test_planner.py::test_memory_benchmark_runs_resident_components_on_the_device",
         "tests/test_planner.py::test_memory_benchmark_uncapped_resident_runs_without_the_cap"),
        "a resident row measures a staged run: the largest stage's peak, and a time with every weight copied in",
    ),
    Mutant(
        "probed-file-remembered-after-it-changed", "nodes/common.py",
        "    return _probe_state(path, st.st_size, st.st_mtime_ns)", "    return _probe_state(path, 0, 0)",
        ("tests/test_nodes.py::test_model_files_are_probed_once_until_they_change",),
        "a model file replaced under the same name keeps the old file's kind: a wrong file is not refused",
    ),
    Mutant(
        "staged-read-slice-at-the-wrong-offset", "klein_core/files/staging.py",
        "self._queue_copy(out[done : done + got], slot[:got])",
        "self._queue_copy(out[:got], slot[:got])",
        ("tests/test_staging.py::test_reads_through_slots_give_the_stored_bytes",
         "tests/test_staging.py::test_a_load_reads_its_plain_weights_through_the_stager"),
        "a tensor larger than one slot loads with every slice written over its first bytes: garbage weights",
    ),
    Mutant(
        "staged-slot-refilled-before-its-copy-ran", "klein_core/files/staging.py",
        "                self._wait(token)  # the slot's previous copy has read it: it may be refilled\n",
        "",
        ("tests/test_staging.py::test_no_slot_is_refilled_before_its_copy_has_run",),
        "on a GPU a slot's copy may still be queued when the next slice is read into it: weights silently "
        "mixed from two slices",
    ),
    Mutant(
        "pinned-chunk-offsets-overlap", "klein_core/memory/pinned.py",
        "                b[2].append((i, b[1]))\n                b[1] += need\n",
        "                b[2].append((i, b[1]))\n",
        ("tests/test_pinned.py::test_streamed_blocks_live_in_packed_page_locked_chunks",
         "tests/test_pinned.py::test_chunks_hold_every_tensor_apart"),
        "streamed blocks' weights packed over one another in their page-locked chunk: every block computes "
        "with the last weight written there",
    ),
    Mutant(
        "pinned-originals-held-to-the-end", "klein_core/memory/pinned.py",
        "            tensors[i] = copy\n",
        "",
        ("tests/test_pinned.py::test_each_original_is_freed_before_the_next_chunk_is_made",),
        "every original weight kept until all chunks are made: streaming a model briefly needs twice its RAM",
    ),
    Mutant(
        "pinned-bound-per-chunk", "klein_core/memory/pinned.py",
        "if not refused and budget is not None and locked + size > budget:",
        "if not refused and budget is not None and size > budget:",
        ("tests/test_pinned.py::test_what_cannot_be_locked_stays_in_ordinary_memory",),
        "each chunk checked against the bound alone: a model locks any amount of RAM, chunk by chunk",
    ),
    Mutant(
        "pinned-budget-stops-all", "klein_core/memory/pinned.py",
        "        elif not refused:",
        "        elif reason is None:",
        ("tests/test_memory_hunt3.py::test_smaller_chunks_that_fit_are_pinned_after_a_larger_one_that_does_not",),
        "a chunk over the bound ends the pinning: smaller chunks that fit stay in ordinary memory",
    ),
    Mutant(
        "cgroup-nearest-limit-only", "klein_core/memory/host.py",
        "return (min(rooms) if rooms else None), (min(swaps) if swaps else None)",
        "return (rooms[0] if rooms else None), (swaps[0] if swaps else None)",
        ("tests/test_memory_hunt3.py::test_ram_available_is_bounded_by_a_tighter_parent_cgroup",
         "tests/test_memory_hunt3.py::test_ram_available_is_bounded_by_a_parent_cgroups_swap"),
        "only the process's own cgroup bounds the room: a fuller parent slice is missed",
    ),
    Mutant(
        "tied-weight-two-slots", "klein_core/memory/placement.py",
        "                if id(t) in seen:",
        "                if False:",
        ("tests/test_memory_hunt3.py::test_tied_weights_are_page_locked_once_and_stay_tied",
         "tests/test_memory_hunt3.py::test_a_tied_weight_is_copied_once_for_a_stage_and_stays_tied"),
        "a tied weight gets a slot per owner: pinned twice, and the tie broken",
    ),
    Mutant(
        "native-vae-read-by-probe", "nodes/host.py",
        "            if (caller.f_globals.get(\"__name__\"), caller.f_code.co_name) in _MODEL_PROBES:",
        "            if False:",
        ("tests/test_native_interop.py::test_comfyuis_model_probes_do_not_read_a_native_vae",),
        "current ComfyUI's question whether an output holds a model reads the native VAE's file",
    ),
    Mutant(
        "hand-enabled-speed-unmarked", "klein_core/accel/fast.py",
        "    model.__dict__[SPEED_ATTR] = CUSTOM_SPEED  # apply_speed names its own speed after this",
        "    pass",
        ("tests/test_accel_hunt.py::test_plain_speed_after_fast_paths_enabled_by_hand_restores_the_plain_transformer",),
        "fast paths switched on by hand read as plain: apply_speed(..., 'plain') leaves them on",
    ),
    Mutant(
        "compile-fallback-plain-ops", "klein_core/accel/fast.py",
        "            ops.compile_failed()",
        "            pass",
        ("tests/test_accel_hunt.py::test_after_a_compiler_failure_the_blocks_run_the_fast_path_not_the_plain_one",),
        "after a compiler failure the blocks run the plain steps, not the fast path's kernels",
    ),
    Mutant(
        "copy-compile-failure-per-block", "klein_core/accel/fast.py",
        "        if group.failed or (in_copy and group.copies_failed):  # fell back after this was made",
        "        if group.failed:",
        ("tests/test_accel_hunt.py::test_a_compiler_failure_in_a_lora_copy_is_said_once_per_copy",),
        "a LoRA copy's compiler failure warned (and retried) once per block",
    ),
    Mutant(
        "text-graph-under-autocast", "klein_core/accel/text_graph.py",
        "        if torch.is_autocast_enabled(device.type):",
        "        if False:",
        ("tests/test_accel_hunt.py::test_replay_under_another_autocast_state_gives_the_eager_features",),
        "a text-encoder graph recorded outside autocast replayed inside it",
    ),
    Mutant(
        "bridge-keeps-compile-ops", "nodes/native_model.py",
        "        eager_view(view, transformer)",
        "        pass",
        ("tests/test_accel_hunt.py::test_the_bridged_view_of_a_compile_speed_model_runs_the_fast_kernels",),
        "Klein Model to MODEL of a compile-speed model runs the plain steps",
    ),
    Mutant(
        "vae-compile-fallback-plain-norms", "klein_core/accel/fast.py",
        "            eager = None if fused else functools.partial(_fuse_vae_norms, vae, part, norm)",
        "            eager = None",
        ("tests/test_accel_hunt.py::test_after_a_compiler_failure_the_vae_runs_its_fused_norms",),
        "after the VAE fails to compile it decodes channels-last with the plain GroupNorms (the slow path)",
    ),
    Mutant(
        "text-batch-without-negative", "klein_core/memory/planner.py",
        "act = text_activation_bytes(r.text_length, r.text_batch or r.batch,",
        "act = text_activation_bytes(r.text_length, r.batch,",
        ("tests/test_planner_hunt.py::test_cfg_text_stage_counts_the_negative_prompt_encoded_in_the_same_batch",),
        "the text stage estimated for the prompts alone while the negative is encoded in the same batch",
    ),
    Mutant(
        "init-image-encode-unplanned", "klein_core/memory/planner.py",
        "    encoded = r.references + r.encoded",
        "    encoded = r.references",
        ("tests/test_planner_hunt.py::test_an_init_image_that_is_not_a_reference_is_still_encoded_within_the_plan",),
        "an init image that joins no sequence is encoded outside the plan",
    ),
    Mutant(
        "kv-steps-without-joined-keys", "klein_core/memory/planner.py",
        "            act += 2 * seqs * (tokens + r.reference_tokens) * hidden * e",
        "            pass",
        ("tests/test_planner_hunt.py::test_kv_mode_steps_count_the_reference_keys_joined_per_sequence",),
        "KV-mode steps estimated without the stored keys and values joined to each sequence",
    ),
    Mutant(
        "fp32-components-estimated-as-bf16", "klein_core/memory/planner.py",
        "            if dtype == torch.float32}",
        "            if False}",
        ("tests/test_planner_hunt.py::test_float32_components_are_estimated_with_float32_activations",),
        "a float32 transformer's activations estimated at 2 bytes",
    ),
    Mutant(
        "component-on-device-planned-off", "klein_core/memory/planner.py",
        "        held = sorted(c for c in stay if placements.get(c, _R) != _R)",
        "        held = []",
        ("tests/test_planner_hunt.py::test_a_component_already_on_the_device_is_planned_as_staying_there",),
        "a component held on the device is planned as staged or streamed, which it never is",
    ),
    Mutant(
        "block-attach-leaves-weights", "klein_core/memory/placement.py",
        "            self.detach()\n            raise",
        "            raise",
        ("tests/test_planner_hunt.py::test_a_stage_that_runs_out_of_memory_while_placing_puts_every_weight_back",),
        "running out of memory while attaching the streamed blocks leaves weights on the device",
    ),
    Mutant(
        "vae-placed-twice-for-one-stage", "klein_core/pipeline/engine.py",
        "        if component in self._placed:",
        "        if False:",
        ("tests/test_planner_hunt.py::test_the_vae_is_placed_once_for_references_and_an_init_image",),
        "references and an init image each place the VAE: a staged VAE copied in twice for one stage",
    ),
    Mutant(
        "cached-cut-prompt-silent", "klein_core/pipeline/prompts.py",
        "        if options.truncate:  # cached or not, a cut prompt is said, by its place in the caller's list",
        "        if False:",
        ("tests/test_prompt_hunt.py::test_a_cut_prompt_served_from_the_disk_cache_is_still_warned",),
        "a prompt cut at 512 tokens and served from the cache is cut without a word",
    ),
    Mutant(
        "in-memory-encoder-key-without-dtype", "klein_core/pipeline/prompts.py",
        "    return id(encoder), str(weight.dtype), str(weight.device)",
        "    return id(encoder)",
        ("tests/test_prompt_hunt.py::test_an_in_memory_encoder_converted_to_another_dtype_gets_its_own_embeddings",),
        "an in-memory encoder converted to another dtype is served its old embeddings",
    ),
    Mutant(
        "host-oom-named-gpu", "klein_core/pipeline/oom.py",
        'if not isinstance(exc, torch.OutOfMemoryError) and "MPS" not in text and any(s in text for s in _HOST_WORDS):',
        'if False:',
        ("tests/test_cuda_paths.py::test_out_of_memory_names_the_memory_that_ran_out",),
        "host memory running out on a GPU run is called GPU memory, with the advice to offload to the CPU",
    ),
    Mutant(
        "loaded-encoder-identity-stat-now", "klein_core/pipeline/prompts.py",
        "    if isinstance(recorded, tuple) and len(recorded) == 2 and recorded[0] == source:",
        "    if False:",
        ("tests/test_prompt_hunt.py::test_a_file_replaced_under_a_loaded_encoder_keeps_the_old_weights_out_of_the_new_files_entries",),
        "a file replaced under a loaded encoder: the old weights' embeddings stored and served under the new file's key",
    ),
    Mutant(
        "encoder-identity-without-config", "klein_core/files/loaders.py",
        '        if component == "text_encoder" and path.is_dir() and (config := hf_config_path(path)) is not None:',
        "        if False:",
        ("tests/test_prompt_hunt.py::test_a_changed_config_json_is_a_new_encoder_for_the_prompt_cache",),
        "a folder encoder's changed config.json (rms_norm_eps, rope_theta): the old config's embeddings served",
    ),
    Mutant(
        "fp8-fp16-scale-rounded", "klein_core/quant/fp8.py",
        "        if dtype == torch.float16:  # in float32 row blocks: a temporary of 4 MiB-ish rows, not the weight's",
        "        if False:",
        ("tests/test_quant_hunt.py::test_fp8_layer_in_fp16_keeps_its_weight_scale",),
        "an fp8 layer in fp16 rounds its scale to fp16 first: small-amax layers lose precision, tiny ones compute zeros",
    ),
    Mutant(
        "fp8-to-dtype-densified", "klein_core/quant/fp8.py",
        "            if id(t) in kept and out.dtype != t.dtype:",
        "            if False:",
        ("tests/test_quant_hunt.py::test_fp8_model_to_dtype_keeps_fp8_storage_and_its_scales",),
        "model.to(bf16) turns fp8 layers dense and rounds their float32 scales",
    ),
    Mutant(
        "fp8-lora-merge-requantises-every-row", "klein_core/lora/apply.py",
        "        kept = ~(delta != 0).any(dim=1)",
        "        kept = torch.zeros(delta.shape[0], dtype=torch.bool, device=delta.device)",
        ("tests/test_quant_hunt.py::test_lora_merge_into_a_per_row_fp8_layer_leaves_untouched_rows_alone",),
        "a LoRA on q merged into a per-row-scaled fused qkv moves the k and v rows by requantising them",
    ),
    Mutant(
        "decode-retry-untiled-side", "klein_core/pipeline/engine.py",
        "        tiles = [tile] + [t for t in TILE_SIDES if t < max(h, w) and (tile is None or t < tile)]",
        "        tiles = [tile] + [t for t in TILE_SIDES if tile is None or t < tile]",
        ("tests/test_vae_hunt.py::test_out_of_memory_retry_does_not_rerun_the_same_whole_decode",),
        "a decode out of memory is retried whole under the name 'tiles of 64' (a side as large as the latents tiles nothing)",
    ),
    Mutant(
        "linked-guidance-refused", "nodes/sampler.py",
        "        return True if guidance is None else _guidance_problem(guidance) or True",
        "        return _guidance_problem(guidance) or True",
        ("tests/test_node_options_hunt.py::test_a_linked_guidance_passes_the_queue_check_and_is_checked_when_the_sampler_runs",),
        "guidance fed by a primitive node is refused when the prompt is queued ('got None')",
    ),
    Mutant(
        "linked-guidance-unchecked", "nodes/sampler.py",
        "        if (problem := _guidance_problem(guidance)) is not None:",
        "        if (problem := None) is not None:",
        ("tests/test_node_options_hunt.py::test_a_linked_guidance_passes_the_queue_check_and_is_checked_when_the_sampler_runs",),
        "a linked guidance out of range (or NaN) reaches the sampler unchecked",
    ),
    Mutant(
        "dataset-from-working-folder", "nodes/train.py",
        "    for candidate in candidates:",
        "    for candidate in ():",
        ("tests/test_train_node.py::test_a_relative_dataset_is_read_in_comfyuis_input_folder",),
        "the shipped workflow's dataset input/klein_lora_dataset is looked for in the server's working folder only",
    ),
    Mutant(
        "strength-skipping-no-step-silent", "klein_core/pipeline/engine.py",
        "                if runs == run.steps and init.strength < 1:",
        "                if False:",
        ("tests/test_sampling_hunt.py::test_a_strength_that_skips_no_step_is_said",),
        "denoise 0.8 at 4 steps starts from pure noise without a word (the image unused when not a reference)",
    ),
    Mutant(
        "large-rgba-reference-resized-with-alpha", "klein_core/pipeline/images.py",
        '        if image.mode not in _HIGH_BIT_MODES and image.mode not in ("RGB", "L"):',
        "        if False:",
        ("tests/test_batch_refs_hunt.py::test_a_large_reference_with_alpha_or_a_palette_is_scaled_as_its_rgb_pixels",),
        "a reference over 1 MP with alpha is resized with the alpha applied: transparent white turns black",
    ),
    Mutant(
        "inherited-size-over-4mp-unnamed", "klein_core/pipeline/request.py",
        "        if area > MAX_PIXELS:",
        "        if False:",
        ("tests/test_batch_refs_hunt.py::test_an_inherited_size_over_4_megapixels_names_the_reference_it_came_from",),
        "an output size over 4 MP taken from reference 1 is blamed on 'Output size', which the user never gave",
    ),
    Mutant(
        "tensor-reference-size-unnamed", "klein_core/pipeline/vae_io.py",
        "        if px.shape[-1] % down or px.shape[-2] % down:",
        "        if False:",
        ("tests/test_batch_refs_hunt.py::test_a_bad_tensor_reference_is_refused_naming_which_reference",),
        "a tensor reference of a size the VAE refuses is refused without saying which reference",
    ),
    Mutant(
        "peft-loha-metadata-ignored", "klein_core/lora/read.py",
        '        if cfg and str(cfg.get("peft_type", "")).upper() == "LOHA":  # PEFT LoHa: alpha / r, as LoKr',
        "        if False:",
        ("tests/test_lora_formats_hunt.py::test_peft_loha_with_diffusers_metadata_uses_alpha_over_r",),
        "a PEFT LoHa runs at scale 1, not its metadata's alpha / r",
    ),
    Mutant(
        "lora-skipped-logged-unnamed", "klein_core/lora/apply.py",
        "        log_skipped(lora.name, own)",
        '        log_skipped("LoRA", own)',
        ("tests/test_lora_formats_hunt.py::test_not_applied_warning_names_each_file_when_two_loras_are_stacked",),
        "keys not applied are logged without the file they came from",
    ),
    Mutant(
        "keep-checkpoints-negative-slice", "klein_core/train/trainer.py",
        "        for _, state in found[:max(0, len(found) - keep_others)]:  # (a negative end cut from the front)",
        "        for _, state in found[:len(found) - keep_others]:",
        ("tests/test_train_hunt3.py::test_keep_checkpoints_of_four_or_more_keeps_that_many",),
        "keep_checkpoints 4 or more keeps fewer states than asked (a negative slice end deletes from the front)",
    ),
    Mutant(
        "bucket-float-rounding", "klein_core/train/data.py",
        "    w = max(1, math.isqrt(area * width // height) // PIXELS_PER_TOKEN) * PIXELS_PER_TOKEN",
        "    w = max(1, int(width * math.sqrt(area / (width * height))) // PIXELS_PER_TOKEN) * PIXELS_PER_TOKEN",
        ("tests/test_train_hunt3.py::test_square_images_get_the_square_bucket_of_the_resolution",),
        "square images of many sizes get the bucket one step below the resolution",
    ),
    Mutant(
        "toml-text-option-untyped", "klein_core/train/cli.py",
        "        if key in o and not isinstance(o[key], str):",
        "        if False:",
        ("tests/test_train_hunt3.py::test_a_toml_option_of_the_wrong_type_names_the_option",),
        "a TOML number for resume (or cache_dir) ends in a traceback, not a line naming the option",
    ),
    Mutant(
        "native-model-pads-pack-text", "nodes/host.py",
        "            if NATIVE_ENCODER_KEY in kwargs:  # the pack's encoder: its length as the Klein Sampler uses it",
        "            if False:",
        ("tests/test_native_interop_hunt.py::test_trimmed_conditioning_through_klein_model_to_model_equals_the_klein_sampler",),
        "trimmed prompts through Klein Model to MODEL padded back to 512 with zero rows in front",
    ),
    Mutant(
        "released-transformer-read-again", "nodes/cache.py",
        "            model = _released.pop(ref, None)",
        "            model = None",
        ("tests/test_native_interop_hunt.py::test_unload_models_leaves_one_copy_of_the_transformer_for_both_paths",),
        "after Unload models the transformer a bridged MODEL holds is read again beside it (two copies)",
    ),
    Mutant(
        "batched-native-conditioning-accepted", "nodes/sampler.py",
        "    if value[0][0].shape[0] != 1:  # several prompts in one entry: each would get batch_size images",
        "    if False:",
        ("tests/test_native_interop_hunt.py::test_a_batched_conditioning_is_refused_or_gives_batch_size_images",),
        "a 2-prompt native conditioning gives 2 x batch_size images",
    ),
    Mutant(
        "cli-overflow-traceback", "klein_core/cli.py",
        "    except (FloatingPointError, torch.OutOfMemoryError) as exc:  # a run that failed: its message says why",
        "    except torch.OutOfMemoryError as exc:",
        ("tests/test_docs_claims_hunt.py::test_an_overflow_in_the_cli_is_one_line_not_a_traceback",),
        "numbers that overflow end the CLI in a 20-line traceback, not one error line",
    ),
    Mutant(
        "cli-out-format-not-tried", "klein_core/cli.py",
        "    if fmt is None or fmt not in Image.SAVE or not _writes_rgb(fmt):",
        "    if fmt is None or fmt not in Image.SAVE:",
        ("tests/test_docs_claims_hunt.py::test_an_out_extension_pil_cannot_write_is_refused_before_any_model_loads",),
        "--out o.xbm passes the check, and the generation is lost when PIL cannot write it at the end",
    ),
    Mutant(
        "demo-ignores-model-flags", "klein_core/cli.py",
        '        if ignored:\n            raise CLIError(f"--demo runs',
        '        if False:\n            raise CLIError(f"--demo runs',
        ("tests/test_docs_claims_hunt.py::test_model_without_models_dir_is_refused_also_with_demo",),
        "--demo --model X runs the demo model without a word; --demo --quantize q4 records a q4 that never ran",
    ),
    Mutant(
        "distilled-guidance-reported-as-asked", "klein_core/pipeline/request.py",
        '    ran = guidance if kind == "base" else 1.0',
        "    ran = guidance",
        ("tests/test_docs_claims_hunt.py::test_the_result_says_the_guidance_that_ran",),
        "a distilled run reports (and the PNG records) the guidance asked, not the 1 that ran",
    ),
    Mutant(
        "ray-surrogate-prompt-ends-job", "klein_core/distributed/rows.py",
        "        except ValueError as exc:  # not valid Unicode text (an unpaired surrogate): this row, not the job",
        "        except RowError as exc:",
        ("tests/test_ray_hunt2.py::test_lone_surrogate_prompt_is_a_bad_row_not_the_end_of_the_job",),
        "one prompt with half an emoji stops the whole batch job before any row runs",
    ),
    Mutant(
        "ray-csv-extra-cells-dropped", "klein_core/distributed/rows.py",
        "                    if extra and any(str(v).strip() for v in extra):",
        "                    if False:",
        ("tests/test_ray_hunt2.py::test_csv_row_with_more_cells_than_the_header_is_refused",),
        "a CSV prompt with an unquoted comma runs cut at the comma",
    ),
    Mutant(
        "ray-lora-strength-rounded", "klein_core/distributed/runner.py",
        '                  "loras": [f"{n}:{strength_text(s)}" for n, s in row.loras], **self.spec.png_params(),',
        '                  "loras": [f"{n}:{s:g}" for n, s in row.loras], **self.spec.png_params(),',
        ("tests/test_ray_hunt2.py::test_lora_strength_in_the_parameters_is_the_one_that_ran",),
        "a batch PNG records a rounded LoRA strength that did not run",
    ),
    Mutant(
        "kv-cache-keyed-on-stage-copies", "klein_core/pipeline/engine.py",
        "                    ref_kv = (self.kv_cache.get(model, refs, weights=home) if self.kv_cache is not None",
        "                    ref_kv = (self.kv_cache.get(model, refs) if self.kv_cache is not None",
        ("tests/test_kv_cache_hunt.py::test_the_engine_keys_the_kv_cache_on_the_weights_home_not_the_stage_copies",),
        "a staged or streamed 9B-KV never reuses its reference keys/values (keyed by the per-stage copies)",
    ),
    Mutant(
        "stitch-pastes-fill-bands", "klein_core/pipeline/inpaint.py",
        "            region = region.crop((left, top, left + src_w, top + src_h))",
        "            pass",
        ("tests/test_inpaint_hunt2.py::test_crop_box_clipped_by_the_border_stitches_the_crop_back_in_place",),
        "a crop box clipped by the border comes back squeezed and shifted (its fill bands pasted too)",
    ),
    Mutant(
        "composite-mask-read-plainly", "klein_core/pipeline/inpaint.py",
        "    mask = mask_image(mask)  # read as crop_for_inpaint reads it (float, alpha-only and tensor masks)",
        "    mask = mask if isinstance(mask, Image.Image) else mask_image(mask)",
        ("tests/test_inpaint_hunt2.py::test_stitch_reads_the_mask_as_crop_for_inpaint_does",),
        "a float or alpha-only mask loses the painted area in stitch / composite",
    ),
    Mutant(
        "inpaint-palette-resized-nearest", "klein_core/pipeline/inpaint.py",
        '    if image.mode not in ("RGB", "L"):\n        # Pillow resizes palette pictures',
        '    if False:\n        # Pillow resizes palette pictures',
        ("tests/test_inpaint_hunt2.py::test_palette_picture_is_prepared_as_its_rgb_pixels",),
        "a palette picture is resized with NEAREST and an RGBA one with its transparent pixels black",
    ),
    Mutant(
        "cli-feather-checked-late", "klein_core/cli.py",
        "    if args.feather is not None and args.feather < 0:",
        "    if False:",
        ("tests/test_inpaint_hunt2.py::test_cli_refuses_bad_inpaint_numbers_before_loading_the_models",),
        "--feather -2 is refused only after every model loaded",
    ),
)
