"""The engine: one object that resolves, loads and holds the components and runs the pipeline's stages."""
