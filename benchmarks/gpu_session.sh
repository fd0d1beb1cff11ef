#!/usr/bin/env bash
# One GPU session in one device call: environment record, carried packages, benchmarks, the GPU test suite.
#
#   bash benchmarks/gpu_session.sh [--dry-run] [PHASE ...]
#
# A session is lent 15 minutes of device time in all, the machine's start (1-2 min) included, and
# a command may run 10 minutes. So the default phase list is one call of at most
# KLEIN_SESSION_BUDGET seconds (default 560; run it with timeout_s=590), most important first.
# Seconds: what the same commands took on a fresh H100 (2026-11-26, third session, compile cache
# cold); no promise for another machine:
#   speed4b   benchmarks/speed.py 4B cases a,b (diffusers, diffusers+compile, default, compile; 2 timed
#             runs): 146 s with plain as well; then case c (base, 50 steps, CFG, same variants, 1 run): 105 s
#   speed9b   benchmarks/speed.py 9B cases a,b (same variants, 1 run): 87 s
#   vae       benchmarks/vae_decode.py eager decode layouts (plain, fast, ...) profiled, no compiled
#             ones (speed.py's compile variant times the compiled decode): 12-17 s (starts only with 30 s left);
#             since the twentieth session also each layout's peak memory against the planner's estimate
#             and what is live at that peak (vaemem: the same at 2048², optional, not timed yet)
#   tests     pytest tests/gpu with no KLEIN_GPU_TESTS_* variable (the nodes test runs in the
#             ComfyUI host when .devpack carried it): 122 s
#   memory9b  benchmarks/memory.py 9B 1024x1024 edit with one reference (edit1024), bf16, speed fast:
#             resident, swap and blocks with no cap first, then every memory mode under --cap-gb 12, each
#             timed against the uncapped resident run: 84 s (starts only with 60 s left)
# Optional phases (name them; none is in the default list): warm (speed.py 4B case a, compile only,
# in a new process: the first call with torch's on-disk compile cache warm, 27 s), peer
# (benchmarks/comfy_peer.py, ComfyUI's own FLUX.2 per step, 4B, ~30 s), kernels (benchmarks/kernels.py),
# memory (memory.py 4B under --cap-gb 8 in bf16 and fp8, then kv_reuse.py). `all` = the default list.
# Fourth session (seconds on a fresh H100): fastpass (speed.py diffusers against default for 4B a, b, c
# and 9B a, b, 3 timed runs: 101 + 42 s), blocks (kernels.py --ops blocks, the fast path's steps one by
# one: 24 s), profile (profile_run.py, 4B a under torch.profiler: 14 s), fasttests (tests/gpu/test_gpu_fast.py:
# 55 s), compile4b (speed.py 4B a, b: compile against diffusers+compile, 5 timed runs since 2026-11-27 (2 before); did not finish in
# the 126 s it had left; 300 s now, on a cold compile cache, since both sides also compile their text
# encoder's layers).
# profilec (profile_run.py under speed="compile", 4B a) and texttests (the suite's text encoder tests:
# compiled, CUDA graph replay; since the eleventh session also the test that a generation waits for the
# GPU only for its results): 31 s and 35 s on 2026-11-27; profilec on a cold compile cache 48 s (sixteenth session). trainprof (profile_train.py: one LoRA training
# step of ours and of diffusers + peft under torch.profiler, 4B 1024² rank 32, then ours at speed fast):
# 43 + 24 s on 2026-11-27 (eighteenth session). trainfast (train_speed.py 4B at speed fast against
# diffusers + peft, then at speed compile; the training path of TrainJob(speed=...), 2 warm-up + 5
# timed steps): 37 + 77 s. (textgraph, the default path against the text encoder's CUDA graph, 32 s, is
# gone: the graph is part of speed fast since that measurement.)
# train (benchmarks/train_speed.py, LoRA training steps of issue 30: 4B, 9B, 9B edit in bf16, 9B streamed
# (memory blocks), and 9B, 9B edit on an fp8 base, rank 32, 2 warm-up + 5 timed steps each, against diffusers
# + peft in bf16; writes train.json; its timeout is 300 s): measured at speed plain in the ninth session;
# it runs at the trainer's default, fast since 2026-11-27: 114 s at fast (nineteenth session).
# nodesspeed (benchmarks/nodes_speed.py, since the twelfth session: what a ComfyUI user runs, the pack's
# encoder -> sampler -> VAE decode nodes on full-size 4B files, against klein_core.generate on the same
# files, 3 runs; writes 16 GB of random weights first): 61 s on 2026-11-27 (sixteenth session), 68 and 77 s (nineteenth), timeout 180 s.
# trim (speed.py 4B a, b: default against default+trim, the prompt padded to a multiple of 64 tokens
# instead of 512, opt-in and approximate; thirteenth session): 29 s on 2026-11-27, timeout 120 s.
#
# Always: $OUT/env.json (GPU, driver, torch, packages, date) and $OUT/session.log (every step's
# output, then the summary: exit code and seconds of each step; the summary is also printed last).
# Each step has its own timeout and no step starts once the budget is spent; a failing step never
# stops the others. The device tool returns at most 8 files: the default list writes 8 (session.log,
# env.json, speed_4b_ab.json, speed_4b_c.json, speed_9b_ab.json, parity.json, memory_9b_cap12.json,
# vae_decode.json); the summary's last line counts them.
#
# --dry-run runs the same steps on the CPU with the scripts' tiny options, to catch argument errors
# before spending device time (KLEIN_GPU_TESTS_DEVICE=cpu for the suite).
#
# Carried packages (benchmarks/make_devpack.sh builds them, git-ignored, about 42 MB): .devpack/whl/*.whl
# (diffusers and what it needs beyond the device image), .devpack/comfy_kitchen-*.tar.xz (comfy-kitchen
# without its 117 MB ROCm library) go to /tmp/site on PYTHONPATH; .devpack/comfy_host.tar.xz unpacks
# the ComfyUI host (.comfy_host/) for the nodes test and the peer.

