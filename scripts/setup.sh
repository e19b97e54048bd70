#!/usr/bin/env bash
# One-time (idempotent) set-up: the virtual environment at .venv with the app's and the tests'
# dependencies, and Debian's chromium for the browser test. Re-running skips what is done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
want=${1:-dev}   # "app": the demo's dependencies only; "dev": also the test dependencies
reqs=requirements.txt
[ "$want" = "dev" ] && reqs=requirements-dev.txt
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.installed-$want
sum=$(cat requirements.txt requirements-dev.txt | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$sum" ]; then
  echo "[setup] installing $reqs into .venv (first time: a few minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  # torch==2.13.0 (test-only) resolves to the CPU build from the local file; see requirements-dev.txt
  .venv/bin/python -m pip install -q -r "$reqs"
  echo "$sum" > "$stamp"
fi
# The native int8 CPU matmul kernel (gemma4/ops/kernels/cpu_int8.cc): built once per jaxlib / CPU /
# compiler into the cache; without a compiler the engine uses the XLA int8 paths and says so.
.venv/bin/python -m gemma4.ops.kernels.cpu_int8 --setup || true
# The test process builds many engines one after another; each compiled shape holds ~400 memory
# mappings of XLA:CPU JIT code, and past vm.max_map_count (65,530 by default) XLA crashes (see
# docs/engine-api.md). Where we may (root, writable /proc/sys), the test machine gets the limit
# that databases and search engines commonly ask for; elsewhere the suite runs under the default.
if [ "$want" = "dev" ] && [ "$(id -u)" = "0" ] && [ -w /proc/sys/vm/max_map_count ] \
   && [ "$(cat /proc/sys/vm/max_map_count)" -lt 262144 ]; then
  echo "[setup] raising vm.max_map_count to 262144 for the test process"
  echo 262144 > /proc/sys/vm/max_map_count || echo "[setup] could not raise vm.max_map_count"
fi
if [ "$want" = "dev" ] && ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    echo "[setup] installing Debian chromium for the browser test"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "[setup] could not install chromium: the browser test will be skipped"
  else
    echo "[setup] chromium not found and apt-get unavailable: the browser test will be skipped"
  fi
fi
