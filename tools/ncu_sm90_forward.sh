#!/usr/bin/env bash
# Nsight Compute on one launch of the sm90 forward (tools/launch_sm90_forward.py): the full
# section set with per-instruction stall samples, exported as CSV next to the report.
#   bash tools/ncu_sm90_forward.sh OUTDIR NAME [launch_sm90_forward.py arguments...]
# Clocks are left as the card runs them (--clock-control none), as METHOD.md asks.
set -euo pipefail
if [ $# -lt 2 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'
  [ $# -ge 1 ] && { [ "$1" = "-h" ] || [ "$1" = "--help" ]; } && exit 0
  exit 2
fi
out=$1; name=$2; shift 2
mkdir -p "$out"
ncu --clock-control none --set full --import-source no --nvtx --nvtx-include "profiled/" \
    -f -o "$out/$name" python3 tools/launch_sm90_forward.py "$@" > "$out/$name.ncu.log" 2>&1
ncu -i "$out/$name.ncu-rep" --page details --csv > "$out/$name.details.csv"
ncu -i "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/$name.sass.csv"
echo "$name: $(wc -l < "$out/$name.sass.csv") SASS lines"
