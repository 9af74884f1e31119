"""The benchmark runner (`h3-spark bench`, `compare`): measures the contracts in benchmarks/, stamps receipts/."""
