"""The run itself: one job, the driver that feeds an engine in real time, workloads, records and metrics."""