set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
OUT="${OUT:-$REPO/out/gpu_session}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
DRY=0
PHASES=()
ALL=(speed4b speed9b vae tests memory9b)
OPTIONAL=(warm peer kernels memory fastpass blocks profile profilec texttests trainprof trainfast fasttests compile4b train nodesspeed trim vaemem)
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        speed4b|speed9b|tests|memory9b|vae|warm|peer|kernels|memory|fastpass|blocks|profile|profilec|texttests|trainprof|trainfast|fasttests|compile4b|train|nodesspeed|trim|vaemem)
            PHASES+=("$arg") ;;
        all) PHASES+=("${ALL[@]}") ;;
        -h|--help) sed -n '2,/^$/p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "unknown argument '$arg' (phases: ${ALL[*]} ${OPTIONAL[*]} all; option --dry-run)" >&2
           exit 2 ;;
    esac
done
[ ${#PHASES[@]} -eq 0 ] && PHASES=("${ALL[@]}")
# the device limit does not apply to a CPU dry run
if [ "$DRY" -eq 1 ]; then BUDGET="${KLEIN_SESSION_BUDGET:-3600}"; else BUDGET="${KLEIN_SESSION_BUDGET:-560}"; fi

export PYTHONUNBUFFERED=1
LOG="$OUT/session.log"
SUMMARY="$(mktemp)"
: > "$LOG"
echo "gpu_session phases=${PHASES[*]} dry_run=$DRY budget=${BUDGET}s start=$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
    | tee -a "$SUMMARY"

# [NEED=S] step NAME TIMEOUT COMMAND...: run with a timeout (cut to what the budget has left), output to
# the log; skipped when less than NEED seconds (default 20) of the budget are left.
step() {
    local name="$1" limit="$2" need="${NEED:-20}"
    shift 2
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt "$need" ]; then
        echo "$name rc=skipped (${left}s of the session budget of ${BUDGET}s left, it needs ${need}s)" \
            | tee -a "$SUMMARY"
        return 0
    fi
    # the CPU dry run checks arguments, not timings: the suite alone takes minutes on a few CPU cores
    [ "$DRY" -eq 1 ] && limit=$((limit * 4))
    [ "$limit" -gt "$left" ] && limit="$left"
    echo "=== $name (timeout ${limit}s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout --signal=INT --kill-after=15 "$limit" "$@" >> "$LOG" 2>&1
    local rc=$?
    [ "$rc" -eq 124 ] && rc="124(timeout)"
    echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$SUMMARY"
    return 0
}

record_env() {
    "$PY" - "$OUT/env.json" <<'EOF2'
import datetime, json, platform, subprocess, sys
info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "platform": platform.platform()}
try:
    q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap",
                        "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    info["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
except (OSError, subprocess.SubprocessError) as exc:
    info["nvidia_smi"] = f"unavailable: {exc}"
for mod in ("torch", "triton", "comfy_kitchen", "transformers", "diffusers", "safetensors", "numpy",
            "flash_attn", "flash_attn_interface", "psutil", "av"):
    try:
        m = __import__(mod)
        info[mod] = getattr(m, "__version__", "installed")
    except Exception as exc:  # noqa: BLE001 - any failure is worth recording
        info[mod] = f"missing ({type(exc).__name__})"
try:
    import torch
    info["cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        info["gpu_total_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        info["cudnn"] = torch.backends.cudnn.version()
except Exception as exc:  # noqa: BLE001
    info["torch_error"] = repr(exc)
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info))
EOF2
    echo "env rc=$?" >> "$SUMMARY"
}

