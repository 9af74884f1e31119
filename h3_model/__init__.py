"""The MiniMax H3 engine in plain PyTorch: layout, DiT, scheduler, VAEs, text encoder, pipeline.

No ComfyUI import and no HTTP here; front doors (cli, nodes, serve) call into this package.
"""
