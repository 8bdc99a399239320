#!/usr/bin/env bash
# One call on a GPU machine: GPU tests, kernel benchmarks against FA4, NSA against dense attention,
# compute-sanitizer, the longest sequence that fits, training; logs under $OUT, a summary last.
#   bash tools/device_check.sh   (with the package, flash-attn-4 and fla-core installed)
set -uo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//'
  echo "Environment: OUT (log folder, default /tmp/nsa-device-out), TRAIN_STEPS (default 150)."
  exit 0
fi
out=${OUT:-/tmp/nsa-device-out}
mkdir -p "$out"
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'
# The GPU tests over every visible GPU (tools/run_gpu_tests.py); each shard's log beside
python3 tools/run_gpu_tests.py --log-dir "$out/gpu_tests" > "$out/gpu_tests.log" 2>&1
python3 tools/bench_kernels.py --reps 20 --json "$out/bench_kernels.json" > "$out/bench_kernels.log" 2>&1
python3 tools/tune_sm90_forward.py --json "$out/tune.json" > "$out/tune.log" 2>&1
python3 tools/tune_sm90_backward.py --seqlens 16384 --json "$out/tune_bwd.json" > "$out/tune_bwd.log" 2>&1
python3 tools/profile_nsa.py --seqlens 16384,65536 --repeats 5 --json "$out/profile_nsa.json" \
    > "$out/profile_nsa.log" 2>&1
python3 tools/bench_selection.py --seqlens 16384,65536,262144 --json "$out/bench_selection.json" \
    > "$out/bench_selection.log" 2>&1
python3 tools/bench_nsa_vs_dense.py --seqlens 16384,65536 --passes fwd --methods nsa,nsa-graph,fa4,sdpa \
    --json "$out/bench_nsa_fwd.json" > "$out/bench_nsa_fwd.log" 2>&1
python3 tools/bench_nsa_vs_dense.py --seqlens 16384,65536 --passes fwd+bwd --methods nsa,fa4 --warmup 1 \
    --repeats 3 --branch-profile --json "$out/bench_nsa_fwdbwd.json" > "$out/bench_nsa_fwdbwd.log" 2>&1
for tool in racecheck synccheck; do
  compute-sanitizer --tool $tool --kernel-name kns=Backward python3 tools/sanitize_sm90_backward.py \
      > "$out/sanitize_$tool.log" 2>&1
done
python3 tools/diagnose_memory.py --seqlens 1048576 --max-length --passes fwd+bwd --resolution 262144 --json "$out/memory.json" \
    > "$out/memory.log" 2>&1
python3 tools/train_packed.py --steps ${TRAIN_STEPS:-150} --no-progress --json "$out/train.json" \
    > "$out/train.log" 2>&1
echo "== GPU tests";        tail -3 "$out/gpu_tests.log"
echo "== kernels vs FA4";   tail -22 "$out/bench_kernels.log"
echo "== tile schedules";   tail -28 "$out/tune.log"
echo "== backward variants"; tail -15 "$out/tune_bwd.log"
echo "== NSA profile";      tail -60 "$out/profile_nsa.log"
echo "== selection";        tail -18 "$out/bench_selection.log"
echo "== NSA fwd";          tail -12 "$out/bench_nsa_fwd.log"
echo "== NSA fwd+bwd";      tail -18 "$out/bench_nsa_fwdbwd.log"
echo "== sanitizer";      tail -n 1 "$out"/sanitize_*.log
echo "== memory";         grep "longest N" "$out/memory.log"
echo "== train";            tail -4 "$out/train.log"
