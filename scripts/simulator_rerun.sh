#!/usr/bin/env bash
# Re-measures everything the simulator's claims rest on, in one go, on a QUIET machine
# (docs/simulator.md): a calibration run of the real engine, the fit, the held-out validation
# (real engine vs simulator), the 10,000-request speed benchmark and the 20-point concurrency
# sweep. One OpenMP thread, as calibrated. Takes ~10 minutes on 2 idle cores.
# Usage: scripts/simulator_rerun.sh [TAG]   (TAG names the new folders; default: the UTC date+time).
# Writes results/reference/simulator_{calibration/smollm2-burst-c16-p512-TAG,validation-TAG,speed-TAG}
# and conf/hardware/cpu-1thread-TAG.yaml; nothing existing is overwritten.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TAG=${1:-$(date -u +%Y%m%d-%H%M)}
OUT=results/reference
CAL=$OUT/simulator_calibration/smollm2-burst-c16-p512-$TAG
SPEED=$OUT/simulator_speed-$TAG
export OMP_NUM_THREADS=1
mkdir -p "$SPEED"
log() { echo "$1: $(date -u '+%F %T') UTC, $(nproc --all) CPU cores, load average $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$SPEED/MACHINE.txt"; }

log "calibration run"
$PY run.py model=smollm2-135m workload=burst workload.concurrency=16 workload.max_prompt_len=512 \
  driver.progress=false hydra.run.dir="$CAL"
log "fit"
$PY -m experiments.calibrate "$CAL" --name "cpu-1thread-$TAG" --note "OMP_NUM_THREADS=1; scripts/simulator_rerun.sh $TAG"
log "validation"
$PY run.py +experiment=simulator_validation hardware="cpu-1thread-$TAG" hydra.sweep.dir="$OUT/simulator_validation-$TAG"
log "speed: 10,000 requests"
/usr/bin/time -f "wall %e s, user %U s, sys %S s" -o "$SPEED/benchmark_time.txt" \
  $PY run.py engine=simulated hardware=h100 model=llama-3.1-8b workload=poisson workload.num_requests=10000 \
  workload.rate=100 driver.progress=false plots=false hydra.run.dir="$SPEED/poisson_10000"
cat "$SPEED/benchmark_time.txt"
log "speed: 20-point concurrency sweep"
/usr/bin/time -f "wall %e s, user %U s, sys %S s" -o "$SPEED/sweep_time.txt" \
  $PY run.py -m engine=simulated hardware=h100 model=llama-3.1-8b workload=poisson workload.num_requests=1000 \
  workload.rate=inf scheduler.max_num_seqs=1024 'driver.max_concurrency=range(16,336,16)' plots=false \
  driver.progress=false hydra.sweep.dir="$SPEED/sweep_20"
cat "$SPEED/sweep_time.txt"
log "done"
