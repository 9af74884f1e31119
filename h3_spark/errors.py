"""User-facing errors: the front doors print these as one line, without a traceback.

Every H3Error class is named as a module of `h3_spark`, however the pack was imported: ComfyUI imports it under
its folder's path (`/.../custom_nodes/h3-spark`) and reports an exception's type as module + name, so `/history`
and the page would otherwise show `/.../custom_nodes/h3-spark.errors.InputError`.
"""

PACKAGE = "h3_spark"
_IMPORTED_AS = __name__.rpartition(".")[0]  # the name this copy of the pack was imported under ("" as a lone file)


def _named(module: str) -> str:
    if _IMPORTED_AS and _IMPORTED_AS != PACKAGE and module.startswith(_IMPORTED_AS + "."):
        return f"{PACKAGE}.{module[len(_IMPORTED_AS) + 1:]}"
    return module


class H3Error(Exception):
    """A problem the user can fix (bad input, bad file, unsupported request)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__module__ = _named(cls.__module__)


H3Error.__module__ = _named(H3Error.__module__)


class CheckpointError(H3Error):
    """A checkpoint file or folder cannot be read as what was asked for."""


class InputError(H3Error):
    """A request, tensor file or argument does not fit the model."""
