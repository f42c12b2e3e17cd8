#!/usr/bin/env bash
# Pull against push on the same simulated fleet, in one command.
#
# For each worker count in WORKERS: a private nats-server -js, one `shoal
# worker --sim-workers N` process hosting N simulated devices (runtime sim)
# that each serve all 20 models of a generated repository, then for each
# mode (pull: free pulling; pull-ahead: load-aware pulling, workers with
# --pull-ahead; push) fresh workers, a fresh gateway and a
# `shoal bench` open-loop sweep (Zipf(1.1) over the 20 models, short
# inputs). Reports, per mode and worker count, the highest offered rate
# whose p99 stayed under SLO_MS with no errors, the throughput there, the
# mean worker utilisation and the rows per forward pass. Then (SCALING=1)
# the pull scaling curve: closed-loop throughput at 1, 2, 4, ... workers.
#
# Usage: bench/pull_vs_push.sh [OUT_DIR]     (default: pull-vs-push/)
# Environment (defaults in brackets):
#   SHOAL        the shoal binary                [build/src/cli/shoal]
#   WORKERS      worker counts                   ["4 16 64"]
#   PER_WORKER_RATES  offered req/s per worker   ["25 50 75 100"; "6 12 19 25" at 32+ workers,
#                where the 2-CPU machine, not the devices, is the limit]
#   DURATION, WARMUP  seconds per load level     [10, 2]
#   SLO_MS       p99 bound                       [250]
#   SIM_FIXED_US, SIM_PER_TOKEN_US  device cost per batch: fixed + per padded token [20000, 250]
#   MAX_BATCH    rows per forward pass           [32]
#   MAX_WAIT_US  batcher wait                    [2000]
#   LOAD_REPORT_MS  push: load report interval   [100]
#   MAX_HELD_ROWS   workers' --max-held-rows (bound on pulled work held) [0: none]
#   PULL_AHEAD   workers' --pull-ahead in pull-ahead mode (passes waiting for the device) [1]
#   PULL_IDLE_POLL_MS  workers' --pull-idle-poll-ms  [20]
#   FETCH_POLL_MS   workers' --fetch-poll-ms (longest pull; with PULL_AHEAD, idle models back off to it) [5000]
#   DEMAND_POLL_MS  workers' --demand-poll-ms (how fresh their view of the backlog is) [1000]
#   MODES        modes to run, in order  ["pull pull-ahead push"]
#   PUSH_POLICY  least-loaded | p2c              [least-loaded]
#   GATEWAYS     gateways sharing the load (shoal bench spreads its
#                connections over them); a push gateway knows its own
#                sends exactly and the others' only from load reports [1]
#   SCALING      1: also the pull scaling curve  [1]
#   SCALING_MODE pull or pull-ahead for the curve [pull]
#   SCALING_WORKERS                              ["1 2 4 8 16 32 64"]
#   SCALING_CLIENTS_PER_WORKER  closed-loop clients per worker [24]
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
out="$(realpath -m "${1:-pull-vs-push}")"
SHOAL="${SHOAL:-$here/build/src/cli/shoal}"
WORKERS="${WORKERS:-4 16 64}"
PER_WORKER_RATES="${PER_WORKER_RATES:-}"
DURATION="${DURATION:-10}"
WARMUP="${WARMUP:-2}"
SLO_MS="${SLO_MS:-250}"
SIM_FIXED_US="${SIM_FIXED_US:-20000}"
SIM_PER_TOKEN_US="${SIM_PER_TOKEN_US:-250}"
MAX_BATCH="${MAX_BATCH:-32}"
MAX_WAIT_US="${MAX_WAIT_US:-2000}"
LOAD_REPORT_MS="${LOAD_REPORT_MS:-100}"
MAX_HELD_ROWS="${MAX_HELD_ROWS:-0}"
PUSH_POLICY="${PUSH_POLICY:-least-loaded}"
PULL_AHEAD="${PULL_AHEAD:-1}"
PULL_IDLE_POLL_MS="${PULL_IDLE_POLL_MS:-20}"
DEMAND_POLL_MS="${DEMAND_POLL_MS:-1000}"
FETCH_POLL_MS="${FETCH_POLL_MS:-5000}"
MODES="${MODES:-pull pull-ahead push}"
GATEWAYS="${GATEWAYS:-1}"
SCALING="${SCALING:-1}"
SCALING_MODE="${SCALING_MODE:-pull}"
SCALING_WORKERS="${SCALING_WORKERS:-1 2 4 8 16 32 64}"
SCALING_CLIENTS_PER_WORKER="${SCALING_CLIENTS_PER_WORKER:-24}"
NMODELS=20
vocab="$here/models/tiny-bert/vocab.txt"

[[ -x "$SHOAL" ]] || { echo "no shoal binary at $SHOAL (build it first)" >&2; exit 1; }
[[ -f "$vocab" ]] || { echo "no $vocab (run scripts/setup.sh)" >&2; exit 1; }
command -v nats-server >/dev/null || { echo "nats-server not installed" >&2; exit 1; }
mkdir -p "$out"
tmp="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT

