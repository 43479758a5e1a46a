#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs ContextRender with every extra, on the tested stack
# (constraints.txt; idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
# One run at a time: `serve.sh` and `test.sh` started together would both create .venv and run pip
# in it at once. A second run waits here, then finds everything installed.
if command -v flock >/dev/null 2>&1; then
    exec 9>.venv.lock
    flock 9
else
    # Without util-linux's flock (macOS): creating a directory is atomic.
    until mkdir .venv.lock.d 2>/dev/null; do
        echo "scripts/setup.sh: waiting for another run (remove .venv.lock.d if none is running)" >&2
        sleep 2
    done
    trap 'rmdir .venv.lock.d' EXIT
fi
find_python() {
    if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
    for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do
        # pyenv shims exist for every version but fail unless that version is selected: run it.
        if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
            "$candidate" -c 'import sys; print(sys.executable)'; return
        fi
    done
    echo "Python 3.12 not found: install it (pyenv install 3.12) or set PYTHON=/path/to/python3.12" >&2
    exit 1
}
# The Node integrations' tests (integrations/opencode, integrations/openclaw) need Node and npm:
# installed from Debian's packages where they are missing and this runs as root.
if ! command -v node >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
    "$(find_python)" -m venv .venv
fi
# System tools some parts need, from Debian's packages, installed when missing and we are root with
# apt-get: Graphviz's `dot` (export_graph format "svg", the inspector's graph view) and headless
# Chromium with its driver (tests/test_inspector.py). Elsewhere: a note, and those parts say what
# is missing when used.
missing=()
command -v dot >/dev/null 2>&1 || missing+=(graphviz)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "scripts/setup.sh: installing ${missing[*]} (apt-get)" >&2
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "scripts/setup.sh: not installed: ${missing[*]} (the inspector's graph view and browser tests need them)" >&2
    fi
fi
stamp=.venv/.installed-$(cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    # Every extra the tests need, at the exact versions they were run with (constraints.txt).
    .venv/bin/python -m pip install --quiet -e ".[test]" -c constraints.txt
    touch "$stamp"
fi
