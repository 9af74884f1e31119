"""Check a bench result against its contract's limits, fail closed."""

from __future__ import annotations

from pathlib import Path

from ..h3_model.errors import InputError
from .contract import Contract, check_limits, load_contract

ROOT = Path(__file__).resolve().parents[1]
REQUIRED_FIELDS = ("contract", "sequence_length", "dit_forward_s_median", "backends", "stamp", "weights")


def contract_for(result: dict, path: str | Path | None) -> Contract:
    if path is not None:
        return load_contract(path)
    name = result.get("contract")
    if not name:
        raise InputError("the result names no contract; pass --contract")
    return load_contract(ROOT / "benchmarks" / f"{name}.json")


def backend_mismatches(backends: dict) -> list[str]:
    """What ran but was not what was asked for (`auto` may choose; anything else must be honoured)."""
    if "settings" not in backends:  # the first receipts' plain form carries no request
        return []
    problems = []
    attention = backends.get("attention", {})
    requested, chosen = attention.get("requested"), attention.get("chosen")
    if requested not in (None, "auto") and chosen != requested and not str(chosen).startswith(f"{requested}("):
        problems.append(f"attention: asked for {requested}, ran {chosen}")
    asked_linear = backends["settings"].get("linear")
    ran_linear = backends.get("linear", {}).get("format")
    if asked_linear not in (None, "auto") and ran_linear != asked_linear:
        problems.append(f"linear: asked for {asked_linear}, ran {ran_linear}")
    return problems


def compare(result: dict, contract: Contract) -> tuple[list[tuple[str, str, str, str]], bool]:
    """Rows (metric, value, limit, verdict) and whether everything passed."""
    rows: list[tuple[str, str, str, str]] = []
    ok = True
    for field in REQUIRED_FIELDS:
        if field not in result:
            rows.append((field, "missing", "required", "FAIL"))
            ok = False
    if result.get("contract") not in (None, contract["name"]):
        rows.append(("contract", str(result.get("contract")), contract["name"], "FAIL"))
        ok = False
    for metric, verdict in check_limits(contract, result).items():
        value = verdict["value"]
        shown = "missing" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))
        limit = ", ".join(f"{k} {v}" for k, v in verdict["limit"].items())
        if verdict["ok"] is None:
            rows.append((metric, shown, limit, "FAIL (" + verdict.get("note", "not measured") + ")"))
            ok = False
        else:
            rows.append((metric, shown, limit, "ok" if verdict["ok"] else "FAIL"))
            ok &= verdict["ok"]
    for problem in backend_mismatches(result.get("backends", {})):
        rows.append(("backend", problem, "as requested", "FAIL"))
        ok = False
    return rows, ok


def render(rows: list[tuple[str, str, str, str]]) -> str:
    header = ("metric", "value", "limit", "verdict")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(tuple("-" * w for w in widths)), *(line(r) for r in rows)])
