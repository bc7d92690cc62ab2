#!/usr/bin/env bash
# The sim backend's validation rows (backends/PERFORMANCE.md, "The simulator against measurements"):
#   bash backends/perf/measure_sim.sh machine   # (a) only: about 4 minutes, on a QUIET machine
#   bash backends/perf/measure_sim.sh           # (a), then (b), (c), (d) and the simulator's speed
#   python -m dplab.backends.perf.tables --write backends/PERFORMANCE.md
# (a) calibrates the this-machine preset on every core at once and two ranks (writing
# reference/clusters/this-machine.json), measures the local backend (bench at 2 and 4 ranks, the
# reference recipe's and DDP's steps at 2 and 4), then runs the same commands on the preset. Every
# file records its date and load: `uptime` should show a load below 1 before it starts.
# Protocol: every bench cell (here and in the calibration, sim/machine.py's BENCH) is the median
# of 5 timed loops of 0.1 s in each of 3 worlds, algorithms interleaved (4 ranks on 2 cores: one
# world's times can be half or twice the next one's); every step the median of 5 repetitions.
# (b), (c), (d) and the simulator's speed need no quiet machine: their measurements are shipped.
set -euo pipefail
what=${1:-all}
case $what in machine|rest|all) ;; *) echo "usage: $0 [machine|rest|all]" >&2; exit 2 ;; esac
cd "$(dirname "$0")"
run() {  # run OUT.json dplab ARGS...: the rows, then the stamp (with the load before the run)
  local out=$1 before; shift
  before=$(cut -d' ' -f1 /proc/loadavg)
  "$@" --json "$out"
  python -m dplab.backends.perf.tables stamp "$out" "$before"
}
if [[ $what != rest ]]; then
  load=$(cut -d' ' -f1 /proc/loadavg)
  if [[ -z ${DPLAB_ANY_LOAD:-} ]] && ! awk "BEGIN { exit !($load < 1.5) }"; then
    echo "load $load: (a) needs a quiet machine (a 1-minute load below 1.5); wait for one, or" \
         "set DPLAB_ANY_LOAD=1 to measure anyway" >&2
    exit 2
  fi
  echo "load before (a): $(cut -d' ' -f1-3 /proc/loadavg)"
  python -m dplab.backends.sim.machine --out ../../reference/clusters/this-machine.json
  run machine_bench.json dplab bench --backends local --world-sizes 2,4 --sizes 1M,4M,16M,64M \
      --algorithms ring,tree,direct,native --reps 5 --target-seconds 0.5 --worlds 3
  run machine_scaling.json dplab scaling --backends local --models 400k,4M --world-sizes 1,2,4 \
      --reps 5 --steps 8
  run machine_ddp.json dplab scaling --ddp --backends local --world-sizes 2,4 --reps 5
  python -m dplab.backends.sim.validate machine machine_bench.json machine_scaling.json \
      machine_ddp.json --out validation_machine.json
fi
if [[ $what != machine ]]; then
  for kind in published gpu closed speed; do
    python -m dplab.backends.sim.validate "$kind" --out "validation_$kind.json"
  done
fi
