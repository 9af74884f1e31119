"""h3-spark: MiniMax H3 engine, CLI and ComfyUI custom-node pack.

ComfyUI imports this folder as a custom-node package and reads NODE_CLASS_MAPPINGS /
NODE_DISPLAY_NAME_MAPPINGS. Outside ComfyUI (pip install, CLI, tests) importing it must stay
cheap and must not need ComfyUI, so nothing imported here imports torch or comfy: the node classes
only describe themselves and import the engine when they run.
"""

__version__ = "0.1.0"

if __package__:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
else:
    # Executed as a lone file, not as a package (pytest sets up the repository root this way when the
    # checkout's folder name is not an identifier): there is no package to hold the nodes.
    NODE_CLASS_MAPPINGS: dict = {}
    NODE_DISPLAY_NAME_MAPPINGS: dict = {}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "__version__"]
