#!/usr/bin/env bash
# ComfyUI's H3 template set on one GPU machine: the resident warm render against the same render from cold in
# smaller boxes (receipts/h100/README.md, "Fourth lease"). Run as root from the repository root:
#     bash benchmarks/consumer_box_gpu.sh OUT_DIR [CAPS]        (CAPS: GPU gigabytes, default "24 16")
# The files are written once by our own make-checkpoint into $BOX (default /tmp/box, ~40 GB; kept when there).
# Each cold render: `sync; echo 3 > /proc/sys/vm/drop_caches`, then the process inside the cgroup v2 $CGROUP with
# memory.max $HOST_CAP (default 32G) and no swap, its GPU capped at process start (consumer_box_gpu.py --gpu-cap).
set -uo pipefail
out=${1:?usage: consumer_box_gpu.sh OUT_DIR [CAPS]}
caps=${2:-24 16}
box=${BOX:-/tmp/box}
cgroup=${CGROUP:-/sys/fs/cgroup/h3-box}
mkdir -p "$out" "$box"

write() {  # write FILE FLAGS...: make-checkpoint FILE unless it is there
    [ -s "$box/$1" ] || python3 -m h3_spark.cli make-checkpoint --preset full "${@:2}" "$box/$1" >> "$out/make.jsonl"
}
write dit.safetensors --component dit --layout comfy-pruned --format int8_convrot --device cuda || exit 1
write te.safetensors --component text_encoder --format nvfp4_awq --device cuda --tokenizer-out "$box/tok" || exit 1
write vae.safetensors --component vae --format int8_convrot || exit 1
write avae.safetensors --component audio_vae || exit 1

render=(--dit "$box/dit.safetensors" --text-encoder "$box/te.safetensors" --tokenizer "$box/tok"
        --vae "$box/vae.safetensors" --audio-vae "$box/avae.safetensors" --width 1344 --height 768 --frames 124
        --steps 20 --prompt "A red fox trots across a snowy meadow at dawn." --progress)
export H3_ATTENTION=${H3_ATTENTION:-fa3}

# SKIP_RESIDENT=1: the cold renders alone (a second call on a machine that measured the resident one already).
[ "${SKIP_RESIDENT:-0}" = 1 ] || python3 benchmarks/consumer_box_gpu.py --out "$out/resident.json" \
    --warmup-steps 2 -- "${render[@]}" --out "$box/resident.mp4" 2> "$out/resident.log"

mkdir -p "$cgroup"
echo +memory > "$(dirname "$cgroup")/cgroup.subtree_control" 2>/dev/null
echo "${HOST_CAP:-32G}" > "$cgroup/memory.max" && echo 0 > "$cgroup/memory.swap.max" || exit 1
# TAG names the cold receipts apart (cold-24$TAG.json): an A/B of an H3_* setting over two calls.
# IDLE=1: each cold render waits after its load for the text layers' page reader (H3_READ_THREADS > 0), as a
# service's first request does.
TAG=${TAG:-}
idle=(); [ "${IDLE:-0}" = 1 ] && idle=(--idle-until-read)
for cap in $caps; do
    sync && echo 3 > /proc/sys/vm/drop_caches
    # The subshell joins the cgroup, then becomes the benchmark: everything it maps and pins is counted there.
    (echo $BASHPID > "$cgroup/cgroup.procs" && exec python3 benchmarks/consumer_box_gpu.py --out "$out/cold-$cap$TAG.json" \
        --gpu-cap "$cap" "${idle[@]}" -- "${render[@]}" --vram-budget "$cap" --out "$box/cold-$cap.mp4") 2> "$out/cold-$cap$TAG.log"
    echo "cold $cap GB: rc $?; the cgroup's peak so far $(cat "$cgroup/memory.peak" 2>/dev/null) of $(cat "$cgroup/memory.max")"
done
