#!/usr/bin/env bash
# The control-plane service (python -m eagle_platform.service) on the local stack, in the background.
#
#   infra/local/platform.sh up       start it (after `infra/local/stack.sh up`), wait until /health answers
#   infra/local/platform.sh status   up or down (exit 1 when down)
#   infra/local/platform.sh down     stop the service and Ray Serve (its pairs) on the stack
#
# Settings (environment): the stack's (EAGLE_STACK_DIR, ports: see stack.sh), and
#   EAGLE_PLATFORM_PORT   8600     the service's API on 127.0.0.1
#   SERVE_PORT            8000     where the rolled-out pairs answer (OpenAI API)
#   SERVE_COMPILE         on       torch.compile the served decoders (minutes per replica start on 2 cores)
#   PLATFORM_ARGS                  more service flags (python -m eagle_platform.service --help)
# State: $EAGLE_STACK_DIR/platform.pid, platform.log; the API token in ~/.cache/eagle-platform/platform/token
# (or $EAGLE_PLATFORM_DIR/token), made with mode 0600 on the first start; `eaglectl targets` reads it.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
STACK_DIR="${EAGLE_STACK_DIR:-$REPO_ROOT/.mlflow}"
PORT="${EAGLE_PLATFORM_PORT:-8600}"
SERVE_PORT="${SERVE_PORT:-8000}"
SERVE_COMPILE="${SERVE_COMPILE:-on}"
PID_FILE="$STACK_DIR/platform.pid"
LOG="$STACK_DIR/platform.log"
TIMEOUT="${STACK_TIMEOUT:-120}"
if ! command -v ray >/dev/null 2>&1 && [[ -x "$REPO_ROOT/.venv/bin/ray" ]]; then
    export PATH="$REPO_ROOT/.venv/bin:$PATH"
fi
PYTHON="$(dirname "$(command -v ray)")/python"

log() { printf 'platform: %s\n' "$*" >&2; }
alive() { [[ -f "$PID_FILE" ]] && kill -0 "$(cat "$PID_FILE")" 2>/dev/null; }
healthy() { [[ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/health" || true)" == 200 ]]; }

cmd_up() {
    eval "$("$REPO_ROOT/infra/local/stack.sh" env)"
    if alive && healthy; then
        log "up already (pid $(cat "$PID_FILE")) http://127.0.0.1:$PORT"
        return 0
    fi
    # shellcheck disable=SC2086
    setsid "$PYTHON" -m eagle_platform.service --port "$PORT" --serve --serve-port "$SERVE_PORT" \
        --serve-compile "$SERVE_COMPILE" --webhook-url "http://127.0.0.1:$PORT/v1/webhooks/mlflow" ${PLATFORM_ARGS:-} >>"$LOG" 2>&1 &
    echo $! >"$PID_FILE"
    local waited=0
    until healthy; do
        if ! alive; then
            tail -5 "$LOG" >&2
            log "error: the service exited (log: $LOG)"
            exit 1
        fi
        if ((waited >= TIMEOUT)); then
            log "error: no answer on http://127.0.0.1:$PORT/health after ${TIMEOUT} s (log: $LOG)"
            exit 1
        fi
        sleep 1
        waited=$((waited + 1))
    done
    log "up (pid $(cat "$PID_FILE")) http://127.0.0.1:$PORT; pairs will answer on http://127.0.0.1:$SERVE_PORT (log: $LOG)"
}

cmd_down() {
    if alive; then
        kill -TERM "$(cat "$PID_FILE")" 2>/dev/null || true
        for _ in $(seq 30); do alive || break; sleep 1; done
        alive && kill -KILL "$(cat "$PID_FILE")" 2>/dev/null || true
        log "service stopped"
    fi
    rm -f "$PID_FILE"
    if "$REPO_ROOT/infra/local/stack.sh" status >/dev/null 2>&1; then
        eval "$("$REPO_ROOT/infra/local/stack.sh" env)"
        serve shutdown -y -a "$RAY_API_SERVER_ADDRESS" >/dev/null 2>&1 && log "Serve shut down" || true
    fi
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) if alive && healthy; then echo "platform: up (pid $(cat "$PID_FILE")) http://127.0.0.1:$PORT"; else echo "platform: down"; exit 1; fi ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
