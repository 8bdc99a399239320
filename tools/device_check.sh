#!/usr/bin/env bash
# One device-machine session: GPU tests, then the kernel benchmark; full logs under $OUT.
#   source .device/activate.sh && bash tools/device_check.sh [pytest args...]
set -uo pipefail
out=${OUT:-/tmp/nsa-device-out}
mkdir -p "$out"
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'
python3 -m pytest -m gpu -q -x "${@:-tests}" 2>&1 | tee "$out/gpu_tests.log" | tail -25
python3 tools/bench_kernels.py --json "$out/bench_kernels.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" | tail -20