# --- the model repository: 20 simulated models -------------------------------
repo="$tmp/models"
models=""
for i in $(seq -w 1 $NMODELS); do
  name="sim-$i"
  mkdir -p "$repo/$name"
  cp "$vocab" "$repo/$name/vocab.txt"
  cat > "$repo/$name/shoal.json" <<EOF
{"name": "$name", "task": "embed", "runtime": "sim", "dim": 64, "max_seq_len": 128,
 "tokenizer": {"type": "wordpiece", "vocab_file": "vocab.txt", "lowercase": true},
 "batching": {"max_batch_tokens": 8192, "max_batch_size": $MAX_BATCH, "max_wait_us": $MAX_WAIT_US},
 "sim": {"fixed_us": $SIM_FIXED_US, "per_padded_token_us": $SIM_PER_TOKEN_US, "max_batch_rows": 0,
         "memory_bytes": 1048576, "load_ms": 0}}
EOF
  models="${models:+$models,}$name"
done

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_http() {  # url, timeout s
  for _ in $(seq 1 $(( $2 * 10 ))); do
    curl -sf "$1" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "timed out waiting for $1" >&2
  return 1
}

# Waits until the gateway lists n workers (their heartbeats reached it).
wait_workers() {  # gateway url, n
  for _ in $(seq 1 600); do
    have=$(curl -sf "$1/v1/workers" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["data"]))' 2>/dev/null || echo 0)
    [[ "$have" -ge "$2" ]] && return 0
    sleep 0.2
  done
  echo "only $have of $2 workers registered" >&2
  return 1
}

nats_port=0; nats_pid=0; worker_pid=0; gw_pid=0; gw_url=""
start_nats() {
  nats_port=$(free_port)
  mkdir -p "$tmp/nats-$nats_port"
  nats-server -js -sd "$tmp/nats-$nats_port" -a 127.0.0.1 -p "$nats_port" > "$tmp/nats-$nats_port.log" 2>&1 &
  nats_pid=$!; pids+=("$nats_pid")
  for _ in $(seq 1 50); do (echo > "/dev/tcp/127.0.0.1/$nats_port") 2>/dev/null && return 0; sleep 0.1; done
  echo "nats-server did not start" >&2; return 1
}
wm_port=0
start_workers() {  # n, mode
  wm_port=$(free_port)
  local ahead=0
  [[ "${2:-pull}" == pull-ahead ]] && ahead="$PULL_AHEAD"
  SHOAL_LOG_LEVEL=warn "$SHOAL" worker --metrics-port "$wm_port" --nats-url "nats://127.0.0.1:$nats_port" --models-dir "$repo" \
    --sim-workers "$1" --worker-id "sim$1-${2:-pull}" --queue-memory --heartbeat-ms 1000 --heartbeat-ttl-ms 5000 \
    --fetch-poll-ms "$FETCH_POLL_MS" --demand-poll-ms "$DEMAND_POLL_MS" --load-report-ms "$LOAD_REPORT_MS" --max-held-rows "$MAX_HELD_ROWS" \
    --pull-ahead "$ahead" --pull-idle-poll-ms "$PULL_IDLE_POLL_MS" \
    > "$tmp/worker-$1.log" 2>&1 &
  worker_pid=$!; pids+=("$worker_pid")
}
gw_pids=(); gw_urls=""
start_gateway() {  # mode; starts GATEWAYS of them: gw_url is the first, gw_urls all
  gw_pids=(); gw_urls=""
  for g in $(seq 1 "$GATEWAYS"); do
    local port; port=$(free_port)
    SHOAL_LOG_LEVEL=warn "$SHOAL" gateway --nats-url "nats://127.0.0.1:$nats_port" --host 127.0.0.1 --port "$port" \
      --dispatch "$1" --push-policy "$PUSH_POLICY" --http-threads 2 > "$tmp/gateway-$1-$g.log" 2>&1 &
    gw_pids+=("$!"); pids+=("$!")
    gw_urls="${gw_urls:+$gw_urls,}http://127.0.0.1:$port"
    wait_http "http://127.0.0.1:$port/healthz" 30
  done
  gw_url="${gw_urls%%,*}"
}
stop_gateways() { for p in "${gw_pids[@]}"; do stop "$p"; done; }
stop() { kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }

# "rows passes" so far, from the worker process's metrics (summed over its
# simulated workers and models).
batch_counts() {
  curl -sf "http://127.0.0.1:$wm_port/metrics" | awk '
    /^shoal_worker_batch_rows_sum/ {s += $NF} /^shoal_worker_batch_rows_count/ {c += $NF}
    END {printf "%d %d\n", s, c}'
}

bench() {  # out dir, extra args...
  local dir="$1"; shift
  "$SHOAL" bench --url "$gw_urls" --models "$models" --popularity zipf:1.1 --input-words uniform:3:10 \
    --batch 1 --duration "$DURATION" --warmup "$WARMUP" --quiet --out "$dir" "$@" > "$dir.txt" 2>&1 || true
}

