#!/usr/bin/env bash
# Build the service image from ./Dockerfile on a machine without a GPU and check it end to end:
# `h3-spark serve --synthetic tiny --device cpu` in the container, the token required, /live, /ready,
# one T2VA job to `done` with its mp4 on the host, and the image's own HEALTHCHECK. docs/container.md
# says what this covers and what it does not (no GPU, no NVIDIA container toolkit).
#
#   sudo scripts/container_smoke.sh     # needs podman, curl, python3; debootstrap when the base is missing
#
# Environment (all optional):
#   BASE_IMAGE   base to build on (default: localhost/h3-debian-bookworm, debootstrapped here once)
#   CPU_WHEELS   folder with a CPU torch wheel for the base's Python (default /opt/wheels); without one,
#                torch comes from PyTorch's CPU index
#   TORCH_SPEC   default "torch==2.13.0 torchvision==0.28.0" (the README's pair)
#   IMAGE        tag to build (default localhost/h3-spark:smoke)
#   PORT         host port on 127.0.0.1 (default 18000)
#   KEEP=1       leave the container running and the image in place afterwards
set -euo pipefail
cd "$(dirname "$0")/.."

TOOL=podman  # image exists, container exists and healthcheck run are podman sub-commands
BASE_IMAGE=${BASE_IMAGE:-localhost/h3-debian-bookworm}
CPU_WHEELS=${CPU_WHEELS:-/opt/wheels}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0 torchvision==0.28.0}
IMAGE=${IMAGE:-localhost/h3-spark:smoke}
PORT=${PORT:-18000}
NAME=h3-spark-smoke-$$
say() { printf '[container_smoke] %s\n' "$*" >&2; }
die() { say "FAIL: $*"; exit 1; }

command -v "$TOOL" >/dev/null || die "$TOOL not found (apt-get install podman)"
command -v curl >/dev/null || die "curl not found"

# A base from Debian's own mirror, for machines that reach no image registry.
if ! "$TOOL" image exists "$BASE_IMAGE" 2>/dev/null; then
    [[ $BASE_IMAGE == localhost/h3-debian-bookworm ]] || die "base image $BASE_IMAGE is not here"
    command -v debootstrap >/dev/null || die "debootstrap not found (apt-get install debootstrap)"
    rootfs=$(mktemp -d)
    say "debootstrap bookworm into $rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
    # A network that re-signs TLS needs its CA inside too; the Dockerfile's ca-certificates install adds
    # these to the system bundle, and pip is told to use that bundle (its own certifi copy lacks them).
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        mkdir -p "$rootfs/usr/local/share/ca-certificates"
        cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
        printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$rootfs/etc/pip.conf"
    fi
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb
    tar -C "$rootfs" -c . | "$TOOL" import - "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
fi

# Sandboxed machines (a VM without CAP_SYS_RESOURCE, cgroup v1 with a v2 mount beside it) refuse podman's
# defaults: crun fails on the hybrid cgroups and both runtimes on raising RLIMIT_NPROC/NOFILE. Use runc
# and limits at or below the current ones only where the plain run fails.
RUNTIME=() LIMITS=()
if ! "$TOOL" run --rm "$BASE_IMAGE" true 2>/dev/null; then
    RUNTIME=(--runtime runc)
    LIMITS=(--ulimit "nofile=$(ulimit -n):$(ulimit -n)" --ulimit nproc=8192:8192)
    "$TOOL" "${RUNTIME[@]}" run --rm "${LIMITS[@]}" "$BASE_IMAGE" true \
        || die "$TOOL cannot run a container here even with runc and lowered limits"
    say "using runc and ${LIMITS[*]} (the defaults are refused here)"
fi

TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple"
MOUNTS=()
if compgen -G "$CPU_WHEELS/torch-*+cpu-*.whl" >/dev/null; then
    TORCH_PIP_ARGS="--find-links /cpu-wheels"
    MOUNTS=(-v "$(realpath "$CPU_WHEELS")":/cpu-wheels:ro)
fi

