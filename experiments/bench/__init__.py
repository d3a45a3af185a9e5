"""Micro-benchmarks and stress runs: the roofline probe, kernel and step timings, HTTP overhead, the soak."""
