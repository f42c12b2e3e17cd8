#!/usr/bin/env bash
# Hand-backs under continuous unload and load, in one command.
#
# Starts `shoal serve` on a free-ish port, unloads and loads MODEL again in
# a loop without pause (POST /v1/models/MODEL/unload, then /load) while N
# /v1/embeddings requests of 40 inputs each go to it, CONCURRENCY at a time,
# with a 90 s deadline. Prints the status counts, the error codes, the
# loads, and the requests slower than 20 s: with the default AckWait (30 s)
# a hand-back lost until AckWait shows as one.
#
# Usage: bench/churn.sh
# Environment (defaults in brackets):
#   SHOAL        the shoal binary     [build/src/cli/shoal]
#   MODELS_DIR   model repository     [models]
#   MODEL        [tiny-bert]   N [600]   CONCURRENCY [16]   PORT [18123]
set -euo pipefail
cd "$(dirname "$0")/.."
SHOAL=${SHOAL:-build/src/cli/shoal}
MODELS_DIR=${MODELS_DIR:-models}
MODEL=${MODEL:-tiny-bert}
N=${N:-600}
CONCURRENCY=${CONCURRENCY:-16}
PORT=${PORT:-18123}
URL=http://127.0.0.1:$PORT
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$SHOAL" serve --models-dir "$MODELS_DIR" --port "$PORT" --request-timeout-ms 90000 > "$work/serve.log" 2>&1 &
serve=$!
for _ in $(seq 1 200); do curl -s -o /dev/null "$URL/v1/models" && break; sleep 0.3; done
python3 -c 'import json,sys; print(json.dumps({"model": sys.argv[1], "input": ["the quick brown fox number %d jumps over the lazy dog" % i for i in range(40)]}))' \
  "$MODEL" > "$work/body.json"

(while [ ! -f "$work/stop" ]; do
   for action in unload load; do curl -s -o /dev/null -X POST -m 60 "$URL/v1/models/$MODEL/$action" || true; done
 done) &
churn=$!
mkdir "$work/bodies"
start=$(date +%s)
seq 1 "$N" | xargs -P "$CONCURRENCY" -I{} curl -s -o "$work/bodies/{}.json" -w '%{http_code} %{time_total}\n' -m 120 \
  -H 'Content-Type: application/json' --data @"$work/body.json" "$URL/v1/embeddings" > "$work/codes.txt" || true
end=$(date +%s)
touch "$work/stop"
wait "$churn"
kill -INT "$serve"
wait "$serve" || true

echo "requests: $N in $((end - start)) s"
echo "status:   $(awk '{print $1}' "$work/codes.txt" | sort | uniq -c | tr -s ' \n' ' ')"
echo "errors:   $(cat "$work"/bodies/*.json | grep -o '"code":"[a-z_]*"' | sort | uniq -c | tr -s ' \n' ' ')"
echo "loads:    $(grep -c "loaded $MODEL" "$work/serve.log" || true)"
echo "over 20 s: $(awk '$2 > 20' "$work/codes.txt" | wc -l), slowest $(sort -k2 -n "$work/codes.txt" | tail -1 | awk '{print $2}') s"
