#!/usr/bin/env bash
# The package as a user who installs the wheel gets it: built from this checkout, installed without extras into
# a fresh venv that has no Triton (as on Windows and macOS, or a CPU-only Linux box), then used from outside
# the checkout: `h3-spark generate --demo` end to end and the files the package reads at run time. CI runs it.
#
#   scripts/wheel_smoke.sh            # needs python3 with venv; torch comes from pip's configured indexes
#
# Environment (optional):
#   TORCH_SPEC   default "torch==2.13.0 torchvision==0.28.0" (the README's pair)
#   PYTHON       the Python to build with and to make the venv from (default python3)
#   KEEP=1       leave the work folder (wheel, venv, demo.mp4) in place and print its path
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0 torchvision==0.28.0}
PYTHON=${PYTHON:-python3}
say() { printf '[wheel_smoke] %s\n' "$*" >&2; }
die() { say "FAIL: $*"; exit 1; }

work="$(mktemp -d "${TMPDIR:-/tmp}/h3-wheel-smoke.XXXXXX")"
if [[ "${KEEP:-0}" == 1 ]]; then
    trap 'say "left in $work"' EXIT
else
    trap 'rm -rf "$work"' EXIT
fi

say "building the wheel"
"$PYTHON" -m venv "$work/build-venv"
"$work/build-venv/bin/python" -m pip install -q --upgrade pip build >/dev/null
"$work/build-venv/bin/python" -m build -q --wheel --outdir "$work/dist" . >/dev/null
wheels=("$work"/dist/h3_spark-*.whl)
[[ ${#wheels[@]} == 1 && -f "${wheels[0]}" ]] || die "expected one h3_spark wheel in $work/dist"
wheel="${wheels[0]}"

# Only the package goes in: a top-level name beside h3_spark/ would land in every user's site-packages.
"$work/build-venv/bin/python" - "$wheel" <<'EOF' || die "the wheel's contents are wrong (above)"
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
assert tops == {"h3_spark"}, f"top-level entries besides h3_spark: {sorted(tops - {'h3_spark'})}"
for needed in ("h3_spark/measure/quality_budget.json", "h3_spark/cli/__main__.py", "h3_spark/nodes/__init__.py"):
    assert needed in names, f"{needed} is not in the wheel"
print(f"[wheel_smoke] {len(names)} files, top level: h3_spark", file=sys.stderr)
EOF

say "installing it without extras into a fresh venv"
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --upgrade pip >/dev/null
# shellcheck disable=SC2086 # TORCH_SPEC is a list of requirements
"$work/venv/bin/python" -m pip install -q $TORCH_SPEC
"$work/venv/bin/python" -m pip install -q "$wheel"

cd "$work"  # nothing of the checkout on the path from here on
if "$work/venv/bin/python" -c "import triton" 2>/dev/null; then
    die "Triton is installed in the venv; this check is for an install without it"
fi
say "h3-spark generate --demo (no Triton)"
"$work/venv/bin/h3-spark" generate --demo --out "$work/demo.mp4" >"$work/summary.json"
"$work/venv/bin/python" - "$work" <<'EOF' || die "the demo or the package's files (above)"
import json, pathlib, sys
work = pathlib.Path(sys.argv[1])
summary = json.loads((work / "summary.json").read_text().strip().splitlines()[-1])
assert summary["exact"] is True and (work / "demo.mp4").stat().st_size > 0, summary
import h3_spark
from h3_spark.measure.budget import quality_budget
assert str(work / "venv") in h3_spark.__file__, h3_spark.__file__
assert 0 < quality_budget()["final_velocity_rel_l2"] < 1
print(f"[wheel_smoke] demo.mp4 {(work / 'demo.mp4').stat().st_size} bytes, attention {summary['attention']}, "
      f"from {pathlib.Path(h3_spark.__file__).parent}", file=sys.stderr)
EOF
say "OK"
