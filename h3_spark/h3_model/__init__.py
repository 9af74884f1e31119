"""The MiniMax H3 engine in plain PyTorch: the engine object and its pipeline, DiT, VAEs, text encoder, media.

No ComfyUI import and no HTTP here; front doors (cli, nodes, serve, measure) call `engine.Engine` and its stages.
"""
