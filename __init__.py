"""ComfyUI's entry to h3-spark: this checkout is a custom-node folder (custom_nodes/h3-spark).

ComfyUI imports this file as a package named after the folder's path and reads NODE_CLASS_MAPPINGS /
NODE_DISPLAY_NAME_MAPPINGS. The engine, kernels and nodes live in the `h3_spark` package beside this file; it
is imported as this folder's subpackage, so the pack runs its own files whether or not (and whichever version)
`h3_spark` is also pip-installed. Nothing imported here imports torch or ComfyUI.
"""

if __package__:
    from .h3_spark import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, __version__
else:
    # Executed as a lone file, not as a package (a tool that imports every __init__.py it meets, such as pytest
    # in some import modes): there is no package to hold the nodes.
    __version__ = None
    NODE_CLASS_MAPPINGS: dict = {}
    NODE_DISPLAY_NAME_MAPPINGS: dict = {}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "__version__"]
