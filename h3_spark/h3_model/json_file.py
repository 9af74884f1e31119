"""Read one JSON object from a model folder (config.json, an index, a wrapper), with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import CheckpointError


def read_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data
