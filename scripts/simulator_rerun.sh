#!/usr/bin/env bash
# Re-measures everything the simulator's claims rest on, in one go, on a machine with nothing else
# running (docs/simulator.md): the calibration suite's runs of the real engine and their fit
# (results/reference/simulator_calibration/, conf/hardware/cpu-1thread.yaml), the held-out
# validation (results/reference/simulator_validation/: real engine vs simulator, three interleaved
# repeats) and the simulator's speed (results/reference/simulator_speed/: the 10,000-request
# benchmark and the 20-point concurrency sweep). One OpenMP thread, as calibrated. The commands are
# scripts/reference_runs.sh's; the suite's runs took 91 s (2026-12-04 13:25 UTC) and
# the validation 1 min 38 s (2026-11-30) on the 2-core AMD EPYC.
# Usage: scripts/simulator_rerun.sh. An existing folder or calibration file is kept and its step
# skipped, with a message; to re-measure, first remove the three folders and conf/hardware/cpu-1thread.yaml.
set -euo pipefail
exec "$(dirname "$0")/reference_runs.sh" simulator_calibration simulator_validation simulator_speed
