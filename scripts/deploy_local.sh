#!/usr/bin/env bash
# A real Flower deployment of pflalign on 127.0.0.1: a SuperLink with TLS, N SuperNodes, each
# with its own partition file and state directory, and `flwr run` against them.
#
#   scripts/deploy_local.sh start [--nodes 3] [--auth] [--config FILE] [--set key=value ...]
#   scripts/deploy_local.sh run   [--rounds R] [--methods LIST] [--set key=value ...]
#   scripts/deploy_local.sh restart-node I     # stop SuperNode I and start it again
#   scripts/deploy_local.sh stop               # kill exactly the processes this script started
#   scripts/deploy_local.sh status | demo      # demo = start, run, stop
#
# Run it from the repository root. Everything lives in the work directory (--workdir, default
# ./deploy): certificates, keys, partitions, logs, every process's FLWR_HOME, the PIDs, runs.
# See docs/deployment.md for what each step does and the same steps by hand.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
    cat <<'EOF'
usage: scripts/deploy_local.sh COMMAND [options]

commands:
  start            make a CA and a server certificate, (with --auth) SuperNode keys, export
                   the partitions, start the SuperLink (TLS) and the SuperNodes, write the
                   Flower CLI's config.toml
  run              run pflalign on the deployment (`flwr run . <name> --stream`) and check
                   that results.json was written for every method and round
  restart-node I   stop SuperNode I (by its recorded PID) and start it again with the same
                   node config (same partition file, same state directory, same key)
  kill-node I      stop SuperNode I only
  start-node I     start SuperNode I again after kill-node
  stop             stop every process this script started, by its recorded PID
  status           list the recorded processes and whether they run
  demo             start, run, stop

options (saved by `start` in WORKDIR/deploy.env and reused by later commands):
  --workdir DIR        work directory (default: ./deploy)
  --nodes N            number of SuperNodes = num-clients + num-unseen-clients (default 3)
  --port P             SuperLink port (default 39400)
  --node-port Q        SuperNode i listens on Q+i (default 39410)
  --auth               SuperNode authentication (ECDSA P-384 keys, `flwr supernode register`)
  --pooled             give the nodes no partition file: each reads the pooled dataset on its
                       first message and caches its own partition under its state directory
  --name NAME          the SuperLink connection's name in config.toml (default pflalign-local)
  --config FILE        pflalign run config (TOML) for the partitions and the run
  --set KEY=VALUE      override one config key (repeatable); with `run`: for that run only
                       (data keys cannot change after `start`: the nodes refuse their files)
options of `run`:
  --rounds R, --methods LIST   shorthands for --set rounds=R / --set methods=LIST
  --out DIR            the run's out-dir (default WORKDIR/runs/<time>/out)
  --timeout S          give up on `flwr run` after S seconds (default 3600)
  --retries N          submit the run again, up to N times, when its ServerApp fails on a TLS
                       or connection error before it logs a line (default 1)
EOF
}

