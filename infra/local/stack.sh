#!/usr/bin/env bash
# The local stack on 127.0.0.1: a Ray head (GCS + dashboard / Jobs API, token authentication) and an MLflow
# tracking server (sqlite + proxied artifacts, one worker, no job runner, MLflow's basic-auth app: every call
# needs the user eagle-admin and the password `up` creates in auth/mlflow-password, mode 0600).
#
#   infra/local/stack.sh up       start what is not running yet, wait until both answer, print the env
#   infra/local/stack.sh status   what runs, and the env to use (exit 1 when something is down)
#   infra/local/stack.sh down     stop what `up` started, nothing else
#   infra/local/stack.sh env      print the env lines only (for `eval "$(infra/local/stack.sh env)"`)
#
# Settings (environment):
#   EAGLE_STACK_DIR     state folder (default <repo>/.mlflow): mlflow.db, artifacts/, mlflow.pid, mlflow.log,
#                       ray-head.env (what `up` started), ray-start.log, stack.env, auth/ (0700: the MLflow
#                       password and session key, 0600; basic_auth.ini and the user database)
#   MLFLOW_PORT         5000     RAY_PORT (GCS) 6379     RAY_DASHBOARD_PORT (Jobs API) 8265
#   RAY_CLIENT_PORT     10001    RAY_AGENT_PORT (dashboard agent HTTP) 52365 when free, else any free port
#   RAY_NUM_CPUS        CPUs the head offers (default: all)
#   RAY_TEMP_DIR        the head's Ray temp dir: sessions, logs, sockets (default /tmp/ray-stack-<RAY_PORT>; short,
#                       as Ray's socket paths must fit in 107 bytes). A temp dir of its own, not Ray's shared
#                       /tmp/ray: Ray's job supervisor hands every job driver the address it reads from
#                       <temp dir>/ray_current_cluster, which names whichever cluster on the host started last, so
#                       with a shared one a job submitted here could run against another cluster (seen: a
#                       featurize job sent to a second stack a test had started beside it)
#   STACK_TIMEOUT       seconds to wait for each service (default 120)
# Give `status` and `down` the same settings as `up`. Custom Ray ports must lie outside 10002-19999 (Ray's
# worker port range). Clients need RAY_AUTH_MODE=token and the token: `up` creates it when none exists
# (python -m eagle_platform.ray_token: $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, mode 0600) and the env it
# prints names its path; `ray job submit` goes to RAY_API_SERVER_ADDRESS, while RAY_ADDRESS is the GCS
# address (`ray.init()` refuses an http:// RAY_ADDRESS).
#
# `down` never runs `ray stop` (that stops every Ray process of the user on this host, including other
# people's `ray.init()` test clusters). `up` records the Ray session it started (the session directory
# name, unique per cluster); `down` signals only the processes of that session and their children
# (TERM, then KILL after a grace period), and the MLflow server's own process group.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
STACK_DIR="${EAGLE_STACK_DIR:-$REPO_ROOT/.mlflow}"
HOST=127.0.0.1
MLFLOW_PORT="${MLFLOW_PORT:-5000}"
RAY_PORT="${RAY_PORT:-6379}"
RAY_DASHBOARD_PORT="${RAY_DASHBOARD_PORT:-8265}"
RAY_CLIENT_PORT="${RAY_CLIENT_PORT:-10001}"
RAY_AGENT_PORT="${RAY_AGENT_PORT:-}"
RAY_NUM_CPUS="${RAY_NUM_CPUS:-$(nproc)}"
RAY_TEMP_DIR="${RAY_TEMP_DIR:-/tmp/ray-stack-$RAY_PORT}"
STACK_TIMEOUT="${STACK_TIMEOUT:-120}"
GRACE_S="${STACK_GRACE_S:-15}"

AUTH_DIR="$STACK_DIR/auth"
MLFLOW_USER=eagle-admin  # eagle_platform.registry.STACK_USER
MLFLOW_PASSWORD_FILE="$AUTH_DIR/mlflow-password"
MLFLOW_PID_FILE="$STACK_DIR/mlflow.pid"
MLFLOW_LOG="$STACK_DIR/mlflow.log"
RAY_RECORD="$STACK_DIR/ray-head.env"
RAY_LOG="$STACK_DIR/ray-start.log"
ENV_FILE="$STACK_DIR/stack.env"

