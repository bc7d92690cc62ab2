#!/usr/bin/env bash
# Re-measure the rows behind backends/PERFORMANCE.md, then regenerate its tables:
#   bash backends/perf/measure.sh && python -m dplab.backends.perf.tables --write backends/PERFORMANCE.md
# Each command writes its rows with --json; `perf/tables.py stamp` adds the date, the load average
# before and after the run and the core count: on a shared machine a number means little without
# its load.
set -euo pipefail
cd "$(dirname "$0")"
run() {  # run OUT.json dplab ARGS...: the rows, then the stamp (with the load before the run)
  local out=$1 before; shift
  before=$(cut -d' ' -f1 /proc/loadavg)
  "$@" --json "$out"
  python -m dplab.backends.perf.tables stamp "$out" "$before"
}
run bench_local.json dplab bench --backends local --world-sizes 2 --sizes 4K,1M,16M,64M \
    --algorithms ring,tree,direct,native --reps 3 --target-seconds 0.2
run bench_engines.json dplab bench --backends local,mpi,torch --world-sizes 2,4 --sizes 4K,1M,16M \
    --algorithms ring,native --reps 3 --target-seconds 0.2
run scaling.json dplab scaling --reps 2
run scaling_ddp.json dplab scaling --ddp --backends local,mpi,torch --reps 2
run compare_race.json dplab compare --modes sync,async --world-sizes 4 --time-budget 1