# --- options -----------------------------------------------------------------------------------
COMMAND=""
ARG=""
CLI_SETS=()
declare -A CLI=()
while (($#)); do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --workdir|--nodes|--port|--node-port|--name|--config|--rounds|--methods|--out|\
        --timeout|--retries)
            (($# >= 2)) || { echo "error: $1 needs a value" >&2; exit 2; }
            CLI[${1#--}]=$2; shift 2 ;;
        --auth) CLI[auth]=1; shift ;;
        --pooled) CLI[pooled]=1; shift ;;
        --set)
            (($# >= 2)) || { echo "error: --set needs KEY=VALUE" >&2; exit 2; }
            CLI_SETS+=("$2"); shift 2 ;;
        -*) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
        *)
            if [[ -z $COMMAND ]]; then COMMAND=$1
            elif [[ -z $ARG ]]; then ARG=$1
            else echo "error: unexpected argument $1" >&2; exit 2; fi
            shift ;;
    esac
done
[[ -n $COMMAND ]] || { usage; exit 2; }

WORK=${CLI[workdir]:-$ROOT/deploy}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
ENV_FILE=$WORK/deploy.env

# what `start` saved, then the command line
NODES=3 PORT=39400 NODE_PORT=39410 AUTH=0 POOLED=0 NAME=pflalign-local CONFIG=""
SETS=()
STARTING=0
if [[ $COMMAND != start && $COMMAND != demo && -f $ENV_FILE ]]; then
    # shellcheck disable=SC1090
    source "$ENV_FILE"
fi
NODES=${CLI[nodes]:-$NODES}
PORT=${CLI[port]:-$PORT}
NODE_PORT=${CLI[node-port]:-$NODE_PORT}
AUTH=${CLI[auth]:-$AUTH}
POOLED=${CLI[pooled]:-$POOLED}
NAME=${CLI[name]:-$NAME}
if [[ -n ${CLI[config]:-} ]]; then CONFIG=$(cd "$(dirname "${CLI[config]}")" && pwd)/$(basename "${CLI[config]}"); fi

# --- environment -------------------------------------------------------------------------------
# No telemetry, no update checks, no package installs (the SuperLink would otherwise run
# `uv sync` on the app), and every Flower home inside the work directory.
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 RAY_USAGE_STATS_ENABLED=0
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export FLWR_HOME=$WORK/flwr-home        # the CLI's: config.toml with the SuperLink connection
if [[ -x $ROOT/.venv/bin/flwr ]]; then export PATH=$ROOT/.venv/bin:$PATH; fi
for tool in python flwr flower-superlink flower-supernode openssl; do
    command -v "$tool" >/dev/null || { echo "error: '$tool' is not on PATH" >&2; exit 1; }
done

PIDS=$WORK/pids
LOGS=$WORK/logs
CERTS=$WORK/certs
KEYS=$WORK/keys
PARTS=$WORK/partitions
mkdir -p "$PIDS" "$LOGS"

log() { printf '[deploy] %s\n' "$*"; }
die() { printf '[deploy] error: %s\n' "$*" >&2; exit 1; }

save_env() {
    {
        printf 'NODES=%q PORT=%q NODE_PORT=%q AUTH=%q POOLED=%q NAME=%q CONFIG=%q\n' \
            "$NODES" "$PORT" "$NODE_PORT" "$AUTH" "$POOLED" "$NAME" "$CONFIG"
        printf 'SETS=('
        if ((${#SETS[@]})); then printf '%q ' "${SETS[@]}"; fi
        printf ')\n'
    } > "$ENV_FILE.tmp"
    mv "$ENV_FILE.tmp" "$ENV_FILE"
}

config_args() {  # the pflalign config: --config FILE and every --set, as an argument list
    CONFIG_ARGS=()
    if [[ -n $CONFIG ]]; then CONFIG_ARGS+=(--config "$CONFIG"); fi
    local s
    for s in "${SETS[@]}" "$@"; do CONFIG_ARGS+=(--set "$s"); done
}

# --- processes: started in their own process group, recorded, stopped by that PID only --------
running() {  # PID file -> true while its process runs (a zombie awaiting its reaping does not)
    local file=$1 pid
    [[ -f $file ]] || return 1
    pid=$(<"$file")
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    kill -0 "$pid" 2>/dev/null || return 1
    [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) != Z ]]
}

alive() {  # PID file -> running, and still the Flower process we started (not a reused PID)
    running "$1" || return 1
    tr '\0' ' ' < "/proc/$(<"$1")/cmdline" 2>/dev/null | grep -q -- "flower-"
}

launch() {  # NAME LOGFILE COMMAND... : start in a new session (its own process group)
    local name=$1 logfile=$2
    shift 2
    setsid "$@" >> "$logfile" 2>&1 < /dev/null &
    local pid=$!
    echo "$pid" > "$PIDS/$name.pid"
    log "started $name (PID $pid), log $logfile"
}

terminate() {  # NAME [SIGNAL]: stop the recorded process and its process group (its children)
    local name=$1 signal=${2:-TERM} file=$PIDS/$1.pid pid i
    if ! alive "$file"; then rm -f "$file"; return 0; fi
    pid=$(<"$file")
    # setsid made the process its group's leader: the group is it and what it started
    # (a SuperNode's flower-superexec and flwr-clientapp processes), nothing else
    kill -"$signal" -- "-$pid" 2>/dev/null || kill -"$signal" "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
        kill -0 -- "-$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 -- "-$pid" 2>/dev/null; then
        log "$name (PID $pid) did not stop within 10 s; sending SIGKILL"
        kill -KILL -- "-$pid" 2>/dev/null || true
    fi
    rm -f "$file"
    log "stopped $name (PID $pid)"
}

wait_for_port() {  # PORT SECONDS NAME
    local port=$1 seconds=$2 name=$3 i
    for ((i = 0; i < seconds * 4; i++)); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then return 0; fi
        running "$PIDS/$name.pid" || die "$name exited; see $LOGS/$name.log"
        sleep 0.25
    done
    die "$name is not listening on port $port after ${seconds}s; see $LOGS/$name.log"
}

# --- steps -------------------------------------------------------------------------------------
make_certificates() {
    [[ -f $CERTS/ca.crt && -f $CERTS/server.pem && -f $CERTS/server.key ]] && return 0
    mkdir -p "$CERTS"
    log "making a CA and a server certificate for 127.0.0.1 in $CERTS"
    openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=pflalign local CA" \
        -keyout "$CERTS/ca.key" -out "$CERTS/ca.crt" 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" \
        -keyout "$CERTS/server.key" -out "$CERTS/server.csr" 2>/dev/null
    printf '%s\n' "subjectAltName=IP:127.0.0.1" "basicConstraints=CA:FALSE" \
        "keyUsage=digitalSignature,keyEncipherment" "extendedKeyUsage=serverAuth" \
        > "$CERTS/server.ext"
    openssl x509 -req -days 30 -in "$CERTS/server.csr" -CA "$CERTS/ca.crt" \
        -CAkey "$CERTS/ca.key" -CAcreateserial -extfile "$CERTS/server.ext" \
        -out "$CERTS/server.pem" 2>/dev/null
    chmod 600 "$CERTS/ca.key" "$CERTS/server.key"
}

bind_keys() {  # each partition-id bound to SuperNode i's public key (pflalign.wire.binding)
    config_args
    python -m pflalign.run.export_partitions "${CONFIG_ARGS[@]}" --bind-keys "$KEYS" >/dev/null
    log "bound each partition-id to its SuperNode's key in $PARTS/node-keys.json"
}

make_keys() {
    mkdir -p "$KEYS"
    local i
    for ((i = 0; i < NODES; i++)); do
        [[ -f $KEYS/node-$i ]] && continue
        ssh-keygen -q -t ecdsa -b 384 -N "" -C "pflalign-node-$i" -f "$KEYS/node-$i"
    done
    log "SuperNode keys (ECDSA P-384) in $KEYS"
}

write_cli_config() {
    mkdir -p "$FLWR_HOME"
    cat > "$FLWR_HOME/config.toml.tmp" <<EOF
[superlink]
default = "$NAME"

[superlink.$NAME]
address = "127.0.0.1:$PORT"
root-certificates = "$CERTS/ca.crt"
EOF
    mv "$FLWR_HOME/config.toml.tmp" "$FLWR_HOME/config.toml"
    log "wrote $FLWR_HOME/config.toml ([superlink.$NAME] at 127.0.0.1:$PORT, TLS)"
}

export_partitions() {
    config_args
    log "exporting one partition file per client to $PARTS"
    python -m pflalign.run.export_partitions "${CONFIG_ARGS[@]}" --out "$PARTS" \
        --write-config "$PARTS/run-config.toml"
    local expected
    expected=$(python - "$PARTS/run-config.toml" <<'EOF'
import sys, tomllib
c = tomllib.load(open(sys.argv[1], "rb"))
print(c["num-clients"] + c["num-unseen-clients"])
EOF
)
    [[ $expected == "$NODES" ]] || die "the config has $expected clients (num-clients + \
num-unseen-clients) but --nodes is $NODES; pass --nodes $expected or --set num-clients=$NODES"
}

start_superlink() {
    alive "$PIDS/superlink.pid" && die "the SuperLink already runs (PID $(<"$PIDS/superlink.pid")); stop it first"
    mkdir -p "$WORK/superlink"
    local args=(--ssl-ca-certfile "$CERTS/ca.crt" --ssl-certfile "$CERTS/server.pem"
                --ssl-keyfile "$CERTS/server.key" --host 127.0.0.1 --port "$PORT"
                --database "$WORK/superlink/state.db" --disable-runtime-dependency-installation)
    if ((AUTH)); then args+=(--enable-supernode-auth); fi
    FLWR_HOME=$WORK/superlink/flwr-home launch superlink "$LOGS/superlink.log" \
        flower-superlink "${args[@]}"
    wait_for_port "$PORT" 60 superlink
}

register_nodes() {
    local i out
    for ((i = 0; i < NODES; i++)); do
        if out=$(flwr supernode register "$KEYS/node-$i.pub" "$NAME" 2>&1); then
            log "registered SuperNode $i's public key"
        elif grep -qi "already" <<<"$out"; then
            log "SuperNode $i's public key was registered before"
        else
            printf '%s\n' "$out" >&2
            die "could not register SuperNode $i's key"
        fi
    done
}

node_config() {  # I -> the node config string of SuperNode I (string values quoted: TOML)
    local i=$1
    printf "partition-id=%d num-partitions=%d state-dir='%s'" "$i" "$NODES" "$WORK/node-$i/state"
    if ((!POOLED)); then printf " data-path='%s'" "$PARTS/client-$i.npz"; fi
    if ((AUTH)); then printf " auth-key='%s'" "$KEYS/node-$i"; fi
}

start_node() {
    local i=$1
    [[ $i =~ ^[0-9]+$ ]] && ((i < NODES)) || die "node index '$i' is outside 0..$((NODES - 1))"
    alive "$PIDS/node-$i.pid" && die "SuperNode $i already runs (PID $(<"$PIDS/node-$i.pid"))"
    mkdir -p "$WORK/node-$i/state"
    local args=(--root-certificates "$CERTS/ca.crt" --superlink "127.0.0.1:$PORT"
                --port $((NODE_PORT + i)) --node-config "$(node_config "$i")")
    if ((AUTH)); then args+=(--auth-supernode-private-key "$KEYS/node-$i"); fi
    FLWR_HOME=$WORK/node-$i/flwr-home launch "node-$i" "$LOGS/node-$i.log" \
        flower-supernode "${args[@]}"
}

wait_for_node() {  # I OFFSET: 0 once SuperNode I has connected (it logs its node id), 1 if it
    local i=$1 since=$2 logfile n   # exited; its log is read from byte OFFSET on
    logfile=$LOGS/node-$i.log
    for ((n = 0; n < 480; n++)); do
        if tail -c +"$since" "$logfile" 2>/dev/null | grep -q "SuperNode ID"; then return 0; fi
        running "$PIDS/node-$i.pid" || return 1
        sleep 0.25
    done
    die "SuperNode $i did not connect within 120 s; see $logfile"
}

start_node_and_wait() {  # I: start SuperNode I; retry while the SuperLink still counts its
    local i=$1 size deadline=$((SECONDS + 120))   # previous session (same key) as online
    while :; do
        size=$(stat -c %s "$LOGS/node-$i.log" 2>/dev/null || echo 0)
        start_node "$i"
        if wait_for_node "$i" $((size + 1)); then return 0; fi
        rm -f "$PIDS/node-$i.pid"
        if ((AUTH && SECONDS < deadline)) && tail -c +$((size + 1)) "$LOGS/node-$i.log" \
                | grep -q "Failed to initialize the connection"; then
            log "the SuperLink refused SuperNode $i (a killed session with its key may still count as online for up to 60 s); retrying in 5 s"
            sleep 5
            continue
        fi
        die "SuperNode $i exited; see $LOGS/node-$i.log"
    done
}

cmd_start() {
    SETS=("${CLI_SETS[@]}")
    # with SuperNode authentication each partition-id is bound to its node's key
    if ((AUTH)); then SETS+=("node-keys=$PARTS/node-keys.json"); fi
    alive "$PIDS/superlink.pid" && die "a deployment already runs in $WORK; run '$0 stop' first"
    # a failed start stops what it started
    trap 'if ((STARTING)); then cmd_stop; fi' EXIT
    STARTING=1
    save_env
    make_certificates
    export_partitions
    write_cli_config
    if ((AUTH)); then make_keys; bind_keys; fi
    start_superlink
    if ((AUTH)); then register_nodes; fi
    local i sizes=()
    for ((i = 0; i < NODES; i++)); do
        sizes[i]=$(stat -c %s "$LOGS/node-$i.log" 2>/dev/null || echo 0)
        start_node "$i"
    done
    for ((i = 0; i < NODES; i++)); do
        wait_for_node "$i" $((sizes[i] + 1)) || die "SuperNode $i exited; see $LOGS/node-$i.log"
    done
    STARTING=0
    log "deployment up: SuperLink 127.0.0.1:$PORT (TLS$( ((AUTH)) && echo ', SuperNode auth')), $NODES SuperNodes"
}

cmd_run() {
    alive "$PIDS/superlink.pid" || die "no SuperLink runs in $WORK; run '$0 start' first"
    local stamp rundir out extra=()
    stamp=$(date +%Y%m%d-%H%M%S)-$$
    rundir=$WORK/runs/$stamp
    mkdir -p "$rundir"
    out=${CLI[out]:-$rundir/out}
    mkdir -p "$out"
    out=$(cd "$out" && pwd)
    if [[ -e $out/results.json ]]; then  # an earlier run's file must not pass for this one's
        mv "$out/results.json" "$out/results.json.previous"
        log "moved an earlier $out/results.json to results.json.previous"
    fi
    if [[ -n ${CLI[rounds]:-} ]]; then extra+=("rounds=${CLI[rounds]}"); fi
    if [[ -n ${CLI[methods]:-} ]]; then extra+=("methods=${CLI[methods]}"); fi
    extra+=("${CLI_SETS[@]}" "out-dir=$out")
    config_args "${extra[@]}"
    python -m pflalign.run.export_partitions "${CONFIG_ARGS[@]}" \
        --write-config "$rundir/run-config.toml" >/dev/null
    RUN_LOG=$rundir/flwr-run.log
    : > "$RUN_LOG"
    local attempt tries=$((${CLI[retries]:-1} + 1)) mark outcome
    for ((attempt = 1; ; attempt++)); do
        mark=$(stat -c %s "$RUN_LOG")
        submit_run "$rundir"
        if outcome=$(run_outcome "$rundir/run-config.toml" "$out/results.json"); then break; fi
        outcome+=$(run_status "$mark")
        # Flower treats any TLS error of a ServerApp's first request as fatal (it does not
        # retry what mentions "ssl"); a ServerApp that failed that way before it logged a line
        # sent nothing to any node, so the run can be submitted again as it was
        if ((attempt < tries)) && died_at_start "$mark" "$outcome"; then
            log "the ServerApp failed before it started ($outcome); submitting the run again" \
                "(attempt $((attempt + 1)) of $tries)"
            continue
        fi
        die "the run failed ($outcome); see $RUN_LOG and $LOGS/"
    done
    echo "$rundir" > "$WORK/last-run"
    log "results: $out/results.json"
}

submit_run() {  # RUNDIR: `flwr run` of RUNDIR/run-config.toml, its output appended to RUN_LOG
    local rundir=$1 status=0 tail_pid start
    log "flwr run $ROOT $NAME --stream --run-config $rundir/run-config.toml"
    start=$(($(stat -c %s "$RUN_LOG") + 1))
    # `flwr run` in its own session, so that a stop reaches it and what it started; a killed
    # `run` (Ctrl-C, SIGTERM) stops it and the run's ServerApp on the SuperLink (stop_run)
    trap 'stop_run; exit 130' INT
    trap 'stop_run; exit 143' TERM
    (cd "$ROOT" && exec setsid timeout "${CLI[timeout]:-3600}" flwr run . "$NAME" --stream \
        --run-config "$rundir/run-config.toml") >> "$RUN_LOG" 2>&1 < /dev/null &
    RUN_PID=$!
    echo "$RUN_PID" > "$PIDS/flwr-run.pid"
    tail -c "+$start" --pid="$RUN_PID" -f "$RUN_LOG" &
    tail_pid=$!
    wait "$RUN_PID" || status=$?
    wait "$tail_pid" 2>/dev/null || true
    trap - INT TERM
    rm -f "$PIDS/flwr-run.pid"
    RUN_STATUS=$status
}

run_outcome() {  # RUN_CONFIG RESULTS: succeeds when RESULTS has every method's last round;
    # otherwise prints why not (`flwr run` exits 0 even when the ServerApp fails)
    python - "$1" "$2" <<'EOF'
import json, sys, tomllib
from pflalign.run.config import build_settings, method_labels
settings = build_settings(tomllib.load(open(sys.argv[1], "rb")))
try:
    results = json.load(open(sys.argv[2]))
except (OSError, ValueError) as err:
    print(f"no complete results.json: {err}", end="")
    sys.exit(1)
for label in method_labels(settings):
    rounds = results.get("methods", {}).get(label, {}).get("rounds", [])
    if not rounds or rounds[-1].get("round") != settings.run.rounds:
        print(f"method {label!r} did not finish its {settings.run.rounds} rounds", end="")
        sys.exit(1)
EOF
}

started_run() {  # MARK: the ID of the last run `flwr run` started after byte MARK of RUN_LOG
    tail -c "+$(($1 + 1))" "$RUN_LOG" 2>/dev/null | grep -o 'Successfully started run [0-9]*' \
        | awk '{print $4}' | tail -n 1 || true
}

run_status() {  # MARK: "; flwr run exit status S, run ID STATUS: DETAILS" (from `flwr ls`)
    local id text
    printf '; flwr run exit status %s' "$RUN_STATUS"
    id=$(started_run "$1")
    [[ -n $id ]] || return 0
    text=$(cd "$ROOT" && flwr ls "$NAME" --run-id "$id" --format json 2>/dev/null \
           | python -c 'import json, sys
try:
    run = json.load(sys.stdin)["runs"][0]
    print(run["status"] + (": " + run["status-details"] if run["status-details"] else ""), end="")
except (ValueError, LookupError, TypeError):
    pass') || true
    if [[ -n $text ]]; then printf ', run %s %s' "$id" "$text"; fi
}

died_at_start() {  # MARK OUTCOME: the run's ServerApp failed on a TLS or connection error
    # before it logged a line (nothing follows `flwr run`'s "Starting logstream" after MARK)
    grep -qiE 'finished:failed: ServerApp failed with exception: .*(ssl|tls|eof|connect)' \
        <<<"$2" || return 1
    [[ -z $(tail -c "+$(($1 + 1))" "$RUN_LOG" | sed -n '/Starting logstream/,$p' | sed 1d \
            | grep -v '^[[:space:]]*$') ]]
}

serverapps() {  # the PIDs of the ServerApp processes that talk to this deployment's SuperLink
    pgrep -f "flwr-serverapp .*127\.0\.0\.1:$PORT( |\$)" || true
}

stop_run() {  # a killed `run`: stop `flwr run`, then the run on the SuperLink, and its ServerApp
    local id i apps
    if [[ -n ${RUN_PID:-} ]]; then
        kill -TERM -- "-$RUN_PID" 2>/dev/null || true
        log "stopped flwr run (PID $RUN_PID)"
    fi
    rm -f "$PIDS/flwr-run.pid"
    id=$(started_run 0)
    if [[ -n $id ]]; then
        if (cd "$ROOT" && flwr stop "$id" "$NAME") >> "$RUN_LOG" 2>&1; then
            log "stopped run $id on the SuperLink"
        else
            log "could not stop run $id on the SuperLink; see $RUN_LOG"
        fi
    fi
    # the ServerApp: a flwr-serverapp process (of the SuperLink's detached flower-superexec)
    # that talks to this SuperLink's port
    if alive "$PIDS/superlink.pid"; then
        for ((i = 0; i < 300; i++)); do
            apps=$(serverapps)
            [[ -z $apps ]] && break
            if ((i == 200)); then
                log "the ServerApp (PID $apps) did not end within 20 s; sending SIGTERM"
                kill -TERM $apps 2>/dev/null || true
            fi
            sleep 0.1
        done
        [[ -z $apps ]] && log "no ServerApp runs on the SuperLink"
    fi
}

cmd_stop() {
    local file name
    if running "$PIDS/flwr-run.pid"; then  # a `run` killed with SIGKILL, which no trap sees
        kill -TERM -- "-$(<"$PIDS/flwr-run.pid")" 2>/dev/null || true
        log "stopped flwr run (PID $(<"$PIDS/flwr-run.pid"))"
    fi
    rm -f "$PIDS/flwr-run.pid"
    for file in "$PIDS"/node-*.pid; do
        [[ -e $file ]] || continue
        name=$(basename "$file" .pid)
        terminate "$name"
    done
    terminate superlink
    local apps
    apps=$(serverapps)
    if [[ -n $apps ]]; then  # a ServerApp left by a run killed with SIGKILL
        kill -TERM $apps 2>/dev/null || true
        log "stopped the ServerApp left on port $PORT (PID $apps)"
    fi
}

cmd_status() {
    local file name
    compgen -G "$PIDS/*.pid" >/dev/null || { echo "no process recorded in $PIDS"; return 0; }
    for file in "$PIDS"/*.pid; do
        [[ -e $file ]] || continue
        name=$(basename "$file" .pid)
        if alive "$file"; then echo "$name: running (PID $(<"$file"))"
        else echo "$name: not running (stale PID file)"; fi
    done
}

case "$COMMAND" in
    start) cmd_start ;;
    run) cmd_run ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    kill-node) [[ -n $ARG ]] || die "kill-node needs a node index"; terminate "node-$ARG" ;;
    start-node)
        [[ -n $ARG ]] || die "start-node needs a node index"
        start_node_and_wait "$ARG" ;;
    restart-node)
        [[ -n $ARG ]] || die "restart-node needs a node index"
        terminate "node-$ARG"
        start_node_and_wait "$ARG" ;;
    demo)
        cmd_start
        trap cmd_stop EXIT
        cmd_run ;;
    *) echo "error: unknown command '$COMMAND' (see --help)" >&2; exit 2 ;;
esac