source "$REPO_ROOT/infra/local/venv.sh"
# The interpreter beside `ray` (it has this project installed: eagle_platform.ray_token), else the first on PATH.
RAY_BIN="$(command -v ray || true)"
if [[ -n "$RAY_BIN" && -x "$(dirname "$RAY_BIN")/python" ]]; then
    PYTHON="$(dirname "$RAY_BIN")/python"
else
    PYTHON="$(command -v python || command -v python3)"
fi

# Ray 2.60: token authentication. `ray start --head` in token mode does not create a token: `up` does
# (eagle_platform.ray_token, the one place that knows the path); every client needs RAY_AUTH_MODE=token.
export RAY_AUTH_MODE=token

log() { printf 'stack: %s\n' "$*" >&2; }
die() { printf 'stack: error: %s\n' "$*" >&2; exit 1; }

# ------------------------------------------------------------------------------------------- helpers

port_open() {  # port_open PORT: something accepts TCP connections on 127.0.0.1:PORT
    "$PYTHON" - "$1" <<'PY'
import socket, sys
with socket.socket() as s:
    s.settimeout(0.5)
    sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)
PY
}

free_port() {  # free_port [PREFERRED]: PREFERRED when nothing listens there, else a free port (eagle_platform.ports)
    "$PYTHON" -m eagle_platform.ports "${1:-0}"
}

http_status() {  # http_status URL [TOKEN]: the HTTP status code, 000 when nothing answers
    "$PYTHON" - "$@" <<'PY'
import sys, urllib.error, urllib.request
request = urllib.request.Request(sys.argv[1])
if len(sys.argv) > 2 and sys.argv[2]:
    request.add_header("Authorization", f"Bearer {sys.argv[2]}")
try:
    with urllib.request.urlopen(request, timeout=2) as response:
        print(response.status)
except urllib.error.HTTPError as err:
    print(err.code)
except Exception:
    print("000")
PY
}

wait_for() {  # wait_for WHAT COMMAND...: poll COMMAND until it succeeds or STACK_TIMEOUT passes
    local what="$1"; shift
    local deadline=$((SECONDS + STACK_TIMEOUT)) delay=0.2
    until "$@"; do
        if ((SECONDS >= deadline)); then
            return 1
        fi
        sleep "$delay"
        delay=$(awk -v d="$delay" 'BEGIN { d *= 2; if (d > 2) d = 2; print d }')
    done
    log "$what is up"
}

alive() { [[ -n "${1:-}" ]] && kill -0 "$1" 2>/dev/null; }

cmdline() { { tr '\0' ' ' <"/proc/$1/cmdline"; } 2>/dev/null || true; }

