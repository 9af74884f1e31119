"""`h3-spark compare`: a bench result against its contract's limits (exit 1 when anything is missed)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub, name: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help="check a bench result against its contract (non-zero exit on a miss)",
                       description="Print a table of a bench result against its contract's limits. Exits 1 when a "
                                   "limit is missed, a required field is missing or empty, or the backend records "
                                   "(settings and what ran) do not show that the requested backends ran; exits 2 "
                                   "on a malformed result or contract (a number that is not one, an unknown limit "
                                   "rule).")
    p.add_argument("--result", required=True, type=Path, help="JSON written by `h3-spark bench`")
    p.add_argument("--contract", type=Path, default=None,
                   help="contract file (default: benchmarks/<the result's contract>.json)")
    return p


def run(args) -> int:
    from ..errors import InputError
    from ..measure.compare import compare, contract_for, render

    if not args.result.is_file():
        raise InputError(f"{args.result}: no such result file")
    try:
        result = json.loads(args.result.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{args.result}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(result, dict):
        raise InputError(f"{args.result}: expected a JSON object")
    rows, ok = compare(result, contract_for(result, args.contract))
    print(render(rows))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1
