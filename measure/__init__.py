"""Benchmark runner: contracts in benchmarks/, measured results in receipts/."""
