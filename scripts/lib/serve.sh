# Shared by scripts/*_server/start.sh: the checks and the wait every server launcher needs.
# Source it, then call serve_need / serve_run. Bash only.

# serve_need KIND PATH FIX: exit with FIX when PATH does not exist (KIND names it).
serve_need() {
    if [[ ! -e "$2" ]]; then
        echo "start.sh: no $1 at $2. Fix: $3" >&2
        exit 1
    fi
}

# serve_run NAME READY_URL LOG PIDFILE READY_S BACKGROUND CMD...
# Foreground (BACKGROUND=0): exec CMD (Ctrl-C stops it). Background: start CMD with its
# output in LOG and its pid in PIDFILE, return once READY_URL answers 2xx, fail with the
# log's tail if the server exits or READY_S seconds pass.
serve_run() {
    local name="$1" ready_url="$2" log="$3" pidfile="$4" ready_s="$5" background="$6"
    shift 6
    echo "Starting: $*"
    if [[ $background == 0 ]]; then
        exec "$@"
    fi
    mkdir -p "$(dirname "$log")" "$(dirname "$pidfile")"
    echo "Log: $log"
    nohup "$@" >"$log" 2>&1 &
    local pid=$! i
    echo "$pid" >"$pidfile"
    for ((i = 0; i < ready_s; i++)); do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "start.sh: $name exited; last lines of $log:" >&2
            tail -20 "$log" >&2
            exit 1
        fi
        if curl -fsS "$ready_url" >/dev/null 2>&1; then
            echo "$name ready: $ready_url answers (pid $pid, ${i}s); stop it with: kill $pid"
            exit 0
        fi
        sleep 1
    done
    echo "start.sh: $ready_url did not answer within ${ready_s}s (pid $pid); see $log" >&2
    exit 1
}
