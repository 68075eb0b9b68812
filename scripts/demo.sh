#!/usr/bin/env bash
# Sets up .venv if needed, then runs the main job: vtc on a Llama-style model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/vtc analyze llama "$@"
