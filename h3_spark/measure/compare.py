"""Check a bench result against its contract's limits, fail closed."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import InputError
from .contract import Contract, check_limits, load_contract, measured

# The contracts live in the checkout (benchmarks/), not in the package: an installed wheel has none beside it.
CONTRACTS = Path(__file__).resolve().parents[2] / "benchmarks"
REQUIRED_FIELDS = ("contract", "sequence_length", "dit_forward_s_median", "backends", "stamp", "weights")
NUMBER_FIELDS = ("sequence_length", "dit_forward_s_median")
TEXT_FIELDS = ("contract", "weights")
STAMP_KEYS = ("time_utc", "software")  # what stamp.stamp_before always writes, GPU or not
Row = tuple[str, str, str, str]


def contract_for(result: dict, path: str | Path | None) -> Contract:
    if path is not None:
        return load_contract(path)
    name = result.get("contract")
    if not name:
        raise InputError("the result names no contract; pass --contract")
    if not isinstance(name, str):
        raise InputError(f"result field 'contract' must be a contract name, got {json.dumps(name)}")
    path = CONTRACTS / f"{name}.json"
    if not path.is_file():
        raise InputError(f"the result names contract {name!r}, which is not in {CONTRACTS} (the checkout's "
                         "benchmarks/ folder); pass its file with --contract")
    return load_contract(path)


def field_problem(field: str, value) -> str | None:
    """Why a present required field cannot vouch for the result, or None."""
    if field in NUMBER_FIELDS:
        measured({field: value}, field)  # raises: a malformed number is a broken file, not a slow run
        return None
    if field in TEXT_FIELDS:
        return None if isinstance(value, str) and value.strip() else f"not a non-empty string: {json.dumps(value)}"
    if field == "stamp":
        if isinstance(value, dict) and all(value.get(k) for k in STAMP_KEYS):
            return None
        return f"lacks {' and '.join(STAMP_KEYS)}"
    if field == "backends":
        return None if isinstance(value, dict) else f"not an object: {json.dumps(value)}"
    raise AssertionError(field)


def field_rows(result: dict) -> list[Row]:
    rows = []
    for field in REQUIRED_FIELDS:
        problem = "missing" if field not in result else field_problem(field, result[field])
        if problem is not None:
            rows.append((field, problem, "required", "FAIL"))
    return rows


def _honours(chosen, requested: str) -> bool:
    # A wrapper backend reports the one it wraps: `kj_head_sliced(fa3)` honours a request for kj_head_sliced.
    return chosen == requested or (isinstance(chosen, str) and chosen.startswith(f"{requested}("))


def attention_problems(asked, record: dict) -> list[str]:
    """`asked`: the settings' attention (None when they are missing); `record`: what apply_kernels says ran."""
    requested, chosen = record.get("requested"), record.get("chosen")
    problems = []
    if not isinstance(chosen, str) or not chosen:
        problems.append("attention: the record names no backend that ran")
    elif requested != "auto" and not _honours(chosen, requested):
        problems.append(f"attention: asked for {requested}, ran {chosen}")
    if asked is not None and requested != asked:
        problems.append(f"attention: settings ask for {asked}, the record says {requested} was requested")
    return problems


def settings_problems(settings: dict, backends: dict) -> list[str]:
    """Linear format and modulation fusion: what the settings asked for against what ran."""
    problems = []
    asked, record = settings.get("linear"), backends.get("linear")
    ran = record.get("format") if isinstance(record, dict) else None
    if not isinstance(asked, str):
        problems.append("settings: no record of the linear format asked for")
    elif ran is None or (asked != "auto" and ran != asked):
        problems.append(f"linear: asked for {asked}, ran {ran}")
    modulation = backends.get("modulation")
    impl = modulation.get("impl") if isinstance(modulation, dict) else None
    # `exact` means the fused kernels or an error (kernels/dispatch.py); anything else ran something else.
    if settings.get("modulation_fusion") == "exact" and impl != "triton":
        problems.append(f"modulation: asked for the fused kernels (exact), ran {impl}")
    return problems


def backend_mismatches(backends: dict) -> list[str]:
    """What ran but was not what was asked for (`auto` may choose; anything else must be honoured).

    Fails closed: a result without the settings (the request) or without an attention record (what ran)
    cannot show that the requested backends ran."""
    settings, record = backends.get("settings"), backends.get("attention")
    problems = []
    if not isinstance(settings, dict) or not isinstance(settings.get("attention"), str):
        problems.append("settings: no record of the attention backend asked for")
        settings = None
    if isinstance(record, dict):
        problems += attention_problems(settings["attention"] if settings else None, record)
    else:
        problems.append("attention: no record of the backend that ran")
    if settings is not None:
        problems += settings_problems(settings, backends)
    return problems


def limit_rows(result: dict, contract: Contract) -> list[Row]:
    rows = []
    for metric, verdict in check_limits(contract, result).items():
        value = verdict["value"]
        shown = "missing" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))
        limit = ", ".join(f"{k} {v}" for k, v in verdict["limit"].items())
        if verdict["ok"] is None:
            rows.append((metric, shown, limit, "FAIL (" + verdict.get("note", "not measured") + ")"))
        else:
            rows.append((metric, shown, limit, "ok" if verdict["ok"] else "FAIL"))
    return rows


def compare(result: dict, contract: Contract) -> tuple[list[Row], bool]:
    """Rows (metric, value, limit, verdict) and whether everything passed."""
    rows = field_rows(result)
    if result.get("contract") not in (None, contract["name"]):
        rows.append(("contract", str(result.get("contract")), contract["name"], "FAIL"))
    rows += limit_rows(result, contract)
    backends = result.get("backends")
    if isinstance(backends, dict):  # otherwise field_rows has already failed it
        rows += [("backend", problem, "as requested", "FAIL") for problem in backend_mismatches(backends)]
    return rows, bool(rows) and all(row[3] == "ok" for row in rows)


def render(rows: list[tuple[str, str, str, str]]) -> str:
    header = ("metric", "value", "limit", "verdict")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(tuple("-" * w for w in widths)), *(line(r) for r in rows)])
