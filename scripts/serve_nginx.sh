#!/usr/bin/env bash
# N `slowfast serve` replicas on free loopback ports behind nginx (least_conn, no buffering, so
# SSE streams pass through as they are written).
#
#   scripts/serve_nginx.sh [--replicas N] [--port FRONT] [--threads T] [-- SERVE_FLAGS...]
#       brings everything up, prints the front URL and the replicas' URLs, and waits; Ctrl-C (or
#       any exit) stops nginx and the replicas.
#   scripts/serve_nginx.sh --check [--concurrency C] [--requests R] [--max-tokens T] [-- SERVE_FLAGS...]
#       brings everything up, runs bench/serve_load.py through the front with every replica's
#       /metrics and --expect-all-replicas, tears down and exits with the load test's status
#       (this is what CI runs).
#
# Flags after `--` go to every `slowfast serve` (e.g. -- --model random:qwen3-0.6b --max-batch 4).
# Environment: SLOWFAST_BIN (default target/release/slowfast), SLOWFAST_SERVE_MODEL (a --model
# for serve when none is given after --), NGINX (the nginx binary), SERVE_START_TIMEOUT (s, 180).
# nginx comes from the Debian package `nginx`; it is installed with apt-get when missing.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${SLOWFAST_BIN:-$repo/target/release/slowfast}"
replicas=2
front_port=0
check=0
threads=""
concurrency=16
requests=32
max_tokens=16
prompt_lengths="16,64,256"
load_extra=()
serve_extra=()
start_timeout="${SERVE_START_TIMEOUT:-180}"

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
    case "$1" in
        --replicas) replicas="$2"; shift 2 ;;
        --port) front_port="$2"; shift 2 ;;
        --threads) threads="$2"; shift 2 ;;
        --check) check=1; shift ;;
        --concurrency) concurrency="$2"; shift 2 ;;
        --requests) requests="$2"; shift 2 ;;
        --max-tokens) max_tokens="$2"; shift 2 ;;
        --prompt-lengths) prompt_lengths="$2"; shift 2 ;;
        --load-arg) load_extra+=("$2"); shift 2 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; serve_extra=("$@"); break ;;
        *) echo "serve_nginx.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$replicas" in ''|*[!0-9]*|0) echo "--replicas must be a positive integer" >&2; exit 2 ;; esac

if [ ! -x "$bin" ]; then
    echo "serve_nginx.sh: $bin not found; build it with: cargo build --release -p slowfast" >&2
    exit 2
fi
nginx_bin="${NGINX:-$(command -v nginx || true)}"
[ -z "$nginx_bin" ] && [ -x /usr/sbin/nginx ] && nginx_bin=/usr/sbin/nginx
if [ -z "$nginx_bin" ]; then
    echo "== installing nginx (apt-get)" >&2
    sudo_=""; [ "$(id -u)" -eq 0 ] || sudo_="sudo"
    $sudo_ apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq nginx >/dev/null
    nginx_bin="$(command -v nginx || echo /usr/sbin/nginx)"
fi

# --model: from the flags after --, else $SLOWFAST_SERVE_MODEL, else serve's default
has_model=0
for a in "${serve_extra[@]+"${serve_extra[@]}"}"; do
    case "$a" in --model|--model=*|-m) has_model=1 ;; esac
done
if [ "$has_model" -eq 0 ] && [ -n "${SLOWFAST_SERVE_MODEL:-}" ]; then
    serve_extra=(--model "$SLOWFAST_SERVE_MODEL" "${serve_extra[@]+"${serve_extra[@]}"}")
