"""h3-spark: MiniMax H3 engine, CLI and ComfyUI custom-node pack.

ComfyUI imports this folder as a custom-node package and reads NODE_CLASS_MAPPINGS /
NODE_DISPLAY_NAME_MAPPINGS. Outside ComfyUI (pip install, CLI, tests) importing it must stay
cheap and must not need ComfyUI, so nothing here imports torch or comfy.
"""

__version__ = "0.1.0"

# The ComfyUI nodes arrive with the node pack (nodes/); until then the pack registers no node.
NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "__version__"]
