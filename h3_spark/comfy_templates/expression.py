"""The arithmetic of ComfyUI's Math Expression node, evaluated without `eval`: the expression is parsed by
Python's own parser and only numbers, the node's input names, arithmetic, comparisons and a short list of
functions are walked. Anything else (attributes, subscripts, strings, lambdas, names it was not given) is
refused, so a template cannot run code through it."""

from __future__ import annotations

import ast
import math
import operator

from ..errors import InputError

# The functions the node offers that a duration or frame formula uses (its own list is longer: trigonometry
# and logarithms are left out until a template needs them).
FUNCTIONS = {"min": min, "max": max, "abs": abs, "round": round, "int": int, "float": float, "floor": math.floor,
             "ceil": math.ceil, "sqrt": math.sqrt}
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}
COMPARE = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
           ast.Eq: operator.eq, ast.NotEq: operator.ne}
MAX_EXPONENT = 64  # a formula for frames or pixels never needs more; a huge power would hang the converter


def evaluate(expression: str, names: dict[str, float]) -> float | int | bool:
    """The value of `expression` with `names` bound (a, b, ...), or InputError naming what is not allowed."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise InputError(f"math expression {expression!r} does not parse: {exc.msg}") from None
    return _walk(tree.body, names, expression)


def _walk(node, names, text):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, bool):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise InputError(f"math expression {text!r} uses {node.id!r}, which is not one of its inputs "
                             f"({', '.join(sorted(names)) or 'none connected'})")
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _walk(node.left, names, text), _walk(node.right, names, text)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise InputError(f"math expression {text!r}: exponent {right} is above {MAX_EXPONENT}")
        try:
            return BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise InputError(f"math expression {text!r} divides by zero") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_walk(node.operand, names, text))
    if isinstance(node, ast.Compare) and all(type(op) in COMPARE for op in node.ops):
        left = _walk(node.left, names, text)
        for op, comparator in zip(node.ops, node.comparators):
            right = _walk(comparator, names, text)
            if not COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BoolOp):
        values = [_walk(v, names, text) for v in node.values]
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.IfExp):
        return _walk(node.body if _walk(node.test, names, text) else node.orelse, names, text)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS
            and not node.keywords):
        return FUNCTIONS[node.func.id](*(_walk(a, names, text) for a in node.args))
    raise InputError(f"math expression {text!r}: {ast.unparse(node)!r} is not plain arithmetic "
                     f"(numbers, its inputs, + - * / // % **, comparisons, {', '.join(FUNCTIONS)})")


def outputs(expression: str, names: dict[str, float]) -> tuple[float, int, bool]:
    """The node's three outputs (FLOAT, INT, BOOLEAN) for one evaluation; the INT truncates as int() does."""
    result = evaluate(expression, names)
    if isinstance(result, bool) or not isinstance(result, (int, float)):
        raise InputError(f"math expression {expression!r} gives {result!r}, not a number")
    if not math.isfinite(result):
        raise InputError(f"math expression {expression!r} gives {result}, not a finite number")
    return float(result), int(result), bool(result)
