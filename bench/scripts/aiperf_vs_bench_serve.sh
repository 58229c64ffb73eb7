#!/usr/bin/env bash
# Profiles one local cluster (`tandem up`) on one workload twice: with NVIDIA's
# aiperf over the OpenAI HTTP API, and with `tandem bench serve` over gRPC,
# and prints both TTFT and throughput figures side by side.
#
# Usage: bench/scripts/aiperf_vs_bench_serve.sh [OUT_DIR]
# The cluster runs on CPU 0 and both clients on CPU 1 (SERVER_CPUS and
# CLIENT_CPUS change that), so neither client's own CPU use slows the
# server it measures: aiperf's Python processes need far more than
# `bench serve` does.
# Needs: a release build (`cargo build --release -p tandem`) and aiperf
# (`python3 -m venv V && V/bin/pip install aiperf`; set AIPERF=V/bin/aiperf).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-target/aiperf-compare}
AIPERF=${AIPERF:-aiperf}
TANDEM=target/release/tandem
CONC=${CONC:-4}
SERVER_CPUS=${SERVER_CPUS:-0}
CLIENT_CPUS=${CLIENT_CPUS:-1}
COUNT=${COUNT:-48}
ISL=${ISL:-256}
OSL=${OSL:-64}
mkdir -p "$OUT"

taskset -c "$SERVER_CPUS" "$TANDEM" up --addr 127.0.0.1:0 --http-addr 127.0.0.1:0 --no-etcd >"$OUT/up.out" 2>"$OUT/up.err" &
UP=$!
trap 'kill $UP 2>/dev/null; wait $UP 2>/dev/null' EXIT
for _ in $(seq 600); do grep -q "^listening on" "$OUT/up.out" && break; sleep 0.5; done
GRPC=$(sed -n 's/^listening on //p' "$OUT/up.out")
HTTP=$(sed -n 's/^http listening on //p' "$OUT/up.out")
# `up` generated (or reused) the built-in model; aiperf needs its tokenizer.
MODEL=$(sed -n 's/.*model loaded model=//p' "$OUT/up.err" | head -1)
NAME=$(basename "$MODEL")
echo "cluster: grpc $GRPC, http $HTTP, model $NAME"

# Warm up both paths once (page in the weights, connect).
taskset -c "$CLIENT_CPUS" "$TANDEM" bench serve --router "$GRPC" --num-requests 8 --concurrency "$CONC" \
  --input-len "fixed:$ISL" --output-len "fixed:$OSL" --seed 99 --no-progress >/dev/null

taskset -c "$CLIENT_CPUS" "$AIPERF" profile -m "$NAME" --url "http://$HTTP" --endpoint-type completions --streaming \
  --concurrency "$CONC" --request-count "$COUNT" \
  --synthetic-input-tokens-mean "$ISL" --synthetic-input-tokens-stddev 0 \
  --output-tokens-mean "$OSL" --output-tokens-stddev 0 \
  --extra-inputs ignore_eos:true --use-server-token-count \
  --tokenizer "$MODEL" --random-seed 0 --output-artifact-dir "$OUT/aiperf" \
  --no-auto-plot --workers-max 1 --record-processors 1 --ui none >"$OUT/aiperf.log" 2>&1 || { tail -40 "$OUT/aiperf.log"; exit 1; }

taskset -c "$CLIENT_CPUS" "$TANDEM" bench serve --router "$GRPC" --num-requests "$COUNT" --concurrency "$CONC" \
  --input-len "fixed:$ISL" --output-len "fixed:$OSL" --seed 0 --no-progress \
  --out "$OUT/bench_serve.json" | tee "$OUT/bench_serve.txt"

python3 - "$OUT" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
agg = json.load(open(glob.glob(os.path.join(out, "aiperf", "**", "profile_export_aiperf.json"), recursive=True)[0]))
def metric(name):
    m = agg.get(name) or agg.get("records", {}).get(name) or {}
    return m
a_ttft = metric("time_to_first_token")
a_tput = metric("output_token_throughput")
a_req = metric("request_throughput")
b = json.load(open(os.path.join(out, "bench_serve.json")))["summary"]
rows = {
    "ttft_mean_ms": (a_ttft.get("avg"), b["ttft"]["mean"] * 1e3),
    "ttft_p50_ms": (a_ttft.get("p50"), b["ttft"]["p50"] * 1e3),
    "output_tok_per_s": (a_tput.get("avg"), b["output_token_throughput"]),
    "requests_per_s": (a_req.get("avg"), b["request_throughput"]),
}
res = {k: {"aiperf": a, "bench_serve": t, "ratio": (a / t if a and t else None)} for k, (a, t) in rows.items()}
print(json.dumps(res, indent=2))
json.dump(res, open(os.path.join(out, "comparison.json"), "w"), indent=2)
PY
