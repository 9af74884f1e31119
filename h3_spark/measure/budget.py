"""The error budgets a fast path must meet against the exact path, read by `bench --vs exact` and `calibrate`.

The file ships inside the package (beside this module), so an installed wheel reads the same budgets as a checkout.
"""

from __future__ import annotations

import json
from pathlib import Path

BUDGET_FILE = Path(__file__).resolve().with_name("quality_budget.json")


def quality_budget() -> dict:
    return json.loads(BUDGET_FILE.read_text())
