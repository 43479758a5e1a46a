#!/usr/bin/env bash
# Sets up .venv if needed, then serves the walkers with `jac start` on the embedded store
# (SQLite under .jac/data). PORT defaults to 8000; CONTEXTRENDER_HOST to 127.0.0.1 (this machine
# only: put a reverse proxy with TLS in front to serve others, README "Security").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export LITELLM_LOCAL_MODEL_COST_MAP="${LITELLM_LOCAL_MODEL_COST_MAP:-True}"
export CONTEXTRENDER_HOST="${CONTEXTRENDER_HOST:-127.0.0.1}"
# Tokens are signed with CONTEXTRENDER_JWT_SECRET; without one, a strong secret is generated once
# and kept (owner-only) in .jac/jwt_secret, so tokens stay valid across restarts.
if [ -z "${CONTEXTRENDER_JWT_SECRET:-}" ]; then
    mkdir -p .jac
    if [ ! -s .jac/jwt_secret ]; then
        (umask 077 && .venv/bin/python -c "import secrets; print(secrets.token_urlsafe(48))" > .jac/jwt_secret)
    fi
    CONTEXTRENDER_JWT_SECRET="$(cat .jac/jwt_secret)"
    export CONTEXTRENDER_JWT_SECRET
fi
exec .venv/bin/jac start contextrender.jac --no_client -p "${PORT:-8000}" < /dev/null
