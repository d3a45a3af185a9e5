"""What a run leaves behind: result files (crash-safe), per-run plots and the multirun report."""
