#!/usr/bin/env bash
# One GPU session in one command: environment record, carried wheels, the GPU test suite, benchmarks.
#
#   bash benchmarks/gpu_session.sh [--dry-run] [PHASE ...]
#
# Phases (default: tests). Each fits one device call (at most 10 minutes); run them as separate calls:
#   tests    pytest tests/gpu (bf16 on CUDA, small and full-size Klein 4B), then
#            benchmarks/kernels.py (plain vs comfy-kitchen per op, fp8 Linear)       ~5-6 min
#   bench4b  benchmarks/speed.py 4B: cases a,b (plain, fast auto, fast sdpa_cudnn, compile, diffusers)
#            then case c (base, 50 steps, CFG)                                        ~7-8 min
#   bench9b  benchmarks/speed.py 9B: cases a,b with compile                           ~6-8 min
#   memory   tests/gpu/test_gpu_nodes.py (needs the ComfyUI host folders carried), then
#            benchmarks/memory.py 4B edit1024 under --cap-gb 8 and 9B under 12 (bf16 and fp8),
#            benchmarks/kv_reuse.py on CUDA in bf16 at 9B width                        ~6-8 min
#   all      every phase in turn (only with --dry-run: on a GPU it cannot fit one call)
#
# Always: $OUT/env.json (GPU, driver, torch, comfy-kitchen, date) and $OUT/summary.txt (exit code and
# seconds of every step). Each step has its own timeout and the script stops starting steps once
# KLEIN_SESSION_BUDGET seconds (default 540) have passed, so a call ends inside the 10-minute limit;
# a failing step never stops the others. Every phase writes at most 7 files to $OUT (the device tool
# returns 8 at most).
#
# --dry-run runs the same steps on the CPU with the scripts' tiny options (speed.py --tiny,
# memory.py --tiny, small kv_reuse sizes, the test suite with KLEIN_GPU_TESTS_DEVICE=cpu), to
# catch argument errors before a GPU session.
#
# Wheels: the *.whl in .whl/ and .whl_ck/ are installed with pip --no-index into /tmp/site, which goes
# on PYTHONPATH (see benchmarks/GPU_SESSION.md for preparing them and which call carries which).

set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
OUT="${OUT:-$REPO/out/gpu_session}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
DRY=0
PHASES=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        tests|bench4b|bench9b|memory|all) PHASES+=("$arg") ;;
        -h|--help) sed -n '2,/^$/p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "unknown argument '$arg' (phases: tests bench4b bench9b memory all; option --dry-run)" >&2; exit 2 ;;
    esac
