"""The simulator's calibration: fitting the cost model to real runs, replay, and validation."""
