"""h3-spark: the MiniMax H3 engine, its kernels, CLI, service, benchmark runner and ComfyUI nodes.

Importing the package stays cheap and needs neither torch nor ComfyUI: the node classes only describe
themselves and import the engine when they run. Every module below imports its siblings relatively, so the
package works under any name it is given (ComfyUI imports the checkout's root under the custom-node folder's
path, and this package as its subpackage).
"""

__version__ = "0.1.0"

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402 - after the version

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "__version__"]
