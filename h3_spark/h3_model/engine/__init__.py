"""The engine: one object under every front door.

paths.py finds each component in a model folder, loading.py builds one from its files, engine.py holds them
and runs the pipeline's stages, report.py says what is loaded and what can run, shared_dit.py lets several
callers share one DiT with their own LoRAs and attention, demo.py writes the tiny demo models.
"""
