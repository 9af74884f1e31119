#!/usr/bin/env bash
# Install h3-spark into a ComfyUI checkout as the custom-node pack custom_nodes/h3-spark.
#
#   scripts/install_comfyui_overlay.sh [--dry-run] [--uninstall] [--copy] [--python PATH] /path/to/ComfyUI
#
# What it does, in order (re-running is safe: finished steps are reported and skipped):
#   1. checks ComfyUI: comfyui_version.py; reports whether it has native MiniMax H3 support
#      (comfy/ldm/minimax/model.py), which only graphs mixing native and h3-spark nodes need;
#   2. checks ComfyUI's Python: >= 3.10, torch importable (never installed or upgraded here: ComfyUI's
#      torch build is the user's choice), and reports the GPU and its sm capability (H3 runs bf16: sm_80+);
#   3. links (or, with --copy, copies) this repository to custom_nodes/h3-spark;
#   4. pip-installs the runtime dependencies into that Python (never torch: it is pinned to the installed build;
#      a transformers 4 that must become 5 is warned about, since other node packs share it).
# --dry-run runs the read-only checks and prints every action without changing anything.
# --uninstall removes custom_nodes/h3-spark when it is ours (our link, or a copy carrying our marker);
# shared Python packages stay, since other nodes may use them.
# ComfyUI's own files are never edited: the only path written is custom_nodes/h3-spark.
set -euo pipefail

readonly NODE_DIR_NAME="h3-spark"
readonly MARKER=".h3-spark-overlay"
# Runtime needs of the node pack besides torch: checkpoints, media I/O (PyAV), image resizing, Qwen3-VL.
# transformers 5: the text encoder uses its Qwen3-VL classes and config layout (rope_parameters), as
# pyproject.toml does; accelerate: transformers needs it for the device_map that loads a Qwen3-VL folder
# straight onto its device (without it the Text Encoder Loader fails on a diffusers/transformers folder).
# The floors are pyproject.toml's; requirements.txt holds them (the list ComfyUI-Manager installs too).
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly REPO_ROOT
mapfile -t RUNTIME_DEPS < <(sed -e 's/#.*//' -e 's/[[:space:]]*$//' "$REPO_ROOT/requirements.txt" | grep -v '^$')
readonly RUNTIME_DEPS

dry_run=0
uninstall=0
copy=0
python=""
comfy=""

die() {
    echo "error: $*" >&2
    exit 1
}

say() {
    echo "h3-spark: $*"
}

# Run a command that changes something, or only print it under --dry-run.
act() {
    if ((dry_run)); then
        echo "[dry-run] $*"
    else
        echo "+ $*"
        "$@"
    fi
}

usage() {
    sed -n '2,4p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

while (($#)); do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --uninstall) uninstall=1 ;;
        --copy) copy=1 ;;
        --python)
            (($# >= 2)) || die "--python needs a path"
            python="$2"
            shift
            ;;
        --python=*) python="${1#--python=}" ;;
        -h | --help)
            usage
            exit 0
            ;;
        -*) die "unknown option $1 (see --help)" ;;
        *)
            [[ -z "$comfy" ]] || die "one ComfyUI path only (got '$comfy' and '$1')"
            comfy="$1"
            ;;
    esac
    shift
done

[[ -n "$comfy" ]] || {
    usage >&2
    die "give the path of the ComfyUI checkout"
}
[[ -d "$comfy" ]] || die "$comfy: no such folder"
comfy="$(cd "$comfy" && pwd)"
target="$comfy/custom_nodes/$NODE_DIR_NAME"

# True when custom_nodes/h3-spark is something this script made: a link to this repository, or a copy
# that carries our marker. Anything else there is the user's and is never touched.
is_ours() {
    if [[ -L "$target" ]]; then
        [[ "$(cd "$target" && pwd -P)" == "$(cd "$REPO_ROOT" && pwd -P)" ]]
    else
        [[ -f "$target/$MARKER" ]]
    fi
}

