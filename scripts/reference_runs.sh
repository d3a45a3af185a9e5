#!/usr/bin/env bash
# Re-creates results/reference/: one folder per experiment, under the experiment's name
# (results/reference/README.md lists each folder, what it shows, its command and how long it took).
# Real-engine experiments run on model=smollm2-135m (the SmolLM2-135M architecture, random
# weights, float32; length-controlled workloads with ignore_eos); online_serving, http_overhead and
# peer_benchmark run on the real model (smollm2-135m-instruct, its GGUF weights: llama.cpp serves
# the same file), and so do the load profiles rate_sweep and max_goodput (through serve.py), and head_to_head (serve.py against vLLM, measured by vllm bench serve); gpu_scale and gpu_scale_l4 run the simulator on datasheet GPU presets.
# simulator_calibration runs the calibration suite (conf/calibration/suite.yaml: seven short runs of the
# real engine) and fits conf/hardware/cpu-1thread.yaml on them; simulator_validation then checks that
# fit against the real engine, and simulator_speed times the simulator. Any other conf/experiment/ name runs as the first group does.
# Usage: scripts/reference_runs.sh [experiment ...]   (default: all, in the order below).
# An existing folder is kept and its experiment skipped, with a message: remove the folder first to
# rerun (nothing is overwritten silently). simulator_calibration also keeps an existing
# conf/hardware/cpu-1thread.yaml: remove both to refit.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=results/reference
CALIBRATION=cpu-1thread   # conf/hardware/<this>.yaml: written by simulator_calibration, used by simulator_validation
SUITE_RUNS=results/runs/calibration_suite-$CALIBRATION   # where the suite writes its runs (moved into the folder after the fit)
all=(naive_vs_continuous squeezed_pool prefix_sharing memory_pressure block_size_sweep decode_scaling
  concurrency_sweep shared_prefix_attention online_serving http_overhead peer_benchmark roofline
  simulator_calibration simulator_validation simulator_validation_regimes simulator_speed gpu_scale gpu_scale_l4 rate_sweep max_goodput head_to_head)
