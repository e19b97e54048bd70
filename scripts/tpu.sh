#!/usr/bin/env bash
# The project on a TPU machine, in one command: install what the chip machine lacks from wheels
# carried beside the working tree, then bench/tpu.py (exactness vs CPU, the benchmarks, a JSON
# report under bench/results/ — and under $OUT where that is set). See docs/tpu.md.
#
#   bash scripts/tpu.sh --fetch-wheels      # here, with a package index: the wheels into .whl-tpu/
#   bash scripts/tpu.sh [bench/tpu.py args] # on the chip machine (Python 3.11, JAX with libtpu)
#
# The chip machine has JAX, libtpu and numpy but no internet; the wheels travel with the working
# tree (.whl-tpu/ is ignored by git: carry it). They install under /tmp, after the machine's own
# packages on PYTHONPATH, so its JAX stays the one imported.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl-tpu
# What the engine imports beyond JAX (gemma4's imports; the tokenizers, image and audio decoding,
# GGUF reading) and the app's UI (gradio and what it needs that the machine's index lacks).
ENGINE_PKGS="soxr==1.1.0 pillow==12.3.0 gguf==0.19.0 sentencepiece==0.2.3 pyyaml==6.0.4 protobuf==7.36.2
tokenizers==0.23.3 psutil==7.2.2 filelock==4.3.2"

if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p "$WHEELS"
  for p in $ENGINE_PKGS ${TPU_EXTRA_WHEELS:-}; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
      --platform any -d "$WHEELS" "$p"
  done
  du -sh "$WHEELS"
  exit 0
fi

if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/tpu-site "$WHEELS"/*.whl
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/tpu-site"
else
  echo "[tpu] no wheels in $WHEELS: using what the machine has (bash scripts/tpu.sh --fetch-wheels here first)" >&2
fi
export PYTHONUNBUFFERED=1
# a compile cache of its own per run: the engine's cold start is part of what is measured
export GEMMA4_JAX_CACHE="${GEMMA4_JAX_CACHE:-/tmp/gemma4-tpu-cache}"
python3 bench/tpu.py "$@"
status=$?
if [ -n "${OUT:-}" ]; then
  cp bench/results/tpu-*.json "$OUT"/ 2>/dev/null || true
fi
exit $status