say "building $IMAGE on $BASE_IMAGE (torch: $TORCH_PIP_ARGS)"
t0=$(date +%s)
# --format docker: the OCI image format has no HEALTHCHECK, and the check below runs it.
"$TOOL" "${RUNTIME[@]}" build --format docker "${LIMITS[@]}" "${MOUNTS[@]}" \
    --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg TORCH_SPEC="$TORCH_SPEC" \
    --build-arg TORCH_PIP_ARGS="$TORCH_PIP_ARGS" -t "$IMAGE" -f Dockerfile . >&2
t1=$(date +%s)
size=$("$TOOL" image inspect "$IMAGE" --format '{{.Size}}')
say "built in $((t1 - t0)) s; image size $((size / 1000000)) MB"

work=$(mktemp -d)
cleanup() {
    if [[ ${KEEP:-0} != 1 ]]; then
        "$TOOL" rm -f "$NAME" >/dev/null 2>&1 || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/out"
python3 -c 'import secrets; print(secrets.token_urlsafe(32))' >"$work/token"
# The image runs as uid 10001: it must own what it writes and read its token, as on a real host.
chown 10001:10001 "$work/out" "$work/token"
chmod 0400 "$work/token"
TOKEN=$(cat "$work/token")

"$TOOL" "${RUNTIME[@]}" run -d --name "$NAME" "${LIMITS[@]}" -p "127.0.0.1:$PORT:8000" \
    -v "$work/token:/run/secrets/h3_api_key:ro" -v "$work/out:/out" "$IMAGE" \
    --synthetic tiny --synthetic-modes t2va --device cpu --output-dir /out \
    --api-key-file /run/secrets/h3_api_key >/dev/null
t2=$(date +%s)
url=http://127.0.0.1:$PORT
auth=(-H "Authorization: Bearer $TOKEN")
logs() { "$TOOL" logs "$NAME" 2>&1 | tail -n 30 >&2; }

for _ in $(seq 120); do
    curl -fs "${auth[@]}" "$url/live" >/dev/null && break
    "$TOOL" container exists "$NAME" && [[ $("$TOOL" inspect "$NAME" --format '{{.State.Running}}') == true ]] \
        || { logs; die "the container stopped"; }
    sleep 1
done
code=$(curl -s -o /dev/null -w '%{http_code}' "$url/live")
[[ $code == 401 ]] || { logs; die "/live without the token answered $code, not 401"; }
say "/live: 200 with the token, 401 without ($(($(date +%s) - t2)) s after start)"

for _ in $(seq 300); do
    [[ $(curl -s -o /dev/null -w '%{http_code}' "${auth[@]}" "$url/ready") == 200 ]] && break
    sleep 1
done
[[ $(curl -s -o /dev/null -w '%{http_code}' "${auth[@]}" "$url/ready") == 200 ]] || { logs; die "/ready never 200"; }
say "/ready: 200 ($(($(date +%s) - t2)) s after start)"

t3=$(date +%s)
job=$(curl -fs "${auth[@]}" -H 'content-type: application/json' "$url/generate" -d '{"mode": "t2va",
      "prompt": "A cat plays the piano.", "output": "smoke.mp4", "width": 64, "height": 64, "frames": 124,
      "steps": 3, "seed": 1}') || { logs; die "POST /generate failed"; }
id=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["id"])' "$job")
state=queued
for _ in $(seq 600); do
    state=$(curl -fs "${auth[@]}" "$url/jobs/$id" | python3 -c 'import json, sys; print(json.load(sys.stdin)["state"])')
    [[ $state == queued || $state == running ]] || break
    sleep 1
done
[[ $state == done ]] || { curl -s "${auth[@]}" "$url/jobs/$id" >&2; logs; die "job $id ended $state"; }
[[ -s $work/out/smoke.mp4 ]] || die "job done but $work/out/smoke.mp4 is missing"
say "job $id: done in $(($(date +%s) - t3)) s; smoke.mp4 $(stat -c %s "$work/out/smoke.mp4") bytes, owner $(stat -c %u "$work/out/smoke.mp4")"

"$TOOL" "${RUNTIME[@]}" healthcheck run "$NAME" >/dev/null || { logs; die "the image's HEALTHCHECK failed"; }
say "HEALTHCHECK: healthy"
say "OK"
