#!/usr/bin/env bash
# End-to-end GPU check of the serving stack: `tandem serve --device cuda`
# answers a gRPC request with the CPU engine's greedy tokens.
#
#   cargo build --release -p tandem --features cuda
#   bench/gpu/serve-check.sh [path/to/tandem]
set -euo pipefail
tandem=${1:-target/release/tandem}
if libs=$(python3 - 2>/dev/null <<'PY'
import glob, os
import nvidia
dirs = sorted({p for root in nvidia.__path__ for p in glob.glob(os.path.join(root, "**", "lib"), recursive=True)})
print(":".join(dirs))
PY
); then
    export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export TANDEM_PTX_CACHE=${TANDEM_PTX_CACHE:-${TMPDIR:-/tmp}/tandem-ptx}
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
"$tandem" gen-model --config small --out "$work/model" --seed 1 >/dev/null
prompt="hello from the GPU"
"$tandem" generate --model "$work/model" --prompt "$prompt" --max-tokens 32 --ignore-eos >"$work/cpu.txt"
addr=127.0.0.1:50777
"$tandem" serve --model "$work/model" --addr "$addr" --device cuda --gpu-dtype f32 --num-kv-blocks 256 \
    >"$work/serve.log" 2>&1 &
for _ in $(seq 1 120); do
    if "$tandem" generate --server "$addr" --prompt "$prompt" --max-tokens 32 --ignore-eos >"$work/gpu.txt" 2>/dev/null; then
        break
    fi
    sleep 0.5
done
echo "CPU: $(cat "$work/cpu.txt")"
echo "GPU: $(cat "$work/gpu.txt")"
if cmp -s "$work/cpu.txt" "$work/gpu.txt"; then
    echo "serve-check: tandem serve --device cuda matches the CPU engine"
else
    echo "serve-check: MISMATCH"; tail -20 "$work/serve.log"; exit 1
fi