# .devpack/ (benchmarks/make_devpack.sh): wheels and comfy-kitchen into /tmp/site, the ComfyUI host into
# .comfy_host/. Without them the steps still run: the diffusers variants drop out (speed.py says so),
# the fused kernels fall back to plain with one warning, and the nodes test skips naming the host.
install_pack() {
    local -a wheels=()
    mapfile -t wheels < <(compgen -G "$REPO/.devpack/whl/*.whl")
    mkdir -p /tmp/site
    if [ ${#wheels[@]} -gt 0 ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "${wheels[@]}" >> "$LOG" 2>&1
        echo "wheels rc=$? ($(for w in "${wheels[@]}"; do basename "$w"; done | tr '\n' ' '))" >> "$SUMMARY"
    fi
    for tarball in "$REPO"/.devpack/comfy_kitchen-*.tar.xz; do
        [ -f "$tarball" ] || continue
        tar xJf "$tarball" -C /tmp/site
        echo "comfy-kitchen rc=$? ($(basename "$tarball"))" >> "$SUMMARY"
    done
    if [ -f "$REPO/.devpack/comfy_host.tar.xz" ] && [ ! -f "$REPO/.comfy_host/READY.json" ]; then
        tar xJf "$REPO/.devpack/comfy_host.tar.xz" -C "$REPO"
        echo "comfy host rc=$?" >> "$SUMMARY"
    fi
    export PYTHONPATH="/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
}

has_diffusers() { "$PY" -c "import diffusers" >/dev/null 2>&1; }

runs() {  # timed runs and warm-ups of speed.py, or its tiny CPU form
    if [ "$DRY" -eq 1 ]; then echo "--tiny --runs 1 --warmup 0"; else echo "--runs ${1:-3} --warmup 1"; fi
}

no_diffusers() { if has_diffusers; then echo ""; else echo "--no-diffusers"; fi; }

# speed.py variants: `default` is what the nodes and the CLI run (speed="fast"), `compile` is fast + compile,
# `diffusers` / `diffusers+compile` diffusers as it comes / at its best. The step cache (default+step_cache)
# is left out: on random weights it skips almost nothing (2 of 50 steps, 2026-11-26).
BENCH="diffusers,diffusers+compile,default,compile"

phase_speed4b() {
    # shellcheck disable=SC2046
    step speed_4b_ab 200 "$PY" benchmarks/speed.py --models 4b --cases a,b $(runs 2) $(no_diffusers) \
        --variants "$BENCH" --out "$OUT/speed_4b_ab.json"
    # shellcheck disable=SC2046
    step speed_4b_c 150 "$PY" benchmarks/speed.py --models 4b --cases c $(runs 1) $(no_diffusers) \
        --variants "$BENCH" --out "$OUT/speed_4b_c.json"
}

phase_speed9b() {
    # shellcheck disable=SC2046
    step speed_9b_ab 160 "$PY" benchmarks/speed.py --models 9b --cases a,b $(runs 1) $(no_diffusers) \
        --variants "$BENCH" --out "$OUT/speed_9b_ab.json"
}

# The fast path against diffusers as it comes, for every target case (4B a, b, c; 9B a, b), 3 timed runs.
phase_fastpass() {
    # shellcheck disable=SC2046
    step fast_4b_abc 200 "$PY" benchmarks/speed.py --models 4b --cases a,b,c $(runs 3) $(no_diffusers) \
        --variants diffusers,default --out "$OUT/fast_4b_abc.json"
    # shellcheck disable=SC2046
    step fast_9b_ab 150 "$PY" benchmarks/speed.py --models 9b --cases a,b $(runs 3) $(no_diffusers) \
        --variants diffusers,default --out "$OUT/fast_9b_ab.json"
}

phase_compile4b() {  # speed="compile" against diffusers at its best (both with the text encoder compiled), 4B a, b
    # COMPILE_CASES=a times only the case of #26's compile target (text to image), in about half the time
    local cases="${COMPILE_CASES:-a,b}"
    # COMPILE_VARIANTS=diffusers+compile,compile,compile+encoder also times the compiled VAE encoder
    local variants="${COMPILE_VARIANTS:-diffusers+compile,compile}"
    # shellcheck disable=SC2046
    step "compile_4b_${cases//,/}" 300 "$PY" benchmarks/speed.py --models 4b --cases "$cases" $(runs 5) $(no_diffusers) \
        --variants "$variants" --out "$OUT/compile_4b_${cases//,/}.json"
}

phase_train() {  # LoRA training steps (issue 30): klein_core's trainer (bf16, fp8 base) against diffusers + peft
    local -a args=(--warmup 2 --steps 5)
    [ "$DRY" -eq 1 ] && args=(--tiny --device cpu --warmup 1 --steps 2)
    step train 300 "$PY" benchmarks/train_speed.py --cases all "${args[@]}" --out "$OUT/train.json"
}

phase_trainfast() {  # LoRA training 4B on the fast path (against diffusers + peft), then compiled
    local -a args=(--warmup 2 --steps 5) compiled=(--speed compile)
    [ "$DRY" -eq 1 ] && args=(--tiny --device cpu --warmup 1 --steps 2) && compiled=(--speed fast)  # inductor: minutes on a CPU
    step train_4b_fast 150 "$PY" benchmarks/train_speed.py --cases 4b --speed fast "${args[@]}" --out "$OUT/train_4b_fast.json"
    step train_4b_compile 240 "$PY" benchmarks/train_speed.py --cases 4b "${compiled[@]}" --no-diffusers "${args[@]}" \
        --out "$OUT/train_4b_compile.json"
}

phase_blocks() {  # one double and one single block per fast-path variant (kernels.py --ops blocks)
    local -a tiny=()
    [ "$DRY" -eq 1 ] && tiny=(--tiny --device cpu)
    step blocks 90 "$PY" benchmarks/kernels.py --models 4b,9b --ops blocks "${tiny[@]}" --out "$OUT/blocks.json"
}

# PROFILE_CASE=b profiles the edit with two references instead (its time outside the stages: 26-43 ms
# against 14-16 for text to image on the H200, 2026-11-28, not placed yet)
phase_profile() {  # one warm default generation under torch.profiler: kernels by family, GPU idle gaps
    local -a tiny=()
    local case="${PROFILE_CASE:-a}"
    [ "$DRY" -eq 1 ] && tiny=(--tiny --device cpu)
    step "profile_4b_$case" 60 "$PY" benchmarks/profile_run.py --model 4b --case "$case" "${tiny[@]}" \
        --out "$OUT/profile_4b_$case.json"
}

phase_profilec() {  # the same under speed="compile" (a new process: Inductor's on-disk cache from earlier phases helps)
    local -a tiny=()
    local case="${PROFILE_CASE:-a}"
    [ "$DRY" -eq 1 ] && tiny=(--tiny --device cpu --speed fast)  # inductor takes minutes on a few CPU cores
    step "profile_4b_${case}_compile" 120 "$PY" benchmarks/profile_run.py --model 4b --case "$case" --speed compile \
        "${tiny[@]}" --out "$OUT/profile_4b_${case}_compile.json"
}

phase_trim() {  # the default path with the prompt padded to a multiple of 64 tokens, not 512 (4B a and b, 3 runs)
    # shellcheck disable=SC2046
    step trim_4b_ab 120 "$PY" benchmarks/speed.py --models 4b --cases a,b $(runs 3) --no-diffusers \
        --variants default,default+trim --out "$OUT/trim_4b_ab.json"
}

phase_nodesspeed() {  # what a ComfyUI user runs: the node chain against klein_core.generate on the same files
    local -a args=(--model 4b --runs 3)
    [ "$DRY" -eq 1 ] && args=(--tiny --device cpu --runs 1 --warmup 0)
    step nodes_speed_4b 180 "$PY" benchmarks/nodes_speed.py "${args[@]}" --out "$OUT/nodes_speed_4b.json"
}

phase_trainprof() {  # one training step of ours and of diffusers + peft under torch.profiler (4B, rank 32, 1024²)
    local -a args=(--case 4b --warmup 2)
    [ "$DRY" -eq 1 ] && args=(--tiny --device cpu --warmup 1)
    step profile_train_4b 120 "$PY" benchmarks/profile_train.py "${args[@]}" --out "$OUT/profile_train_4b.json"
    step profile_train_4b_fast 90 "$PY" benchmarks/profile_train.py "${args[@]}" --speed fast --no-diffusers \
        --out "$OUT/profile_train_4b_fast.json"
}

phase_texttests() {  # the GPU suite's text encoder tests (compiled, CUDA graph replay) and its one-wait and trimmed-padding tests
    local -a env_vars=("KLEIN_PARITY_JSON=$OUT/parity_text.json" "KLEIN_PARITY_TABLE=1")
    [ "$DRY" -eq 1 ] && env_vars+=("KLEIN_GPU_TESTS_DEVICE=cpu")
    step texttests 90 env "${env_vars[@]}" "$PY" -m pytest -q -p no:cacheprovider -rs \
        -k "text_encoder or waits_for_the_device or trimmed" tests/gpu/test_gpu_fast.py tests/gpu/test_gpu_pipeline.py
}

phase_fasttests() {
    local -a env_vars=("KLEIN_PARITY_JSON=$OUT/parity.json" "KLEIN_PARITY_TABLE=1")
    [ "$DRY" -eq 1 ] && env_vars+=("KLEIN_GPU_TESTS_DEVICE=cpu")
    step fasttests 120 env "${env_vars[@]}" "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_fast.py
}

phase_tests() {
    local -a env_vars=("KLEIN_PARITY_JSON=$OUT/parity.json" "KLEIN_PARITY_TABLE=1")
    [ "$DRY" -eq 1 ] && env_vars+=("KLEIN_GPU_TESTS_DEVICE=cpu")
    step tests 200 env "${env_vars[@]}" "$PY" -m pytest -q -p no:cacheprovider -rs --durations=10 tests/gpu
}

phase_memory9b() {
    # resident (the reference time), swap and blocks with no cap, then every mode under a 12 GB cap, at speed fast
    local -a dev=()
    [ "$DRY" -eq 1 ] && dev=(--tiny --device cpu)
    NEED=60 step memory_9b_cap12 150 "$PY" benchmarks/memory.py --models 9b --precision bf16 \
        --cases edit1024 --cap-gb 12 --uncapped-modes swap,blocks --speed fast "${dev[@]}" --out "$OUT/memory_9b_cap12.json"
}

phase_vae() {
    # eager layouts only: the compiled decode is timed by speed.py's compile variant (and costs ~20 s cold)
    local -a tiny=()
    [ "$DRY" -eq 1 ] && tiny=(--tiny --runs 1 --warmup 1)
    NEED=30 step vae_decode 90 "$PY" benchmarks/vae_decode.py --no-compile "${tiny[@]}" \
        --out "$OUT/vae_decode.json"
}

phase_vaemem() {
    # the eager decode layouts at 2048²: what one decode allocates at its peak (against the planner's
    # estimate) and what is live then, as the vae phase records at 1024²
    local -a args=(--size 2048 --runs 2 --warmup 1)
    [ "$DRY" -eq 1 ] && args=(--tiny --runs 1 --warmup 1)
    step vae_decode_2048 90 "$PY" benchmarks/vae_decode.py --no-compile "${args[@]}" \
        --out "$OUT/vae_decode_2048.json"
}

phase_warm() {
    # a new process: dynamo traces again, Inductor's compiled code comes from torch's on-disk cache
    # shellcheck disable=SC2046
    step compile_warm 80 "$PY" benchmarks/speed.py --models 4b --cases a $(runs 1) --no-diffusers \
        --variants compile --out "$OUT/compile_warm.json"
}

phase_peer() {
    local -a args=(--model 4b --size 1024 --refs 0,2 --runs 5)
    [ "$DRY" -eq 1 ] && args=(--tiny)
    step comfy_peer 90 "$PY" benchmarks/comfy_peer.py "${args[@]}" --out "$OUT/comfy_peer_4b.json"
}

phase_kernels() {
    local -a kargs=()
    [ "$DRY" -eq 1 ] && kargs=(--tiny --device cpu --models 4b)
    step kernels 80 "$PY" benchmarks/kernels.py "${kargs[@]}" --out "$OUT/kernels.json"
}

phase_memory() {
    local -a dev=()
    [ "$DRY" -eq 1 ] && dev=(--tiny --device cpu)
    step memory_4b_cap8 170 "$PY" benchmarks/memory.py --models 4b --precision bf16,fp8 --cases edit1024 \
        --cap-gb 8 "${dev[@]}" --out "$OUT/memory_4b_cap8.json"
    if [ "$DRY" -eq 1 ]; then
        step kv_reuse 120 "$PY" benchmarks/kv_reuse.py --device cpu --dtype fp32 --hidden 64 --heads 2 \
            --depth 1 --single 2 --size 64 --refs 2 --steps 2 --out "$OUT/kv_reuse.json"
    else
        step kv_reuse 150 "$PY" benchmarks/kv_reuse.py --device cuda --dtype bf16 --hidden 4096 --heads 32 \
            --depth 8 --single 24 --size 1024 --refs 2 --steps 4 --out "$OUT/kv_reuse.json"
    fi
}

install_pack
record_env  # after the install, so it names the carried packages' versions
for phase in "${PHASES[@]}"; do
    "phase_$phase"
done
echo "end=$(date -u +%Y-%m-%dT%H:%M:%SZ) total_seconds=$SECONDS" >> "$SUMMARY"
files=$(find "$OUT" -maxdepth 1 -type f | wc -l)
over=""
[ "$files" -gt 8 ] && over="; over 8: the device tool returns 8"
echo "files in \$OUT: $files ($(ls "$OUT" | tr '\n' ' '))$over" >> "$SUMMARY"
# the printed tables of every benchmark, then the summary: what the device tool's output tail shows
grep -v -E '^20[0-9]{2}-[0-9]{2}-|^[[:space:]]*$|[Ww]arning|warnings\.warn|^  warn' "$LOG" | tail -c 9000
echo "--- summary"
cat "$SUMMARY" | tee -a "$LOG"
rm -f "$SUMMARY"
