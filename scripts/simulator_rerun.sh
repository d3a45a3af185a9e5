#!/usr/bin/env bash
# Re-measures everything the simulator's claims rest on, in one go, on a QUIET machine
# (docs/simulator.md): three calibration runs of the real engine, the fits, the held-out
# validation (real engine vs simulator, three interleaved repeats), the 10,000-request speed
# benchmark and the 20-point concurrency sweep. One OpenMP thread, as calibrated.
# Takes ~5 minutes on 2 idle cores (calibration runs ~1 min, validation ~3 min, the rest ~1 min).
# Usage: scripts/simulator_rerun.sh [TAG]   (TAG names the new folders; default: the UTC date+time).
# Writes results/reference/simulator_calibration/{smollm2-burst-c16-p512,smollm2-burst-c2-p512,
# smollm2-shared-prefix-u16}-TAG, results/reference/simulator_{validation-TAG,validation-TAG-resim-2runs,speed-TAG}
# and conf/hardware/cpu-1thread-TAG.yaml (all three runs) and cpu-1thread-2runs-TAG.yaml (the two
# bursts: no shared KV blocks, so shared_kv_time_scale stays null); nothing existing is overwritten.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TAG=${1:-$(date -u +%Y%m%d-%H%M)}
OUT=results/reference
CAL=$OUT/simulator_calibration
C16=$CAL/smollm2-burst-c16-p512-$TAG
C2=$CAL/smollm2-burst-c2-p512-$TAG
SHARED=$CAL/smollm2-shared-prefix-u16-$TAG
SPEED=$OUT/simulator_speed-$TAG
export OMP_NUM_THREADS=1
mkdir -p "$SPEED"
log() { echo "$1: $(date -u '+%F %T') UTC, $(nproc --all) CPU cores, load average $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$SPEED/MACHINE.txt"; }

# Calibration runs: decode batches from 16 down to 1 with prompts of 16-512 tokens (c = 16),
# long runs of 1-2 sequences (c = 2), and decode steps whose sequences share a 384-token prefix
# in the prefix cache (a leader computes it, 15 users arrive together 1 s later and hit it).
log "calibration run c=16"
$PY run.py model=smollm2-135m workload=burst workload.concurrency=16 workload.max_prompt_len=512 \
  driver.progress=false hydra.run.dir="$C16"
log "calibration run c=2"
$PY run.py model=smollm2-135m workload=burst workload.concurrency=2 workload.requests_per_slot=4 \
  workload.max_prompt_len=512 driver.progress=false hydra.run.dir="$C2"
log "calibration run shared prefix"
$PY run.py model=smollm2-135m cache=prefix workload=shared_prefix workload.num_users=16 workload.prefix_len=384 \
  workload.arrival_interval_s=0.03 workload.leader_lead_s=1.0 workload.max_tokens=48 driver.progress=false \
  hydra.run.dir="$SHARED"
log "fit"
$PY -m experiments.calibration.calibrate "$C16" "$C2" "$SHARED" --name "cpu-1thread-$TAG" \
  --note "OMP_NUM_THREADS=1; scripts/simulator_rerun.sh $TAG"
$PY -m experiments.calibration.calibrate "$C16" "$C2" --name "cpu-1thread-2runs-$TAG" \
  --note "OMP_NUM_THREADS=1; scripts/simulator_rerun.sh $TAG (the two bursts only)"
log "validation"
$PY run.py +experiment=simulator_validation hardware="cpu-1thread-$TAG" hydra.sweep.dir="$OUT/simulator_validation-$TAG"
log "validation re-simulated on the two-burst calibration"
$PY -m experiments.calibration.validation "$OUT/simulator_validation-$TAG-resim-2runs" --real-from "$OUT/simulator_validation-$TAG" \
  --hardware "cpu-1thread-2runs-$TAG" > /dev/null
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
sed -n '/Median/,/prefix-hit/p' "$OUT/simulator_validation-$TAG/validation.md"
sed -n '/Median/,/prefix-hit/p' "$OUT/simulator_validation-$TAG-resim-2runs/validation.md"
