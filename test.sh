#!/usr/bin/env bash
# Set up (first time) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh dev
# Two processes, each taking whole test modules (module-scoped engines stay in one process): an
# XLA compile uses one core, so one process left the other core mostly idle (the suite on a 2-core
# Intel Xeon: 9.9 min in one process, 7.8 min in two, warm caches). `./test.sh -n 0` runs it in one.
exec .venv/bin/python -m pytest -q -rs -n 2 --dist loadfile "$@"
