#!/usr/bin/env bash
# Sets up .venv if needed, then serves the walkers with `jac start` on the embedded store
# (SQLite under .jac/data). PORT defaults to 8000.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export LITELLM_LOCAL_MODEL_COST_MAP="${LITELLM_LOCAL_MODEL_COST_MAP:-True}"
exec .venv/bin/jac start contextrender.jac --no_client -p "${PORT:-8000}" < /dev/null
