#!/usr/bin/env bash
# The main job on embedded defaults: demo shards -> the service on loopback -> one shard through it
# with curl, as an AIS target would push it (hpush) -> a summary of what came back, and a preview.
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-demo-out}
PORT=${PORT:-$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

echo "== 1. demo shards (ImageNet-like JPEGs made from real photographs)"
$PY -m transformer make-shards "$OUT/shards" --shards 2 --samples 100

echo "== 2. the transformer service on 127.0.0.1:$PORT (preset imagenet-train, float32 CHW)"
$PY -m transformer serve --host 127.0.0.1 --port "$PORT" > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  kill -0 $SERVER 2>/dev/null || { cat "$OUT/server.log"; exit 1; }
  sleep 0.5
done
curl -fsS "http://127.0.0.1:$PORT/health"; echo

echo "== 3. push a shard through it (hpush PUT with the shard as body, seeded augmentation)"
curl -fsS -X PUT --data-binary @"$OUT/shards/demo-000000.tar" \
  "http://127.0.0.1:$PORT/demo/demo-000000.tar?etl_args=%7B%22seed%22%3A42%7D" \
  -o "$OUT/demo-000000.transformed.tar" \
  -w "HTTP %{http_code}: %{size_upload} bytes in, %{size_download} bytes out in %{time_total} s\n"

echo "== 4. what came back"
$PY -m transformer inspect "$OUT/demo-000000.transformed.tar"
$PY -m transformer preview "$OUT/demo-000000.transformed.tar" -o "$OUT/preview.png" --count 16
curl -fsS "http://127.0.0.1:$PORT/metrics" | grep -E '^etl_(shards_total|samples_total\{outcome="ok"\}|bytes_(in|out)_total)'
