"""benchmarking."""
