"""ComfyUI nodes for MiniMax H3 on the h3-spark engine (V1 node API, one flat pack).

`definitions` holds the node classes and the two mappings ComfyUI reads; `engine` does the work
(imported when a node runs), `payload` converts the graph's data to the engine's layouts, `host`
is everything taken from ComfyUI. Importing this package imports neither torch nor ComfyUI.
"""

from .definitions import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
