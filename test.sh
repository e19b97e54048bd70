#!/usr/bin/env bash
# Set up (first time) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh dev
# Two processes (pytest-xdist), each taking whole test modules (tests/conftest.py's scheduler; the
# modules that share engines go together): an XLA compile uses one core, so one process left the
# other core mostly idle. `./test.sh -n 0` runs it in one.
exec .venv/bin/python -m pytest -q -rs -n 2 "$@"
