#!/usr/bin/env bash
# Several `jac start` processes on one MongoDB-protocol store and one Redis, on loopback
# (docs/scale-out.md). For tests and trying it out: the store is mongoeco, a MongoDB stand-in.
#
#   bash scripts/scale_out.sh start [--servers N] [--dir DIR] [--sqlite]   (N may be 0: the stores alone)
#   bash scripts/scale_out.sh stop  [--dir DIR]
#
# start: installs what is missing (the project's .venv; redis-server with apt, as root; mongoeco
#   in .venv-mongo with Python 3.13), starts Redis, the stand-in (its memory engine, or with
#   --sqlite its SQLite engine on DIR/mongo.sqlite) and N servers (default 2), each on its own
#   free loopback port and its own copy of the served files under DIR/server-<i>, all with one
#   JWT secret (a token is valid on every server). Waits until each answers, then writes
#   DIR/cluster.env (URLs, ports, pids) and prints it.
# stop: stops what DIR/cluster.env says was started (and only that), waiting for each to exit.
# DIR defaults to .jac/scale-out. CONTEXTRENDER_LOCK_LEASE / CONTEXTRENDER_LOCK_WAIT pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
command="${1:-}"
shift || true
servers=2
dir=.jac/scale-out
sqlite=0
while [ $# -gt 0 ]; do
    case "$1" in
        --servers) servers="$2"; shift 2 ;;
        --dir) dir="$2"; shift 2 ;;
        --sqlite) sqlite=1; shift ;;
        *) echo "scale_out.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
state="$dir/cluster.env"
MONGOECO_PIN="mongoeco==4.11.0"
# The stand-in speaks the wire protocol through pymongo's bson: the same release as the server's.
PYMONGO_PIN="pymongo==4.20.1"

stop_pid() {
    local pid="$1"
    [ -n "$pid" ] || return 0
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.2
    done
    kill -KILL "$pid" 2>/dev/null || true
}

