#!/usr/bin/env bash
# GPU parity and benchmarks in one command (about 3 minutes on an H200).
#
#   cargo build --release -p tandem-bench --features cuda --bin gpu-bench
#   bench/gpu/run.sh [path/to/gpu-bench] [gpu-bench flags...]
#
# CUDA libraries are loaded at run time. Where they come from Python wheels
# (nvidia-cublas, nvidia-cuda-nvrtc, ...) rather than a system install, their
# lib folders are put on LD_LIBRARY_PATH. Results go to $OUT/gpu-bench.json
# (or ./gpu-bench.json); the table is printed last.
set -euo pipefail
bin=${1:-target/release/gpu-bench}
shift || true
if libs=$(python3 - 2>/dev/null <<'PY'
import glob, os
import nvidia
dirs = sorted({p for root in nvidia.__path__ for p in glob.glob(os.path.join(root, "**", "lib"), recursive=True)})
print(":".join(dirs))
PY
); then
    export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
export TANDEM_PTX_CACHE=${TANDEM_PTX_CACHE:-${TMPDIR:-/tmp}/tandem-ptx}
"$bin" --out "${OUT:-.}/gpu-bench.json" "$@"