summary="$out/summary.tsv"
printf 'workers\tmode\toffered\tachieved_req_s\tp50_ms\tp99_ms\terrors\tdropped\tmean_utilisation\n' > "$summary"
printf 'workers\tmode\trows_per_pass_over_the_sweep\n' > "$out/batching.tsv"

for n in $WORKERS; do
  for mode in $MODES; do
    # Fresh NATS and workers per mode: neither inherits the other's state.
    start_nats
    start_workers "$n" "$mode"
    start_gateway "${mode%-ahead}"
    wait_workers "$gw_url" "$n"
    per_worker="$PER_WORKER_RATES"
    [[ -z "$per_worker" ]] && { per_worker="25 50 75 100"; (( n >= 32 )) && per_worker="6 12 19 25"; }
    rates=""
    for r in $per_worker; do rates="${rates:+$rates,}$(( r * n ))"; done
    echo "== $n workers, $mode, rates $rates" >&2
    read -r rows0 passes0 < <(batch_counts)
    bench "$out/w$n-$mode" --rates "$rates" --max-connections 4096
    read -r rows1 passes1 < <(batch_counts)
    python3 -c "import sys; r,p=$rows1-$rows0,$passes1-$passes0; print('$n\t$mode\t%.2f' % (r/p if p else float('nan')))" >> "$out/batching.tsv"
    python3 - "$out/w$n-$mode/results.json" "$n" "$mode" >> "$summary" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
for p in r["phases"]:
    u = p.get("mean_utilisation") or {}
    mean_u = sum(u.values()) / len(u) if u else float("nan")
    lat = p.get("latency_ms", {})
    print("\t".join(str(x) for x in [sys.argv[2], sys.argv[3], p.get("offered_rate"),
          round(p["throughput"]["requests_per_s"], 1), round(lat.get("p50", float("nan")), 1),
          round(lat.get("p99", float("nan")), 1), p.get("errors", 0), p.get("dropped", 0), round(mean_u, 3)]))
EOF
    curl -sf "$gw_url/metrics" > "$out/w$n-$mode.gateway-metrics.txt" || true
    stop_gateways
    stop "$worker_pid"
    stop "$nats_pid"
  done
done

if [[ "$SCALING" == 1 ]]; then
  printf 'workers\tclients\treq_s\tp50_ms\tp99_ms\tmean_utilisation\n' > "$out/scaling.tsv"
  for n in $SCALING_WORKERS; do
    start_nats
    start_workers "$n" "$SCALING_MODE"
    start_gateway pull
    wait_workers "$gw_url" "$n"
    c=$(( n * SCALING_CLIENTS_PER_WORKER ))
    echo "== scaling: $n workers, $c closed-loop clients" >&2
    bench "$out/scaling-w$n" --closed "$c" --max-connections 4096
    python3 - "$out/scaling-w$n/results.json" "$n" "$c" >> "$out/scaling.tsv" <<'EOF'
import json, sys
p = json.load(open(sys.argv[1]))["phases"][0]
u = p.get("mean_utilisation") or {}
print("\t".join(str(x) for x in [sys.argv[2], sys.argv[3], round(p["throughput"]["requests_per_s"], 1),
      round(p["latency_ms"]["p50"], 1), round(p["latency_ms"]["p99"], 1),
      round(sum(u.values()) / len(u), 3) if u else "nan"]))
EOF
    stop_gateways; stop "$worker_pid"; stop "$nats_pid"
  done
fi

# --- the verdict: best rate under the SLO per (workers, mode) -------------------
python3 - "$summary" "$SLO_MS" > "$out/verdict.txt" <<'EOF'
import csv, sys
slo = float(sys.argv[2])
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
best = {}
for r in rows:
    key = (int(r["workers"]), r["mode"])
    ok = float(r["p99_ms"]) <= slo and int(r["errors"]) == 0 and int(r["dropped"]) == 0
    if ok and float(r["achieved_req_s"]) > best.get(key, (0, None))[0]:
        best[key] = (float(r["achieved_req_s"]), r)
print(f"max throughput with p99 <= {slo:g} ms and no errors (req/s, mean utilisation there)")
for n in sorted({k[0] for k in best} | {int(r["workers"]) for r in rows}):
    line = [f"{n:>3} workers"]
    for mode in sorted({k[1] for k in best} | {r["mode"] for r in rows}):
        b = best.get((n, mode))
        line.append(f"{mode}: {b[0]:8.1f} (util {b[1]['mean_utilisation']})" if b else f"{mode}: none under SLO")
    push = best.get((n, "push"))
    for mode in ("pull", "pull-ahead"):
        b = best.get((n, mode))
        if b and push and push[0] > 0: line.append(f"{mode}/push {b[0] / push[0]:.2f}")
    print("  ".join(line))
EOF
cat "$out/verdict.txt"
cat "$out/batching.tsv"
[[ -f "$out/scaling.tsv" ]] && cat "$out/scaling.tsv"
echo "results in $out" >&2
