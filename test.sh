#!/usr/bin/env bash
# Set up (first time) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh dev
exec .venv/bin/python -m pytest -q -rs "$@"