stop_all() {
    [ -f "$state" ] || { echo "scale_out.sh: nothing started in $dir"; return 0; }
    # shellcheck disable=SC1090
    source "$state"
    for pid in ${SERVER_PIDS//,/ }; do stop_pid "$pid"; done
    stop_pid "${MONGO_PID:-}"
    stop_pid "${REDIS_PID:-}"
    rm -f "$state"
    echo "scale_out.sh: stopped what $dir/cluster.env listed"
}

find_python313() {
    for candidate in "${PYTHON313:-}" python3.13 "$HOME"/.pyenv/versions/3.13*/bin/python3.13 /usr/local/bin/python3.13 /usr/bin/python3.13; do
        [ -n "$candidate" ] || continue
        if "$candidate" -c 'import sys; assert sys.version_info[:2] >= (3, 13)' >/dev/null 2>&1; then
            "$candidate" -c 'import sys; print(sys.executable)'; return
        fi
    done
    echo "scale_out.sh: mongoeco needs Python >= 3.13: install it (pyenv install 3.13) or set PYTHON313=/path/to/python3.13" >&2
    exit 1
}

install_missing() {
    bash scripts/setup.sh
    if ! command -v redis-server >/dev/null 2>&1; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            echo "scale_out.sh: installing redis-server (apt)" >&2
            apt-get update -q >/dev/null
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null
        else
            echo "scale_out.sh: redis-server is missing: install it (Debian/Ubuntu: apt-get install redis-server; macOS: brew install redis)" >&2
            exit 1
        fi
    fi
    (
        # One install at a time (as scripts/setup.sh does for .venv).
        exec 8>.venv-mongo.lock
        command -v flock >/dev/null 2>&1 && flock 8
        if [ ! -x .venv-mongo/bin/python ]; then
            "$(find_python313)" -m venv .venv-mongo
        fi
        stamp=".venv-mongo/.installed-$(echo "$MONGOECO_PIN $PYMONGO_PIN" | sha1sum | cut -c1-12)"
        if [ ! -f "$stamp" ]; then
            .venv-mongo/bin/python -m pip install --quiet "$MONGOECO_PIN" "$PYMONGO_PIN"
            touch "$stamp"
        fi
    )
}

free_port() {
    .venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start_all() {
    if [ -f "$state" ]; then
        echo "scale_out.sh: $state exists: stop that cluster first (scale_out.sh stop --dir $dir)" >&2
        exit 1
    fi
    install_missing
    local redis_port mongo_port secret pids="" urls="" ports=""
    redis_port="$(free_port)"
    mongo_port="$(free_port)"
    secret="$(.venv/bin/python -c 'import secrets; print(secrets.token_urlsafe(48))')"
    redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no --daemonize no \
        > "$dir/redis.log" 2>&1 < /dev/null &
    local redis_pid=$!
    local mongo_args=(--port "$mongo_port")
    [ "$sqlite" = 1 ] && mongo_args+=(--sqlite "$dir/mongo.sqlite")
    .venv-mongo/bin/python scripts/mongo_standin.py "${mongo_args[@]}" > "$dir/mongo.log" 2>&1 < /dev/null &
    local mongo_pid=$!
    # Written now, so that `stop` finds what started even if a server fails to start below.
    {
        echo "REDIS_PID=$redis_pid"
        echo "MONGO_PID=$mongo_pid"
        echo "SERVER_PIDS="
    } > "$state"
    local redis_url="redis://127.0.0.1:$redis_port/0"
    local mongo_uri="mongodb://127.0.0.1:$mongo_port/?directConnection=true"
    for i in $(seq 1 "$servers"); do
        local workdir="$dir/server-$i" port
        rm -rf "$workdir"
        .venv/bin/python - "$REPO" "$workdir" <<'EOF'
import shutil, sys
from pathlib import Path
repo, workdir = Path(sys.argv[1]), Path(sys.argv[2])
workdir.mkdir(parents=True)
for name in ("contextrender.jac", "jac.toml", "graph", "engine", "walkers"):
    if (repo / name).is_dir():
        shutil.copytree(repo / name, workdir / name, ignore=shutil.ignore_patterns("__pycache__", ".jac"))
    else:
        shutil.copy(repo / name, workdir / name)
EOF
        port="$(free_port)"
        (
            cd "$workdir"
            export MONGODB_URI="$mongo_uri" REDIS_URL="$redis_url" CONTEXTRENDER_JWT_SECRET="$secret" \
                CONTEXTRENDER_HOST=127.0.0.1 LITELLM_LOCAL_MODEL_COST_MAP=True
            exec "$REPO/.venv/bin/jac" start contextrender.jac --no_client -p "$port" < /dev/null > server.log 2>&1
        ) &
        pids="${pids:+$pids,}$!"
        urls="${urls:+$urls,}http://127.0.0.1:$port"
        ports="${ports:+$ports,}$port"
        sed -i "s|^SERVER_PIDS=.*|SERVER_PIDS=$pids|" "$state"
        if [ "$i" = 1 ] && [ "$servers" -gt 1 ]; then
            # The first process creates jac-scale's internal accounts on a new store; the others start
            # once it answers (started together, two raced to insert the same account and one exited).
            .venv/bin/python - "http://127.0.0.1:$port" "${pids##*,}" <<'EOF'
import os, sys, time
import httpx
url, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        break  # exited: the readiness check below reports it with its log
    try:
        if httpx.post(f"{url}/walker/health", json={}, timeout=2).status_code < 500:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
EOF
        fi
    done
    {
        echo "REDIS_URL=$redis_url"
        echo "MONGODB_URI=\"$mongo_uri\""
        echo "SERVER_URLS=$urls"
        echo "SERVER_PORTS=$ports"
        echo "SERVER_DIRS=$(seq -s, -f "$dir/server-%g" 1 "$servers")"
        echo "CONTEXTRENDER_JWT_SECRET=$secret"
    } >> "$state"
    if ! .venv/bin/python - "$redis_url" "$mongo_uri" "$urls" "$pids" "$redis_pid" "$mongo_pid" <<'EOF'
"""Wait until Redis, the stand-in and every server answer (a process that exits fails at once)."""
import os, sys, time
import httpx, pymongo, redis
redis_url, mongo_uri, urls, pids, redis_pid, mongo_pid = sys.argv[1:]
deadline = time.monotonic() + 300
def alive(pid):
    # Not a child of this interpreter: an exited process shows as a zombie until its parent reaps it.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return True
def wait(what, pid, ready):
    while time.monotonic() < deadline:
        if not alive(pid):
            sys.exit(f"scale_out.sh: {what} exited before it was ready (see its log in the cluster directory)")
        try:
            if ready():
                return
        except Exception:
            pass
        time.sleep(0.3)
    sys.exit(f"scale_out.sh: {what} not ready after 300 s")
wait("redis-server", redis_pid, lambda: redis.Redis.from_url(redis_url, socket_timeout=2).ping())
wait("the MongoDB stand-in", mongo_pid, lambda: pymongo.MongoClient(mongo_uri, serverSelectionTimeoutMS=1000).admin.command("ping"))
for url, pid in zip(urls.split(","), pids.split(",")) if urls else ():  # --servers 0: the stores alone
    wait(f"jac start at {url}", pid, lambda: httpx.post(f"{url}/walker/health", json={}, timeout=5).status_code == 200)
EOF
    then
        for log in "$dir"/server-*/server.log; do echo "--- $log"; tail -20 "$log"; done >&2
        stop_all >&2
        exit 1
    fi
    cat "$state"
}

case "$command" in
    start) start_all ;;
    stop) stop_all ;;
    *) echo "usage: scale_out.sh start [--servers N] [--dir DIR] [--sqlite] | stop [--dir DIR]" >&2; exit 2 ;;
esac
