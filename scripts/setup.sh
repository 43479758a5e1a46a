#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs ContextRender on the tested stack (constraints.txt;
# idempotent). Two sets:
#   bash scripts/setup.sh          what serving needs (scripts/serve.sh): the package with its proxy and
#                                  server extras; Graphviz's `dot` (the inspector's graph view)
#   bash scripts/setup.sh --tests  what the test suite needs besides (scripts/test.sh): every extra,
#                                  headless Chromium and its driver (the inspector's browser tests),
#                                  Node.js and npm (the Node integrations' tests)
# System packages come from apt-get when missing and this runs as root. An apt step that fails or
# waits on apt's lock (another install running) is retried for $CONTEXTRENDER_APT_WAIT seconds
# (default 120), then skipped with one line saying what is missing and what it costs; the rest
# goes on without it.
set -euo pipefail
cd "$(dirname "$0")/.."
set_name=serve
if [ "${1:-}" = "--tests" ]; then set_name=tests; fi
say() { echo "scripts/setup.sh: $*" >&2; }
# One run at a time: `serve.sh` and `test.sh` started together would both create .venv and run pip
# in it at once. A second run waits here, then finds everything installed.
if command -v flock >/dev/null 2>&1; then
    exec 9>.venv.lock
    if ! flock -n 9; then
        say "waiting for another run of this script to finish installing"
        flock 9
    fi
else
    # Without util-linux's flock (macOS): creating a directory is atomic.
    until mkdir .venv.lock.d 2>/dev/null; do
        say "waiting for another run (remove .venv.lock.d if none is running)"
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

apt_wait=${CONTEXTRENDER_APT_WAIT:-120}
apt_updated=0
# apt_install "what it costs" package...: installs the packages with apt-get, retrying for
# $apt_wait seconds (apt's lock held by another install, a mirror that does not answer); then one
# line saying what is missing and what it costs. Never fails the run.
apt_install() {
    local cost=$1; shift
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        say "not installed: $* ($cost; install with your package manager, e.g. apt-get install $*)"
        return 0
    fi
    local deadline=$((SECONDS + apt_wait)) tries=0 output=""
    say "installing $* with apt-get (waits up to ${apt_wait} s for apt's lock)"
    while :; do
        tries=$((tries + 1))
        if { [ $apt_updated = 1 ] || output=$(apt-get -o DPkg::Lock::Timeout=5 update -qq 2>&1) && apt_updated=1; } &&
            output=$(DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=5 install -y -qq "$@" 2>&1 >/dev/null); then
            return 0
        fi
        if [ $SECONDS -ge $deadline ]; then break; fi
        say "apt-get did not install $* (try $tries: $(printf '%s' "$output" | tail -n 1)); trying again, for $((deadline - SECONDS)) s more"
        sleep 5
    done
    say "skipped: $* not installed after ${apt_wait} s ($(printf '%s' "$output" | tail -n 1)): $cost; install later with: apt-get install $*"
}

if [ ! -x .venv/bin/python ]; then
    say "creating .venv"
    "$(find_python)" -m venv .venv
fi
command -v dot >/dev/null 2>&1 || apt_install "without it the inspector's graph view shows DOT text, and export_graph(format=\"svg\") fails" graphviz
if [ $set_name = tests ]; then
    browser=()
    command -v chromium >/dev/null 2>&1 || browser+=(chromium)
    command -v chromedriver >/dev/null 2>&1 || browser+=(chromium-driver)
    if [ ${#browser[@]} -gt 0 ]; then
        apt_install "tests/test_inspector.py's browser tests are skipped" "${browser[@]}"
    fi
    command -v node >/dev/null 2>&1 || apt_install "the Node integrations' tests are skipped" nodejs npm
fi

hash=$(cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)
install_python() {  # install_python STAMP EXTRAS: pip install -e ".[EXTRAS]" once per pyproject/constraints
    local stamp=.venv/.installed-$1-$hash
    if [ -f "$stamp" ]; then return 0; fi
    say "installing the Python packages ($2) into .venv; the first time takes a few minutes, pip's lines follow"
    .venv/bin/python -m pip install --quiet --upgrade pip
    # At the exact versions the tests were run with (constraints.txt).
    # One line per package fetched, then the summary (pip's errors, on stderr, pass unfiltered).
    set +e
    .venv/bin/python -m pip install --progress-bar off -e ".[$2]" -c constraints.txt | grep --line-buffered -E '^(Collecting|Successfully)' >&2
    local status=${PIPESTATUS[0]}
    set -e
    if [ "$status" != 0 ]; then
        say "pip install failed (run it again without the filter: .venv/bin/python -m pip install -e \".[$2]\" -c constraints.txt)"
        exit 1
    fi
    touch "$stamp"
}
if [ $set_name = tests ]; then
    install_python tests test
    touch .venv/.installed-serve-$hash  # [test] holds [proxy,server]
else
    [ -f .venv/.installed-tests-$hash ] || install_python serve proxy,server
fi
