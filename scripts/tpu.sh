#!/usr/bin/env bash
# The project on a TPU machine, in one command: install what the chip machine lacks from wheels
# carried beside the working tree, then bench/tpu.py (exactness vs CPU, the benchmarks, a JSON
# report under bench/results/ — and under $OUT where that is set). See docs/tpu.md.
#
#   bash scripts/tpu.sh --fetch-wheels      # here, with a package index: the wheels into .whl-tpu/
#   bash scripts/tpu.sh [bench/tpu.py args] # on the chip machine (Python 3.11, JAX with libtpu)
#   bash scripts/tpu.sh --bench compile_anatomy.py [its args]   # another bench script, same set-up
#
# The chip machine has JAX, libtpu and numpy but no internet; the wheels travel with the working
# tree (.whl-tpu/ is ignored by git: carry it). They install under /tmp, after the machine's own
# packages on PYTHONPATH, so its JAX stays the one imported.
#
# An NVIDIA GPU machine (the device tool's H200: Python 3.12 with JAX and its CUDA plugin, no
# package index) takes the same bench with CHIP=gpu: the engine's wheels for its Python go to
# .whl-gpu/ (the app's UI is not carried: run the engine's parts, e.g. --parts env,exact,decode,verify).
#
#   CHIP=gpu bash scripts/tpu.sh --fetch-wheels
#   CHIP=gpu bash scripts/tpu.sh --parts env,exact,decode,verify --quick
set -euo pipefail
cd "$(dirname "$0")/.."
CHIP="${CHIP:-tpu}"
case "$CHIP" in
  tpu) CHIP_PYTHON=3.11 ;;
  gpu) CHIP_PYTHON=3.12 ;;
  *) echo "CHIP must be tpu or gpu, not $CHIP" >&2; exit 2 ;;
esac
WHEELS=.whl-$CHIP
# What the engine imports beyond JAX (gemma4's imports; the tokenizers, image and audio decoding,
# GGUF reading) and the app's UI (gradio and what it needs that the machine's index lacks).
ENGINE_PKGS="soxr==1.1.0 pillow==12.3.0 gguf==0.19.0 sentencepiece==0.2.3 pyyaml==6.0.4 protobuf==7.36.2
tokenizers==0.23.3 psutil==7.2.2 filelock==4.3.2"
# The GPU machine's image has all of ENGINE_PKGS but these (its own versions stay the ones imported).
GPU_PKGS="soxr==1.1.0 gguf==0.19.0"
# Not carried: PyAV (av 18.1.0, 35.8 MB with FFmpeg inside) would take the wheels past the 64 MiB a
# run carries. The app check's clip is a PCM WAV, which gemma4.media.audio reads with Python's
# `wave`; PyAV (any version) is tried from the machine's index below, where it may be missing
# (then audio other than PCM WAV is refused with a message saying so, and video fails).
# The app's UI: gradio (requirements.txt's version) and the wheels it needs that the machine's
# package index lacks (31.5 MB, almost all of it gradio's built front end).
APP_PKGS="gradio==6.31.0 gradio_client==2.7.2 hf-gradio==0.4.1 safehttpx==0.1.7 groovy==0.1.2"
# The rest of gradio's requirements (and the app's: gemma4.web, pandas for the charts), installed
# from the machine's own index (file:///opt/pypi/simple, no internet) with --no-deps. Pinned where
# the index holds a pair that must match (pydantic / pydantic-core). numpy is left out: the
# machine's own stays the one imported. tomlkit (only gradio's custom-component CLI imports it)
# and brotli (its HTTP compression) are older or newer than gradio's bounds there; neither runs
# without a server.
APP_INDEX_PKGS="fastapi starlette uvicorn pydantic==2.13.5 pydantic-core==2.46.5 annotated-types
typing-inspection typing-extensions annotated-doc opentelemetry-api anyio idna certifi h11 httpcore
httpx httpx2 httpcore2 truststore huggingface-hub hf-xet fsspec tqdm packaging jinja2 markupsafe
orjson pandas python-dateutil six pytz tzdata typer click rich shellingham markdown-it-py mdurl
pygments python-multipart semantic-version tomlkit brotli pydub prometheus-client"
INDEX_URL=file:///opt/pypi/simple

if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p "$WHEELS"
  pkgs="$ENGINE_PKGS $APP_PKGS"
  [ "$CHIP" = gpu ] && pkgs="$GPU_PKGS"
  for p in $pkgs ${TPU_EXTRA_WHEELS:-}; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$CHIP_PYTHON" --implementation cp \
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
  # the app's other requirements from the machine's own index: all at once, else one by one so
  # that one missing name costs only itself (the engine's parts do not need them)
  index_install() {
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-deps \
      --no-compile --no-cache-dir --index-url "$INDEX_URL" --target /tmp/tpu-site "$@" 2>&1 |
      grep -v "already exists" >&2
    return "${PIPESTATUS[0]}"
  }
  if [ ! -d "${INDEX_URL#file://}" ]; then
    echo "[$CHIP] no package index at $INDEX_URL: the app's requirements beside gradio are not installed" >&2
  elif ! index_install $APP_INDEX_PKGS; then
    failed=""
    for p in $APP_INDEX_PKGS; do index_install "$p" || failed="$failed $p"; done
    [ -z "$failed" ] || echo "[$CHIP] not installed from $INDEX_URL:$failed (the app may not import)" >&2
  fi
  if [ -d "${INDEX_URL#file://}" ] && ! index_install av 2>/dev/null; then
    echo "[$CHIP] no PyAV in $INDEX_URL: the app decodes PCM WAV audio only (no other audio, no video)" >&2
  fi
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/tpu-site"
else
  echo "[$CHIP] no wheels in $WHEELS: using what the machine has (bash scripts/tpu.sh --fetch-wheels here first)" >&2
fi
export PYTHONUNBUFFERED=1
# a compile cache of its own per run: the engine's cold start is part of what is measured
export GEMMA4_JAX_CACHE="${GEMMA4_JAX_CACHE:-/tmp/gemma4-tpu-cache}"
# `--bench name.py args`: another bench script with the same set-up (e.g. compile_anatomy.py);
# the results it writes go to $OUT too
touch /tmp/tpu-bench-start
if [ "${1:-}" = "--bench" ]; then
  script="$2"; shift 2
  python3 "bench/$script" "$@"
else
  python3 bench/tpu.py "$@"
fi
status=$?
if [ -n "${OUT:-}" ]; then
  find bench/results -name '*.json' -newer /tmp/tpu-bench-start -exec cp {} "$OUT"/ \; 2>/dev/null || true
fi
exit $status