fi
# split the cores between the replicas unless told otherwise
if [ -z "$threads" ]; then
    cores="$(nproc 2>/dev/null || echo 1)"
    threads=$(( cores / replicas )); [ "$threads" -ge 1 ] || threads=1
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/slowfast-nginx.XXXXXX")"
chmod 755 "$work"   # nginx's workers (not root) read and write their temp dirs below it
pids=()
nginx_pid=""
cleaning=0
cleanup() {
    [ "$cleaning" -eq 1 ] && return
    cleaning=1
    if [ -n "$nginx_pid" ] && kill -0 "$nginx_pid" 2>/dev/null; then
        kill -TERM "$nginx_pid" 2>/dev/null || true
    fi
    for p in "${pids[@]+"${pids[@]}"}"; do
        kill -TERM "$p" 2>/dev/null || true
    done
    for p in "${pids[@]+"${pids[@]}"}" $nginx_pid; do
        for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$p" 2>/dev/null || true
        wait "$p" 2>/dev/null || true
    done
    if [ "${KEEP_LOGS:-0}" = 1 ]; then echo "logs kept in $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

dump_logs() {
    for f in "$work"/replica*.log "$work"/error.log; do
        [ -f "$f" ] || continue
        echo "---- $f (tail)" >&2
        tail -n 30 "$f" >&2
    done
}

# ---- replicas
urls=()
for i in $(seq 1 "$replicas"); do
    log="$work/replica$i.log"
    "$bin" serve --host 127.0.0.1 --port 0 --threads "$threads" "${serve_extra[@]+"${serve_extra[@]}"}" \
        >"$log" 2>&1 </dev/null &
    pids+=("$!")
done
for i in $(seq 1 "$replicas"); do
    log="$work/replica$i.log"
    pid="${pids[$((i - 1))]}"
    url=""
    deadline=$(( $(date +%s) + start_timeout ))
    while [ -z "$url" ]; do
        url="$(grep -o 'listening on http://[^[:space:]]*' "$log" 2>/dev/null | head -n 1 | sed 's/^listening on //' || true)"
        [ -n "$url" ] && break
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "serve_nginx.sh: replica $i exited before listening" >&2; dump_logs; exit 1
        fi
        if [ "$(date +%s)" -ge "$deadline" ]; then
            echo "serve_nginx.sh: replica $i printed no 'listening on' in ${start_timeout}s" >&2; dump_logs; exit 1
        fi
        sleep 0.2
    done
    port="${url##*:}"; port="${port%%/*}"
    url="http://127.0.0.1:$port"
    until curl -fsS -o /dev/null "$url/health" 2>/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null || [ "$(date +%s)" -ge "$deadline" ]; then
            echo "serve_nginx.sh: replica $i ($url) never answered /health" >&2; dump_logs; exit 1
        fi
        sleep 0.2
    done
    urls+=("$url")
done

# ---- nginx
[ "$front_port" = 0 ] && front_port="$(free_port)"
upstreams=""
for u in "${urls[@]}"; do
    upstreams+="        server ${u#http://} max_fails=3 fail_timeout=10s;"$'\n'
done
user_line=""
[ "$(id -u)" -eq 0 ] && user_line="user nobody nogroup;"
cat >"$work/nginx.conf" <<EOF
# generated by scripts/serve_nginx.sh
$user_line
worker_processes auto;
pid $work/nginx.pid;
error_log $work/error.log warn;
events { worker_connections 4096; }
http {
    access_log $work/access.log;
    client_body_temp_path $work/client_body;
    proxy_temp_path $work/proxy;
    fastcgi_temp_path $work/fastcgi;
    uwsgi_temp_path $work/uwsgi;
    scgi_temp_path $work/scgi;
    # the replicas enforce their own --max-body-bytes
    client_max_body_size 0;

    upstream slowfast {
        least_conn;
$upstreams        keepalive 64;
    }
    server {
        listen 127.0.0.1:$front_port;
        location / {
            proxy_pass http://slowfast;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host \$host;
            proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for;
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_cache off;
            proxy_connect_timeout 5s;
            proxy_send_timeout 3600s;
            proxy_read_timeout 3600s;
            # a replica that refuses connections is skipped (max_fails counts these)
            proxy_next_upstream error timeout http_502 http_503;
        }
        location = /nginx-health { return 200 "ok\n"; }
    }
}
EOF
if ! "$nginx_bin" -t -p "$work" -e "$work/error.log" -c "$work/nginx.conf" >"$work/nginx-t.log" 2>&1; then
    cat "$work/nginx-t.log" >&2; exit 1
fi
"$nginx_bin" -p "$work" -e "$work/error.log" -c "$work/nginx.conf" -g 'daemon off;' \
    >"$work/nginx.out" 2>&1 </dev/null &
nginx_pid=$!
front="http://127.0.0.1:$front_port"
for _ in $(seq 100); do
    curl -fsS -o /dev/null "$front/health" 2>/dev/null && break
    if ! kill -0 "$nginx_pid" 2>/dev/null; then
        echo "serve_nginx.sh: nginx exited" >&2; cat "$work/nginx.out" >&2; dump_logs; exit 1
    fi
    sleep 0.1
done
if ! curl -fsS -o /dev/null "$front/health"; then
    echo "serve_nginx.sh: $front/health does not answer through nginx" >&2; dump_logs; exit 1
fi

echo "front:     $front"
for i in "${!urls[@]}"; do echo "replica $((i + 1)): ${urls[$i]}   (metrics ${urls[$i]}/metrics, log $work/replica$((i + 1)).log)"; done
echo "nginx:     $work/nginx.conf"

if [ "$check" -eq 0 ]; then
    echo "Ctrl-C stops everything."
    # wait until a replica or nginx dies (or we are interrupted)
    while true; do
        for p in "${pids[@]}" "$nginx_pid"; do
            if ! kill -0 "$p" 2>/dev/null; then
                echo "serve_nginx.sh: process $p exited" >&2; dump_logs; exit 1
            fi
        done
        sleep 1
    done
fi

metrics_args=()
for u in "${urls[@]}"; do metrics_args+=(--metrics-url "$u/metrics"); done
rc=0
python3 "$repo/bench/serve_load.py" --url "$front" "${metrics_args[@]}" --expect-all-replicas \
    --concurrency "$concurrency" --requests "$requests" --max-tokens "$max_tokens" \
    --prompt-lengths "$prompt_lengths" --ignore-eos \
    "${load_extra[@]+"${load_extra[@]}"}" || rc=$?
if [ "$rc" -ne 0 ]; then
    echo "serve_nginx.sh --check: the load test failed ($rc)" >&2
    dump_logs
fi
exit "$rc"