if ((uninstall)); then
    if [[ ! -e "$target" && ! -L "$target" ]]; then
        say "nothing to remove: $target does not exist"
        exit 0
    fi
    is_ours || die "$target is not an h3-spark overlay made by this script (no link to $REPO_ROOT, no $MARKER); \
remove it by hand if you mean to"
    if [[ -L "$target" ]]; then
        act rm "$target"
    else
        act rm -rf "$target"
    fi
    say "removed $target (Python packages stay installed: other nodes may use them)"
    exit 0
fi

# ---------------------------------------------------------------------------------------------- ComfyUI
[[ -f "$comfy/comfyui_version.py" && -d "$comfy/custom_nodes" ]] \
    || die "$comfy is not a ComfyUI checkout (no comfyui_version.py or custom_nodes/)"
version="$(sed -n 's/^__version__ *= *["'\'']\([^"'\'']*\)["'\''].*/\1/p' "$comfy/comfyui_version.py" | head -n 1)"
[[ -n "$version" ]] || die "$comfy/comfyui_version.py has no __version__"
say "ComfyUI $version at $comfy"
# The h3-spark nodes run on their own engine and need only ComfyUI's node API, folder_paths and model
# management (ComfyUI 0.3.64, October 2025, runs them); the native MiniMax H3 nodes matter only for graphs
# that mix the two, so their absence is reported, not refused.
if [[ -f "$comfy/comfy/ldm/minimax/model.py" ]]; then
    say "native MiniMax H3 support found (comfy/ldm/minimax/): h3-spark and native H3 nodes can be mixed"
else
    say "warning: ComfyUI $version has no native MiniMax H3 support (comfy/ldm/minimax/model.py, added by \
Comfy-Org/ComfyUI PR #15224): the h3-spark nodes work, but graphs mixing them with native MiniMax H3 nodes need \
a newer ComfyUI"
fi

# ---------------------------------------------------------------------------------------------- Python
if [[ -z "$python" ]]; then
    for candidate in "$comfy/venv/bin/python" "$comfy/.venv/bin/python" "$comfy/../python_embeded/python.exe" \
        "$comfy/python_embeded/python.exe" "$comfy/venv/Scripts/python.exe" "$comfy/.venv/Scripts/python.exe"; do
        if [[ -x "$candidate" ]]; then
            python="$candidate"
            break
        fi
    done
fi
# An activated environment, or the python on PATH, is taken when it imports ComfyUI's own requirements (so a
# system Python that merely exists is not mistaken for ComfyUI's).
runs_comfyui() {
    "$1" -c "import torch, aiohttp, yaml, einops, torchsde, safetensors" >/dev/null 2>&1
}
if [[ -z "$python" ]]; then
    for candidate in "${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}" "$(command -v python3 || true)" \
        "$(command -v python || true)"; do
        if [[ -n "$candidate" && -x "$candidate" ]] && runs_comfyui "$candidate"; then
            python="$candidate"
            say "using $python (it imports ComfyUI's requirements)"
            break
        fi
    done
fi
[[ -n "$python" ]] || die "cannot find ComfyUI's Python (looked for venv/, .venv/, python_embeded/, \$VIRTUAL_ENV \
and a python on PATH that imports ComfyUI's requirements); pass --python /path/to/python"
[[ -x "$python" ]] || die "$python: not an executable Python"

probe="$("$python" - <<'PY'
import sys
print("python=%d.%d.%d" % sys.version_info[:3])
try:
    from importlib.metadata import version
    print("transformers=%s" % version("transformers"))
except Exception:  # not installed
    print("transformers=")
try:
    import torch
except Exception as exc:  # a broken torch install fails here too
    print("torch=")
    print("torch_error=%s" % (str(exc).splitlines() or [type(exc).__name__])[0])
else:
    print("torch=%s" % torch.__version__)
    try:  # pip's version of it, which can lack the local "+cu130" part that torch.__version__ shows
        print("torch_dist=%s" % version("torch"))
    except Exception:
        print("torch_dist=")
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        print("gpu=%s" % torch.cuda.get_device_name(0))
        print("sm=%d.%d" % (major, minor))
    else:
        print("gpu=")
        print("sm=")
PY
)" || die "$python does not run"