done
[ ${#PHASES[@]} -eq 0 ] && PHASES=(tests)
# the 10-minute device limit does not apply to a CPU dry run (every phase takes about 6 minutes there)
if [ "$DRY" -eq 1 ]; then BUDGET="${KLEIN_SESSION_BUDGET:-3600}"; else BUDGET="${KLEIN_SESSION_BUDGET:-540}"; fi
if [ "${PHASES[*]}" = "all" ] || [[ " ${PHASES[*]} " == *" all "* ]]; then
    if [ "$DRY" -eq 0 ]; then
        echo "'all' does not fit one device call; pass the phases as separate calls (or use --dry-run)" >&2
        exit 2
    fi
    PHASES=(tests bench4b bench9b memory)
fi

export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
echo "gpu_session phases=${PHASES[*]} dry_run=$DRY start=$(date -u +%Y-%m-%dT%H:%M:%SZ)" >> "$SUMMARY"

# step NAME TIMEOUT LOG COMMAND...: run with a timeout, output appended to LOG, rc to the summary.
step() {
    local name="$1" limit="$2" log="$3"
    shift 3
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 30 ]; then
        echo "$name rc=skipped (session budget of ${BUDGET}s used up)" | tee -a "$SUMMARY"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit="$left"
    echo "=== $name (timeout ${limit}s): $*" | tee -a "$log"
    local t0=$SECONDS
    timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=$?
    [ "$rc" -eq 124 ] && rc="124(timeout)"
    echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$SUMMARY"
    return 0
}

record_env() {
    "$PY" - "$OUT/env.json" <<'EOF'
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
EOF
    echo "env rc=$? seconds=$SECONDS" >> "$SUMMARY"
}

# Wheels travel in .whl/ (diffusers and friends) and .whl_ck/ (comfy-kitchen, 56 MB: kept apart so a
# call can carry it without the ComfyUI host folders; .whl/ and .whl_ck/ together stay under 64 MiB).
install_wheels() {
    local -a wheels=()
    mapfile -t wheels < <(compgen -G "$REPO/.whl/*.whl"; compgen -G "$REPO/.whl_ck/*.whl")
    if [ ${#wheels[@]} -gt 0 ]; then
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "${wheels[@]}"; then
            echo "wheels rc=0 ($(for w in "${wheels[@]}"; do basename "$w"; done | tr '\n' ' '))" >> "$SUMMARY"
        else
            echo "wheels rc=$?" >> "$SUMMARY"
        fi
    else
        echo "wheels: none carried (.whl/ and .whl_ck/ empty or absent)" >> "$SUMMARY"
    fi
    # /tmp/site also holds what an earlier call on this machine installed, while it stays warm
    if [ -d /tmp/site ]; then export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"; fi
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
}

phase_tests() {
    local log="$OUT/tests.log"
    local -a env_vars=("KLEIN_PARITY_JSON=$OUT/parity.json")
    local limit=450
    if [ "$DRY" -eq 1 ]; then
        env_vars+=("KLEIN_GPU_TESTS_DEVICE=cpu")
    fi
    step tests "$limit" "$log" env "${env_vars[@]}" "$PY" -m pytest -q -p no:cacheprovider -rs --durations=15 \
        --junitxml="$OUT/tests_junit.xml" tests/gpu
    # issue #19: comfy-kitchen (the fast paths' fused kernels, when its wheel was carried) vs plain per op
    local -a kargs=()
    [ "$DRY" -eq 1 ] && kargs=(--tiny --device cpu --models 4b)
    step kernels 80 "$log" "$PY" benchmarks/kernels.py "${kargs[@]}" --out "$OUT/kernels.json"
}

speed_common() {
    if [ "$DRY" -eq 1 ]; then
        echo --tiny --runs 1 --warmup 0
    else
        echo --runs 3 --warmup 1
    fi
}

diffusers_flag() {
    if has_diffusers; then echo ""; else echo "--no-diffusers"; fi
}

phase_bench4b() {
    local log="$OUT/bench4b.log"
    # shellcheck disable=SC2046
    step speed_4b_ab 300 "$log" "$PY" benchmarks/speed.py --models 4b --cases a,b $(speed_common) \
        --attention auto,sdpa_cudnn --compile $(diffusers_flag) --out "$OUT/speed_4b_ab.json"
    local runs="--runs 2 --warmup 1"
    [ "$DRY" -eq 1 ] && runs="--tiny --runs 1 --warmup 0"
    # shellcheck disable=SC2046,SC2086
    step speed_4b_c 230 "$log" "$PY" benchmarks/speed.py --models 4b --cases c $runs --attention auto \
        $(diffusers_flag) --out "$OUT/speed_4b_c.json"
    if "$PY" benchmarks/speed.py --help 2>/dev/null | grep -q -- "--precision\|fp8"; then
        # shellcheck disable=SC2046
        step speed_4b_fp8 200 "$log" "$PY" benchmarks/speed.py --models 4b --cases a $(speed_common) \
            --precision fp8 --no-diffusers --out "$OUT/speed_4b_fp8.json"
    else
        echo "speed_4b_fp8 rc=skipped (benchmarks/speed.py has no fp8 option; fp8 is timed by the tests phase" \
             "and benchmarks/memory.py --precision fp8)" >> "$SUMMARY"
    fi
}

phase_bench9b() {
    local log="$OUT/bench9b.log"
    # shellcheck disable=SC2046
    step speed_9b_ab 500 "$log" "$PY" benchmarks/speed.py --models 9b --cases a,b $(speed_common) \
        --attention auto --compile $(diffusers_flag) --out "$OUT/speed_9b_ab.json"
}

phase_memory() {
    local log="$OUT/memory.log"
    local -a dev=() env_vars=()
    [ "$DRY" -eq 1 ] && dev=(--tiny --device cpu) && env_vars=("KLEIN_GPU_TESTS_DEVICE=cpu")
    # the nodes' sampler (memory_mode auto) inside ComfyUI: this call carries the host folders
    step nodes 100 "$log" env "${env_vars[@]}" "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_nodes.py
    step memory_4b_cap8 170 "$log" "$PY" benchmarks/memory.py --models 4b --precision bf16,fp8 --cases edit1024 \
        --cap-gb 8 "${dev[@]}" --out "$OUT/memory_4b_cap8.json"
    step memory_9b_cap12 200 "$log" "$PY" benchmarks/memory.py --models 9b --precision bf16,fp8 --cases edit1024 \
        --cap-gb 12 "${dev[@]}" --out "$OUT/memory_9b_cap12.json"
    if [ "$DRY" -eq 1 ]; then
        step kv_reuse 120 "$log" "$PY" benchmarks/kv_reuse.py --device cpu --dtype fp32 --hidden 64 --heads 2 \
            --depth 1 --single 2 --size 64 --refs 2 --steps 2 --out "$OUT/kv_reuse.json"
    else
        step kv_reuse 150 "$log" "$PY" benchmarks/kv_reuse.py --device cuda --dtype bf16 --hidden 4096 --heads 32 \
            --depth 8 --single 24 --size 1024 --refs 2 --steps 4 --out "$OUT/kv_reuse.json"
    fi
}

record_env
install_wheels
for phase in "${PHASES[@]}"; do
    "phase_$phase"
done
echo "end=$(date -u +%Y-%m-%dT%H:%M:%SZ) total_seconds=$SECONDS" >> "$SUMMARY"
cat "$SUMMARY"
