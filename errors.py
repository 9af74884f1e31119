"""User-facing errors: the front doors print these as one line, without a traceback."""


class H3Error(Exception):
    """A problem the user can fix (bad input, bad file, unsupported request)."""


class CheckpointError(H3Error):
    """A checkpoint file or folder cannot be read as what was asked for."""


class InputError(H3Error):
    """A request, tensor file or argument does not fit the model."""
