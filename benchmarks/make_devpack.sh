#!/usr/bin/env bash
# Build .devpack/ (git-ignored), what benchmarks/gpu_session.sh installs on a GPU machine that cannot
# download anything: the diffusers wheel and its requirements missing from the device image, comfy-kitchen
# without its ROCm library (117 MB of the wheel's 153 MB unpacked), and the ComfyUI host that
# tests/e2e/setup_host.py prepares. About 42 MB; the device tool carries at most 64 MiB per call:
#   run(command="bash benchmarks/gpu_session.sh", carry=[".devpack"], timeout_s=590)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
PACK=.devpack
mkdir -p "$PACK/whl"
grep -qx "/$PACK/" .git/info/exclude 2>/dev/null || echo "/$PACK/" >> .git/info/exclude
# the device: Linux x86-64, CPython 3.12
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$PY" -m pip download -q --no-deps "${plat[@]}" -d "$PACK/whl" diffusers==0.42.1 importlib_metadata zipp
tmp="$(mktemp -d)"
"$PY" -m pip download -q --no-deps "${plat[@]}" -d "$tmp" comfy-kitchen==0.2.36  # ComfyUI's pin
(cd "$tmp" && unzip -q comfy_kitchen-*.whl && rm -rf comfy_kitchen/backends/hip \
    && tar cJf "$REPO/$PACK/comfy_kitchen-0.2.36-nohip.tar.xz" comfy_kitchen comfy_kitchen-*.dist-info)
rm -rf "$tmp"
[ -f .comfy_host/READY.json ] || "$PY" tests/e2e/setup_host.py
tar cJf "$PACK/comfy_host.tar.xz" .comfy_host/ComfyUI .comfy_host/torchvision_stub .comfy_host/READY.json
du -sh "$PACK"
