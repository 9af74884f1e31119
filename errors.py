"""User-facing errors: the front doors print these as one line, without a traceback.

Each class names `h3_spark.errors` as its module however this file was imported: ComfyUI imports the pack
under its folder's path (`/.../custom_nodes/h3-spark`), and reports an exception's type as module + name, so
without it `/history` and the page would show `/.../custom_nodes/h3-spark.errors.InputError`.
"""

MODULE = "h3_spark.errors"


class H3Error(Exception):
    """A problem the user can fix (bad input, bad file, unsupported request)."""

    __module__ = MODULE


class CheckpointError(H3Error):
    """A checkpoint file or folder cannot be read as what was asked for."""

    __module__ = MODULE


class InputError(H3Error):
    """A request, tensor file or argument does not fit the model."""

    __module__ = MODULE
