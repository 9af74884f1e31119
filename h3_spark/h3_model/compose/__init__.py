"""Composition beyond one generation: windows past 15 s, shots, and continuing a clip."""
