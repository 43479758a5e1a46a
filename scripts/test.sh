#!/usr/bin/env bash
# Sets up .venv if needed, with what the tests need besides serving (scripts/setup.sh --tests: every
# extra, headless Chromium and its driver, Node.js), then runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --tests
exec .venv/bin/python -m pytest -q "$@"
