#!/usr/bin/env bash
# Sets up .venv if needed (what serving needs only: scripts/setup.sh), then serves the walkers with
# `contextrender serve` (jac start) on the embedded store of the project folder (SQLite under
# .jac/data). PORT defaults to 8000; CONTEXTRENDER_HOST to 127.0.0.1 (this machine only: put a
# reverse proxy with TLS in front to serve others, docs/server-and-security.md). Without
# CONTEXTRENDER_JWT_SECRET, a strong secret is generated once and kept (owner-only) in
# .jac/jwt_secret, so tokens stay valid across restarts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/contextrender serve --store . --port "${PORT:-8000}"