field() {
    sed -n "s/^$1=//p" <<<"$probe" | head -n 1
}

py_version="$(field python)"
[[ -n "$py_version" ]] || die "$python did not report its version"
IFS=. read -r py_major py_minor _ <<<"$py_version"
if ((py_major < 3 || (py_major == 3 && py_minor < 10))); then
    die "ComfyUI's Python is $py_version; h3-spark needs Python >= 3.10"
fi
say "Python $py_version ($python)"

torch_version="$(field torch)"
[[ -n "$torch_version" ]] || die "torch is not importable in $python ($(field torch_error)); install ComfyUI's \
requirements (with the torch build for your GPU) first: h3-spark never installs torch"
say "torch $torch_version"

transformers_version="$(field transformers)"
if [[ "$transformers_version" =~ ^([0-9]+)\. ]] && ((BASH_REMATCH[1] < 5)); then
    say "warning: transformers $transformers_version will be upgraded to >= 5 (the Qwen3-VL text encoder needs it); \
it is shared with ComfyUI and other custom nodes, and a node pack pinned to transformers 4 may stop working"
fi

sm="$(field sm)"
if [[ -z "$sm" ]]; then
    say "no CUDA GPU visible to torch: the nodes will run on the CPU (tiny models only)"
else
    IFS=. read -r sm_major sm_minor <<<"$sm"
    say "GPU $(field gpu), sm_${sm_major}${sm_minor}"
    ((sm_major >= 8)) || die "sm_${sm_major}${sm_minor} has no bf16 tensor cores; H3 runs in bf16 and needs \
sm_80 or newer (Ampere, Ada, Hopper, Blackwell)"
fi

# ---------------------------------------------------------------------------------------------- install
if [[ -e "$target" || -L "$target" ]]; then
    is_ours || die "$target exists and is not an h3-spark overlay made by this script; move it away first"
    # A link that already points here stays; a copy is made afresh (the tree may have changed), and
    # switching between link and copy replaces the old one.
    if ((copy)) && [[ -L "$target" ]]; then
        act rm "$target"
    elif [[ ! -L "$target" ]]; then
        act rm -rf "$target"
    fi
fi

if ((copy)); then
    act mkdir -p "$target"
    # The ComfyUI entry, the installer and the whole package folder (its nodes import the engine, kernels
    # and errors beside them); no tests, benchmarks or receipts.
    act cp -R "$REPO_ROOT/__init__.py" "$REPO_ROOT/pyproject.toml" "$REPO_ROOT/requirements.txt" \
        "$REPO_ROOT/install.py" "$REPO_ROOT/h3_spark" "$target/"
    for extra in config workflows; do
        if [[ -d "$REPO_ROOT/$extra" ]]; then
            act cp -R "$REPO_ROOT/$extra" "$target/"
        fi
    done
    act touch "$target/$MARKER"
    say "copied to $target"
elif [[ -L "$target" ]]; then
    say "already linked: $target -> $REPO_ROOT"
else
    act ln -s "$REPO_ROOT" "$target"
    say "linked $target -> $REPO_ROOT"
fi

# torch stays the build ComfyUI installed, even if a dependency would like another one.
constraints="$(mktemp "${TMPDIR:-/tmp}/h3-spark-constraints.XXXXXX")"
trap 'rm -f "$constraints"' EXIT
torch_dist="$(field torch_dist)"
echo "torch==${torch_dist:-$torch_version}" >"$constraints"
act "$python" -m pip install --upgrade-strategy only-if-needed --constraint "$constraints" "${RUNTIME_DEPS[@]}"
say "done; restart ComfyUI. Recommended launch flags and engine defaults: config/h3_spark_serving.env"