descendants() {  # descendants PID...: the PIDs and all their children, grandchildren, ...
    local queue=("$@") out=() pid
    while ((${#queue[@]})); do
        pid="${queue[0]}"; queue=("${queue[@]:1}")
        out+=("$pid")
        while read -r child; do
            [[ -n "$child" ]] && queue+=("$child")
        done < <(ps -o pid= --ppid "$pid" 2>/dev/null | tr -d ' ')
    done
    printf '%s\n' "${out[@]}" | sort -un
}

terminate() {  # terminate PID...: TERM, wait up to GRACE_S, then KILL what is left
    local pids=("$@") left=() deadline pid
    ((${#pids[@]})) || return 0
    log "  TERM $(ps -o comm= -p "$(IFS=,; echo "${pids[*]}")" 2>/dev/null | sort | uniq -c | xargs)"
    kill -TERM "${pids[@]}" 2>/dev/null || true
    deadline=$((SECONDS + GRACE_S))
    while :; do
        left=()
        for pid in "${pids[@]}"; do alive "$pid" && left+=("$pid"); done
        ((${#left[@]})) || return 0
        ((SECONDS < deadline)) || break
        sleep 0.2
    done
    log "killing ${#left[@]} process(es) still running after ${GRACE_S}s: $(ps -o args= -p "$(IFS=,; echo "${left[*]}")" 2>/dev/null | cut -c1-160 | sort | uniq -c | xargs)"
    kill -KILL "${left[@]}" 2>/dev/null || true
}

# ------------------------------------------------------------------------------------------- MLflow

mlflow_uri() { echo "http://$HOST:$MLFLOW_PORT"; }

mlflow_pid() {  # the recorded server PID when it is still our mlflow server
    local pid
    pid="$(cat "$MLFLOW_PID_FILE" 2>/dev/null || true)"
    if alive "$pid" && [[ "$(cmdline "$pid")" == *mlflow*server* ]]; then
        echo "$pid"
    fi
}

mlflow_healthy() { [[ "$(http_status "$(mlflow_uri)/health")" == 200 ]]; }

mlflow_up() {
    local pid
    pid="$(mlflow_pid)"
    if [[ -z "$pid" ]]; then
        rm -f "$MLFLOW_PID_FILE"
        if port_open "$MLFLOW_PORT"; then
            die "port $MLFLOW_PORT is taken by a process this stack did not start: stop it or set MLFLOW_PORT"
        fi
        mkdir -p "$STACK_DIR/artifacts"
        mlflow_auth_setup
        log "starting MLflow on $(mlflow_uri) (state in $STACK_DIR; user $MLFLOW_USER, password in $MLFLOW_PASSWORD_FILE)"
        # its own session / process group, so `down` can stop the server and its uvicorn worker together.
        # Webhooks to http://127.0.0.1 (the platform service's model_version.created hook) need plain http and
        # private IPs allowed: MLflow refuses both by default (mlflow/environment_variables.py, webhooks/ssrf.py).
        # Local only: this server and the service bind to 127.0.0.1.
        # Registry writes need credentials: the basic-auth app answers 401 to anyone without them (only /health
        # is open), so nobody else on this machine can move @production. The admin password is read on the
        # first start only (it creates the user); the session key signs the UI's CSRF tokens.
        MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https \
            MLFLOW_AUTH_CONFIG_PATH="$AUTH_DIR/basic_auth.ini" MLFLOW_AUTH_ADMIN_PASSWORD="$(cat "$MLFLOW_PASSWORD_FILE")" \
            MLFLOW_FLASK_SERVER_SECRET_KEY="$(cat "$AUTH_DIR/session-key")" \
            setsid mlflow server --app-name basic-auth \
            --backend-store-uri "sqlite:///$STACK_DIR/mlflow.db" \
            --artifacts-destination "$STACK_DIR/artifacts" \
            --host "$HOST" --port "$MLFLOW_PORT" --workers 1 \
            >>"$MLFLOW_LOG" 2>&1 </dev/null &
        pid=$!
        echo "$pid" >"$MLFLOW_PID_FILE"
    else
        log "MLflow already running (pid $pid)"
    fi
    if ! wait_for "MLflow ($(mlflow_uri))" mlflow_healthy_or_dead "$pid"; then
        die "MLflow did not answer $(mlflow_uri)/health within ${STACK_TIMEOUT}s; see $MLFLOW_LOG"
    fi
}

mlflow_auth_setup() {  # the secrets (created once, 0600 in a 0700 folder) and the auth app's settings
    local said secret
    for secret in "$MLFLOW_PASSWORD_FILE" "$AUTH_DIR/session-key"; do
        said="$("$PYTHON" -m eagle_platform.ray_token --secret "$secret")" || die "cannot create $secret (see above)"
        log "$said"
    done
    cat >"$AUTH_DIR/basic_auth.ini" <<EOF
[mlflow]
default_permission = NO_PERMISSIONS
database_uri = sqlite:///$AUTH_DIR/basic_auth.db
admin_username = $MLFLOW_USER
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
# a checked password is remembered for 60 s (one worker: a password change through the API applies at once);
# without it every request pays a PBKDF2 hash
auth_cache_ttl_seconds = 60
EOF
}

mlflow_healthy_or_dead() {  # stop waiting early when the server died
    if ! alive "$1"; then
        die "MLflow exited while starting: $(tail -n 5 "$MLFLOW_LOG" 2>/dev/null | tr '\n' ' ')"
    fi
    mlflow_healthy
}

mlflow_down() {
    local pid
    pid="$(mlflow_pid)"
    if [[ -z "$pid" ]]; then
        rm -f "$MLFLOW_PID_FILE"
        log "MLflow: not running (nothing recorded by up)"
        return 0
    fi
    log "stopping MLflow (pid $pid and its process group)"
    # the whole group: the mlflow CLI and the uvicorn server it spawned
    terminate $(pgrep -g "$pid" || true)
    rm -f "$MLFLOW_PID_FILE"
}

# ---------------------------------------------------------------------------------------------- Ray

ray_api() { echo "http://$HOST:$RAY_DASHBOARD_PORT"; }

ray_session() {  # the recorded session name when its GCS still runs
    [[ -f "$RAY_RECORD" ]] || return 0
    local RAY_SESSION="" GCS_PID=""
    # shellcheck disable=SC1090
    source "$RAY_RECORD"
    if alive "$GCS_PID" && [[ "$(cmdline "$GCS_PID")" == *"$RAY_SESSION"* ]]; then
        echo "$RAY_SESSION"
    fi
}

session_pids() {  # session_pids SESSION GCS_PORT: the processes of that head
    # Its command line names the session (gcs, raylet, dashboard, monitors) or its GCS address (the Ray
    # Client server). Agents and workers rename themselves (ray::IDLE, ...): they are found as children.
    local session="$1" gcs_port="$2" pid line
    for pid in $(ps -eo pid= | tr -d ' '); do
        [[ "$pid" == "$$" || "$pid" == "$BASHPID" ]] && continue
        line="$(cmdline "$pid")"
        [[ "$line" == *ray* ]] || continue
        if [[ "$line" == *"$session"* || "$line" == *" --address="*":$gcs_port "* \
            || "$line" == *" --gcs-address="*":$gcs_port "* || "$line" == *" --gcs_address="*":$gcs_port "* ]]; then
            echo "$pid"
        fi
    done
}

ray_token_path() { "$PYTHON" -c 'from eagle_platform.ray_token import token_path; print(token_path())'; }

ray_token() {
    if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then
        echo "$RAY_AUTH_TOKEN"
    else
        cat "$(ray_token_path)" 2>/dev/null || true
    fi
}

ensure_ray_token() {  # create the token a fresh machine lacks (mode 0600); one line says what happened
    local said
    said="$("$PYTHON" -m eagle_platform.ray_token)" || die "cannot create the Ray token (see above)"
    log "$said"
}

ray_jobs_api_ready() { [[ "$(http_status "$(ray_api)/api/jobs/" "$(ray_token)")" == 200 ]]; }

ray_up() {
    local session
    session="$(ray_session)"
    if [[ -n "$session" ]]; then
        log "Ray head already running ($session)"
    else
        rm -f "$RAY_RECORD"
        local port
        for port in "$RAY_PORT" "$RAY_DASHBOARD_PORT" "$RAY_CLIENT_PORT"; do
            if port_open "$port"; then
                die "port $port is taken by a process this stack did not start: stop it or set RAY_PORT / RAY_DASHBOARD_PORT / RAY_CLIENT_PORT"
            fi
        done
        # Ray's default agent port (52365) is often held by another local cluster: take a free one then
        local agent_port="${RAY_AGENT_PORT:-$(free_port 52365)}"
        mkdir -p "$STACK_DIR"
        ensure_ray_token
        log "starting a Ray head on $HOST:$RAY_PORT (dashboard / Jobs API $(ray_api), $RAY_NUM_CPUS CPUs)"
        # The GCS binds all interfaces whatever --node-ip-address says (Ray maps 127.0.0.1 to the host's IP),
        # so none is passed; token authentication guards it. The dashboard (Jobs API) binds 127.0.0.1.
        local started=0
        # every job and Serve replica of this head inherits this stack's MLflow and where its credentials are
        # (the password file's path, not the password)
        MLFLOW_TRACKING_URI="$(mlflow_uri)" MLFLOW_TRACKING_USERNAME="$MLFLOW_USER" EAGLE_MLFLOW_PASSWORD_FILE="$MLFLOW_PASSWORD_FILE" \
        ray start --head --port "$RAY_PORT" --temp-dir "$RAY_TEMP_DIR" \
            --dashboard-host "$HOST" --dashboard-port "$RAY_DASHBOARD_PORT" --include-dashboard true \
            --dashboard-agent-listen-port "$agent_port" --ray-client-server-port "$RAY_CLIENT_PORT" \
            --num-cpus "$RAY_NUM_CPUS" --disable-usage-stats >"$RAY_LOG" 2>&1 </dev/null || started=$?
        # which session did we start? the GCS listening on our port names it in its command line
        local gcs_pid="" pid
        for pid in $(pgrep -f "gcs_server.*--gcs_server_port=$RAY_PORT( |$)" || true); do gcs_pid="$pid"; done
        if [[ -n "$gcs_pid" ]]; then
            session="$(cmdline "$gcs_pid" | grep -o 'session_[0-9_-]*' | head -n 1)"
            [[ -n "$session" ]] || die "cannot tell the Ray session of GCS pid $gcs_pid; see $RAY_LOG"
            printf 'RAY_SESSION=%s\nGCS_PID=%s\nRAY_PORT=%s\nRAY_DASHBOARD_PORT=%s\nRAY_AGENT_PORT=%s\n' \
                "$session" "$gcs_pid" "$RAY_PORT" "$RAY_DASHBOARD_PORT" "$agent_port" >"$RAY_RECORD"
        fi
        if ((started != 0)); then
            [[ -n "$gcs_pid" ]] && ray_down  # what a half-failed start left behind
            die "ray start failed: $(grep -v '^\s*$' "$RAY_LOG" | tail -n 3 | tr '\n' ' ') (full log: $RAY_LOG)"
        fi
        [[ -n "$gcs_pid" ]] || die "ray start returned but no GCS serves port $RAY_PORT; see $RAY_LOG"
    fi
    if ! wait_for "Ray Jobs API ($(ray_api))" ray_jobs_api_ready; then
        die "the Ray Jobs API did not answer $(ray_api)/api/jobs/ within ${STACK_TIMEOUT}s; see $RAY_LOG"
    fi
}

ray_down() {
    if [[ ! -f "$RAY_RECORD" ]]; then
        log "Ray: not running (nothing recorded by up)"
        return 0
    fi
    # the recorded session, even when its GCS is gone already: stragglers may still run
    local session gcs_port
    # shellcheck disable=SC1090
    session="$(source "$RAY_RECORD"; echo "$RAY_SESSION")"
    # shellcheck disable=SC1090
    gcs_port="$(source "$RAY_RECORD"; echo "$RAY_PORT")"
    [[ -n "$session" && -n "$gcs_port" ]] || die "unreadable record $RAY_RECORD: stop that head by hand"
    local pids
    mapfile -t pids < <(session_pids "$session" "$gcs_port")
    if ((${#pids[@]})); then
        mapfile -t pids < <(descendants "${pids[@]}")
        log "stopping the Ray head $session (${#pids[@]} processes)"
        # first the raylet (it stops its workers and agents) and the autoscaler monitor (it hangs on SIGTERM
        # once the GCS is gone), then the GCS, the dashboard and the rest
        local first=() pid
        for pid in "${pids[@]}"; do
            if [[ "$(ps -o comm= -p "$pid" 2>/dev/null)" == raylet || "$(cmdline "$pid")" == *autoscaler/_private/monitor.py* ]]; then
                first+=("$pid")
            fi
        done
        terminate "${first[@]}"
        local rest=()
        for pid in "${pids[@]}"; do alive "$pid" && rest+=("$pid"); done
        terminate "${rest[@]}"
    else
        log "Ray: session $session has no processes left"
    fi
    rm -f "$RAY_RECORD"
}

# ------------------------------------------------------------------------------------------- commands

print_env() {
    echo "export RAY_AUTH_MODE=token"
    if [[ -z "${RAY_AUTH_TOKEN:-}" ]]; then
        echo "export RAY_AUTH_TOKEN_PATH=$(ray_token_path)"
    fi
    cat <<EOF
export RAY_ADDRESS=$HOST:$RAY_PORT
export RAY_API_SERVER_ADDRESS=$(ray_api)
export MLFLOW_TRACKING_URI=$(mlflow_uri)
export MLFLOW_TRACKING_USERNAME=$MLFLOW_USER
export EAGLE_MLFLOW_PASSWORD_FILE=$MLFLOW_PASSWORD_FILE
EOF
}

cmd_up() {
    mkdir -p "$STACK_DIR"
    mlflow_up
    ray_up
    print_env >"$ENV_FILE"
    log "ready. Use it from this shell with:  source $ENV_FILE   (or the lines below)"
    log "  ray job submit --working-dir . -- python -m jobs.<name> ...   |   infra/local/stack.sh down"
    print_env
}

cmd_status() {
    local rc=0 pid session
    pid="$(mlflow_pid)"
    if [[ -n "$pid" ]] && mlflow_healthy; then
        echo "mlflow: up (pid $pid) $(mlflow_uri)"
    elif [[ -n "$pid" ]]; then
        echo "mlflow: starting or unhealthy (pid $pid) $(mlflow_uri)"; rc=1
    else
        echo "mlflow: down"; rc=1
    fi
    session="$(ray_session)"
    if [[ -n "$session" ]] && ray_jobs_api_ready; then
        echo "ray: up ($session) gcs $HOST:$RAY_PORT, jobs API $(ray_api)"
    elif [[ -n "$session" ]]; then
        echo "ray: starting or unhealthy ($session) jobs API $(ray_api)"; rc=1
    else
        echo "ray: down"; rc=1
    fi
    if ((rc == 0)); then
        print_env
    fi
    return "$rc"
}

cmd_down() {
    ray_down
    mlflow_down
    rm -f "$ENV_FILE"
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) print_env ;;
    *) echo "usage: $0 up|down|status|env   (settings: see the header of this script)" >&2; exit 2 ;;
esac
