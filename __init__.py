"""h3-spark: MiniMax H3 engine, CLI and ComfyUI custom-node pack.

ComfyUI imports this folder as a custom-node package and reads NODE_CLASS_MAPPINGS /
NODE_DISPLAY_NAME_MAPPINGS. Outside ComfyUI (pip install, CLI, tests) importing it must stay
cheap and must not need ComfyUI, so nothing imported here imports torch or comfy: the node classes
only describe themselves and import the engine when they run.
"""

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__version__ = "0.1.0"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "__version__"]