experiments=("$@")
[ ${#experiments[@]} -gt 0 ] || experiments=("${all[@]}")
mkdir -p "$OUT"

# sweep FOLDER EXPERIMENT [override ...]: one Hydra multirun of conf/experiment/EXPERIMENT.yaml into $OUT/FOLDER.
sweep() {
  local folder=$1 experiment=$2
  shift 2
  $PY run.py +experiment="$experiment" "$@" hydra.sweep.dir="$OUT/$folder" driver.progress=false
}

# The calibration suite (one OpenMP thread, set by the plan): decode batches of 1 to 32, long
# contexts, whole prompts, prefill chunks of two budgets, shared prefix-cache blocks and preemption,
# then the fit of all its runs into conf/hardware/$CALIBRATION.yaml; the runs move into the folder.
simulator_calibration() {
  [ ! -e "$SUITE_RUNS" ] || { echo "$SUITE_RUNS exists: remove it to rerun the calibration suite" >&2; exit 2; }
  $PY -m experiments.calibration.calibrate --suite --name "$CALIBRATION" --note "scripts/reference_runs.sh simulator_calibration"
  mv "$SUITE_RUNS" "$OUT/simulator_calibration"
}

# The simulator's speed: the 10,000-request H100 command and a 20-point concurrency sweep (1,000
# requests each), each timed by /usr/bin/time into the folder (benchmark_time.txt, sweep_time.txt).
simulator_speed() {
  local speed=$OUT/simulator_speed
  mkdir -p "$speed"
  /usr/bin/time -f "wall %e s, user %U s, sys %S s" -o "$speed/benchmark_time.txt" \
    $PY run.py engine=simulated hardware=h100 model=llama-3.1-8b workload=poisson workload.num_requests=10000 \
    workload.rate=100 driver.progress=false plots=false hydra.run.dir="$speed/poisson_10000"
  cat "$speed/benchmark_time.txt"
  /usr/bin/time -f "wall %e s, user %U s, sys %S s" -o "$speed/sweep_time.txt" \
    $PY run.py -m engine=simulated hardware=h100 model=llama-3.1-8b workload=poisson workload.num_requests=1000 \
    workload.rate=inf scheduler.max_num_seqs=1024 'driver.max_concurrency=range(16,336,16)' plots=false \
    driver.progress=false hydra.sweep.dir="$speed/sweep_20"
  cat "$speed/sweep_time.txt"
}

# One line per experiment run (appended, never overwritten); each summary.json also records its environment.
machine="$(nproc) CPU cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), no GPU, torch $($PY -c 'import torch; print(torch.__version__)')"
for name in "${experiments[@]}"; do
  if [ -e "$OUT/$name" ]; then echo "skip $name: $OUT/$name exists (remove it to rerun)"; continue; fi
  if [ "$name" = simulator_calibration ] && [ -e "conf/hardware/$CALIBRATION.yaml" ]; then
    echo "skip $name: conf/hardware/$CALIBRATION.yaml exists (remove it and $OUT/$name to refit)"; continue
  fi
  case $name in
    roofline | simulator_calibration | simulator_validation | simulator_speed | gpu_scale_l4 | rate_sweep | max_goodput | head_to_head) ;;
    *) [ -f "conf/experiment/$name.yaml" ] || { echo "unknown experiment '$name': not in conf/experiment/ nor one of: ${all[*]}" >&2; exit 2; } ;;
  esac
  echo "=== $name $(date -u +%T)"
  echo "$name: $(date -u '+%F %T') UTC, $machine, load average $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/MACHINE.txt"
  case $name in
    roofline) $PY -m experiments.bench.roofline --out "$OUT/roofline" ;;
    peer_benchmark | gpu_scale) sweep "$name" "$name" ;;
    online_serving) OMP_NUM_THREADS=1 sweep "$name" "$name" ;;
    http_overhead) OMP_NUM_THREADS=1 sweep "$name" "$name" plots=false ;;
    gpu_scale_l4)  # the decode-heavy trace on a 24 GB L4, where memory caps the batch
      sweep "$name" gpu_scale hardware=l4 gpu_trace=decode_heavy gpu_case=vllm_like,paged_reserve,contiguous \
        driver.max_concurrency=64,512 ;;
    simulator_calibration) simulator_calibration ;;
    simulator_validation) OMP_NUM_THREADS=1 sweep "$name" "$name" hardware="$CALIBRATION" ;;
    simulator_validation_regimes) OMP_NUM_THREADS=1 sweep "$name" "$name" ;;  # on cpu-1thread and cpu-1thread-one-burst
    simulator_speed) simulator_speed ;;
    rate_sweep)  # load profiles (docs/profiles.md) on the real model through serve.py
      OMP_NUM_THREADS=1 $PY run.py profile=rate_sweep profile.num_rates=4 engine=servelab_http workload=random \
        workload.input_len=32 workload.output_len=64 workload.num_prompts=32 driver.progress=false hydra.run.dir="$OUT/$name" ;;
    max_goodput)
      OMP_NUM_THREADS=1 $PY run.py profile=max_goodput engine=servelab_http workload=random workload.input_len=32 \
        workload.output_len=64 workload.num_prompts=32 slo.ttft_s=0.1 slo.tpot_s=0.015 driver.progress=false \
        hydra.run.dir="$OUT/$name" ;;
    head_to_head)  # serve.py with no flags vs vLLM's CPU build, both measured by `vllm bench serve`
      $PY -m experiments.http.head_to_head --concurrency 1 8 32 --temperature 0 1 --repeats 3 \
        --vllm-dtype bfloat16 float32 --out "$OUT/$name/random_128_64"
      $PY -m experiments.http.head_to_head --input-len 1024 --output-len 128 --concurrency 8 --temperature 0 \
        --repeats 3 --vllm-dtype bfloat16 --out "$OUT/$name/random_1024_128" ;;
    *) sweep "$name" "$name" model=smollm2-135m ;;
  esac
done
