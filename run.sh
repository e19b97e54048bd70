#!/usr/bin/env bash
# Set up (first time) and start the demo with the bundled Gemma 3 270M at http://127.0.0.1:7860
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh app
exec .venv/bin/python app.py "$@"
