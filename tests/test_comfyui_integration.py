"""The node pack inside a real ComfyUI: headless server on 127.0.0.1 with --cpu, API workflows over HTTP.

Opt-in: set COMFYUI_DIR (a ComfyUI checkout, e.g. 0.3.64) and COMFYUI_PYTHON (the Python of the venv
ComfyUI runs in); docs/comfyui.md "Integration tests" has the setup. The pack goes in through our own
installer (scripts/install_comfyui_overlay.sh, which links custom_nodes/h3-spark; the link is removed
afterwards when this test made it). Everything else the server writes or reads lives in a temporary folder:
models (the tiny synthetic demo set, through --extra-model-paths-config), input, output, temp, user
and an in-memory database, so the checkout is left as it was.

The shipped workflows/api/*.json are posted to /prompt with only the file names, the canvas (64x64, 124
frames), the steps (2) and the demo text encoder's layer (2) changed. Completion is followed on
/history/{prompt_id}, and on the websocket through a listener run by ComfyUI's own Python (aiohttp is a
ComfyUI requirement; this test's venv has no websocket client). Bad graphs must come back as ComfyUI node
errors with our message, and the server must still answer afterwards.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
import wave
from pathlib import Path

import pytest

COMFY_DIR = os.environ.get("COMFYUI_DIR")
COMFY_PYTHON = os.environ.get("COMFYUI_PYTHON")
if not (COMFY_DIR and COMFY_PYTHON):
    pytest.skip("set COMFYUI_DIR (a ComfyUI checkout) and COMFYUI_PYTHON (its venv's python) to run the ComfyUI "
                "integration tests", allow_module_level=True)

requests = pytest.importorskip("requests")

ROOT = Path(__file__).resolve().parents[1]
INSTALLER = ROOT / "scripts" / "install_comfyui_overlay.sh"
WORKFLOWS = ROOT / "workflows"
START_TIMEOUT = 300  # ComfyUI imports torch, its nodes and ours, on a 2-core machine
RUN_TIMEOUT = 900
SIZE, FRAMES, STEPS = 64, 124, 2
# Names the graphs use, as they appear in ComfyUI's model lists (folders end with "/").
REF2VA_DIT, T2VA_DIT = "h3-demo-ref2va/", "h3-demo-t2va/"
TEXT_ENCODER, VIDEO_VAE, AUDIO_VAE = "h3-demo-qwen3vl/", "h3-demo-video-vae/", "h3-demo-audio-vae/"
BROKEN_DIT = "h3-demo-broken-ref2va/"

# Follows one client's websocket messages into a JSON-lines file until its prompt ends (or a deadline).
# Run by ComfyUI's Python, which always has aiohttp; argv: url, out file, seconds.
WS_LISTENER = r"""
import asyncio, json, sys, aiohttp

async def main(url, out, seconds):
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(url, heartbeat=30) as ws:
            with open(out, "w") as f:
                print("connected", flush=True)
                loop = asyncio.get_running_loop()
                end = loop.time() + seconds
                prompt = None
                while loop.time() < end:
                    try:
                        msg = await ws.receive(timeout=max(0.1, end - loop.time()))
                    except asyncio.TimeoutError:
                        break
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        if msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                            break
                        continue  # binary previews
                    f.write(msg.data + "\n")
                    f.flush()
                    data = json.loads(msg.data)
                    kind, body = data.get("type"), data.get("data") or {}
                    if kind == "execution_start":
                        prompt = body.get("prompt_id")
                    if prompt and body.get("prompt_id") == prompt and (
                            kind in ("execution_error", "execution_interrupted")
                            or (kind == "executing" and body.get("node") is None)):
                        break

asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ fixtures
def build_models(tmp: Path) -> Path:
    """The tiny demo set copied into the model folders our loaders list (copies, not links: the loaders
    refuse a folder that resolves outside its model folder)."""
    from h3_spark.cli import main as h3_spark

    models = tmp / "models"
    models.mkdir()
    # The user's demo command: the tiny set under the names the loaders list (and the demo workflow names).
    assert h3_spark(["comfyui-demo", str(models), "--quiet"]) == 0

    # A listed model whose weights are gone: the config is there (so ComfyUI offers it), the safetensors not.
    broken = models / "diffusion_models" / BROKEN_DIT.rstrip("/")
    broken.mkdir()
    shutil.copy(models / "diffusion_models" / REF2VA_DIT.rstrip("/") / "config.json", broken / "config.json")
    (tmp / "extra_model_paths.yaml").write_text(
        "h3_spark_integration:\n"
        f"  base_path: {models}\n"
        "  diffusion_models: diffusion_models\n"
        "  text_encoders: text_encoders\n"
        "  vae: vae\n")
    return models


def write_inputs(folder: Path) -> None:
    """The reference image and song the ref2va workflow loads, and the fl2va keyframes (LoadImage / LoadAudio)."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    y, x = np.mgrid[0:SIZE, 0:SIZE]
    pixels = np.stack([x * 4, y * 4, (x + y) * 2], axis=-1).clip(0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(folder / "singer.png")
    for i in range(1, 5):  # the Comfy-Org multiframe template's reference and guide pictures, converted
        Image.fromarray(np.roll(pixels, 8 * i, axis=1)).save(folder / f"h3_frame_ref_{i}.png")
    Image.fromarray(pixels).save(folder / "first_frame.png")
    Image.fromarray(pixels[::-1].copy()).save(folder / "last_frame.png")
    rate = 32000
    t = np.arange(rate * 2) / rate
    tone = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype(np.int16)
    with wave.open(str(folder / "song.wav"), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.repeat(tone[:, None], 2, axis=1).tobytes())


class Server:
    def __init__(self, url: str, process: subprocess.Popen, log: Path, output: Path, frame_size: int):
        self.url, self.process, self.log, self.output = url, process, log, output
        self.frame_size = frame_size

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def alive(self) -> bool:
        try:
            return self.process.poll() is None and requests.get(f"{self.url}/system_stats", timeout=10).ok
        except requests.RequestException:
            return False


@pytest.fixture(scope="module")
def installed():
    """Our installer puts the pack into the checkout; removed afterwards only if this test linked it."""
    target = Path(COMFY_DIR) / "custom_nodes" / "h3-spark"
    existed = target.exists() or target.is_symlink()
    out = subprocess.run(["bash", str(INSTALLER), "--python", COMFY_PYTHON, COMFY_DIR], capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, f"installer failed:\n{out.stdout}\n{out.stderr}"
    yield out.stdout
    if not existed:
        subprocess.run(["bash", str(INSTALLER), "--uninstall", COMFY_DIR], capture_output=True, text=True)


@pytest.fixture(scope="module")
def server(installed, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("comfyui")
    build_models(tmp)
    write_inputs(tmp / "input")
    for sub in ("output", "temp", "user"):
        (tmp / sub).mkdir()
    port = free_port()
    log = tmp / "comfyui.log"
    cmd = [COMFY_PYTHON, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), "--disable-auto-launch",
           "--preview-method", "auto",
           "--extra-model-paths-config", str(tmp / "extra_model_paths.yaml"),
           "--input-directory", str(tmp / "input"), "--output-directory", str(tmp / "output"),
           "--temp-directory", str(tmp / "temp"), "--user-directory", str(tmp / "user"),
           "--database-url", "sqlite:///:memory:"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as sink:
        # Its own process group, so the teardown ends ComfyUI and anything it started, and nothing else.
        process = subprocess.Popen(cmd, cwd=COMFY_DIR, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    # The engine's latent grid is the released 16x (64 px -> 4 latents); the demo's tiny video VAE upsamples
    # by its own factor (4x), so the saved frames are smaller than the canvas.
    vae = json.loads((tmp / "models" / "vae" / VIDEO_VAE.rstrip("/") / "config.json").read_text())
    factor = 1
    for f in vae["spatial_downsample_factors"]:
        factor *= f
    srv = Server(f"http://127.0.0.1:{port}", process, log, tmp / "output", SIZE // 16 * factor)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not srv.alive():
            if process.poll() is not None:
                pytest.fail(f"ComfyUI exited with {process.returncode} while starting:\n{srv.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"ComfyUI did not answer /system_stats within {START_TIMEOUT} s:\n{srv.log_tail()}")
            time.sleep(1)
        info = requests.get(f"{srv.url}/object_info/H3SparkSampler", timeout=30).json()
        assert "H3SparkSampler" in info, f"ComfyUI did not load the h3-spark nodes:\n{srv.log_tail(120)}"
        yield srv
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)


# ------------------------------------------------------------------------------------------ helpers
def workflow(name: str) -> dict:
    """A shipped API workflow with the demo models, a tiny canvas and few steps."""
    graph = json.loads((WORKFLOWS / "api" / f"h3-spark-{name}.json").read_text())
    for node in graph.values():
        inputs, kind = node["inputs"], node["class_type"]
        if kind == "H3SparkModelLoader":
            inputs.update(dit_name=REF2VA_DIT if name == "ref2va" else T2VA_DIT,
                          partition="ref2va" if name == "ref2va" else "t2va/fl2va", weight_dtype="float32")
        elif kind == "H3SparkTextEncoderLoader":
            inputs.update(text_encoder_name=TEXT_ENCODER, tokenizer="(inside the text encoder folder)",
                          dtype="float32", layer=2)  # h3_model.demo.TEXT_READ_LAYER
        elif kind == "H3SparkVAELoader":
            inputs.update(vae_name=VIDEO_VAE, audio_vae_name=AUDIO_VAE, decode_dtype="float32", tile_size=0)
        elif kind in ("H3SparkTextToVideo", "H3SparkReferenceToVideo", "H3SparkFirstLastFrameToVideo"):
            inputs.update(width=SIZE, height=SIZE, length=FRAMES)
        elif kind == "H3SparkSampler":
            inputs.update(steps=STEPS)
    return graph


def node_of(graph: dict, class_type: str) -> str:
    return next(key for key, node in graph.items() if node["class_type"] == class_type)


def listen(srv: Server, client_id: str, out: Path) -> subprocess.Popen:
    url = srv.url.replace("http://", "ws://") + f"/ws?clientId={client_id}"
    listener = subprocess.Popen([COMFY_PYTHON, "-c", WS_LISTENER, url, str(out), str(RUN_TIMEOUT)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    # Connected before the prompt goes in, so no message is missed.
    line = listener.stdout.readline()
    assert line.strip() == "connected", f"websocket listener failed: {line}{listener.stderr.read()}"
    return listener


def post(srv: Server, graph: dict, client_id: str) -> requests.Response:
    return requests.post(f"{srv.url}/prompt", json={"prompt": graph, "client_id": client_id}, timeout=60)


def wait_history(srv: Server, prompt_id: str) -> dict:
    """The prompt's /history entry once ComfyUI has finished it (success or error)."""
    deadline = time.monotonic() + RUN_TIMEOUT
    while time.monotonic() < deadline:
        entry = requests.get(f"{srv.url}/history/{prompt_id}", timeout=30).json().get(prompt_id)
        if entry and entry.get("status", {}).get("completed") is not None and (
                entry["status"].get("completed") or entry["status"].get("status_str") == "error"):
            return entry
        assert srv.process.poll() is None, f"ComfyUI died running {prompt_id}:\n{srv.log_tail()}"
        time.sleep(1)
    pytest.fail(f"{prompt_id} did not finish within {RUN_TIMEOUT} s:\n{srv.log_tail()}")


def messages(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.exists() else []


def run_graph(srv: Server, graph: dict, tmp_path: Path) -> tuple[dict, list[dict]]:
    client_id = uuid.uuid4().hex
    ws_file = tmp_path / "ws.jsonl"
    listener = listen(srv, client_id, ws_file)
    try:
        reply = post(srv, graph, client_id)
        assert reply.status_code == 200, f"/prompt refused the graph: {reply.text}"
        body = reply.json()
        assert body["node_errors"] == {}, body
        entry = wait_history(srv, body["prompt_id"])
        listener.wait(timeout=60)
    finally:
        if listener.poll() is None:
            os.killpg(listener.pid, signal.SIGTERM)
            listener.wait(timeout=10)
    return entry, [m for m in messages(ws_file) if (m.get("data") or {}).get("prompt_id") in (None, body["prompt_id"])]


def execution_error(entry: dict) -> dict:
    errors = [data for event, data in entry["status"]["messages"] if event == "execution_error"]
    assert entry["status"]["status_str"] == "error" and errors, entry["status"]
    return errors[0]


# ------------------------------------------------------------------------------------------ tests
def test_installer_took_this_comfyui(installed):
    assert "linked" in installed or "already linked" in installed


@pytest.mark.parametrize("name", ["ref2va", "t2va", "fl2va"])
def test_api_workflow_writes_the_mp4(server, name, tmp_path):
    graph = workflow(name)
    started = time.monotonic()
    entry, ws = run_graph(server, graph, tmp_path)
    elapsed = time.monotonic() - started
    assert entry["status"]["status_str"] == "success", f"{entry['status']}\n{server.log_tail()}"

    save = node_of(graph, "H3SparkSaveVideo")
    saved = entry["outputs"][save]["images"]
    assert len(saved) == 1 and saved[0]["type"] == "output" and saved[0]["filename"].endswith(".mp4"), saved
    path = server.output / saved[0]["subfolder"] / saved[0]["filename"]
    assert path.is_file(), path

    from h3_spark.h3_model.media.files import probe

    info = probe(path)
    side = server.frame_size
    assert (info["video_codec"], info["width"], info["height"], info["frames"]) == ("h264", side, side, FRAMES), info
    assert info["fps"] == pytest.approx(24.0)
    assert info["audio_codec"] == "aac" and info["channels"] == 2 and info["sample_rate"] == 32000, info
    assert info["audio_duration"] == pytest.approx(FRAMES / 24, abs=0.1), info

    # The websocket saw the run: our sampler's progress bar (STEPS + 1 grid points) and the save node's output.
    sampler = node_of(graph, "H3SparkSampler")
    kinds = [m["type"] for m in ws]
    assert "execution_start" in kinds and "execution_success" in kinds, kinds
    progress = [m["data"] for m in ws if m["type"] == "progress" and m["data"].get("node") == sampler]
    assert progress and progress[-1]["value"] == progress[-1]["max"], progress
    executed = [m["data"] for m in ws if m["type"] == "executed" and m["data"].get("node") == save]
    assert executed and executed[0]["output"]["images"] == saved, executed
    print(f"{name}: {elapsed:.1f} s on ComfyUI at {server.url}, {path.name}: {info}")


def converted_template(name: str) -> dict:
    """A Comfy-Org template as `h3-spark convert-workflow --api` made it (workflows/api/templates/), on the demo
    models: file names, the tiny canvas, few steps, and `auto` attention where the template asks for
    comfy-kitchen's INT8 kernel (a GPU kernel; this server runs on the CPU). Every other setting is the
    template's: seed, sampler, scheduler, shifts, guides and their frames, references, prompt, length of a T2I."""
    graph = json.loads((WORKFLOWS / "api" / "templates" / f"{name}.json").read_text())
    ref2va = any(node["class_type"] == "H3SparkReferenceToVideo" for node in graph.values())
    for node in graph.values():
        inputs, kind = node["inputs"], node["class_type"]
        if kind == "H3SparkModelLoader":
            inputs.update(dit_name=REF2VA_DIT if ref2va else T2VA_DIT,
                          partition="ref2va" if ref2va else "t2va/fl2va", weight_dtype="float32")
        elif kind == "H3SparkTextEncoderLoader":
            inputs.update(text_encoder_name=TEXT_ENCODER, tokenizer="(inside the text encoder folder)",
                          dtype="float32", layer=2)
        elif kind == "H3SparkVAELoader":
            inputs.update(vae_name=VIDEO_VAE, audio_vae_name=AUDIO_VAE, decode_dtype="float32", tile_size=0)
        elif kind in ("H3SparkTextToVideo", "H3SparkReferenceToVideo", "H3SparkFirstLastFrameToVideo"):
            inputs.update(width=SIZE, height=SIZE)
            if inputs["length"] != 1:  # a T2I keeps its one frame
                inputs.update(length=FRAMES)
        elif kind == "H3SparkSampler":
            inputs.update(steps=STEPS)
        elif kind == "H3SparkAttentionPatch":
            inputs.update(backend="auto")
    return graph


@pytest.mark.parametrize("name", ["video_minimax_h3_t2v", "video_minimax_h3_multiframe_reference"])
def test_a_converted_comfy_org_video_template_writes_the_mp4(server, name, tmp_path):
    graph = converted_template(name)
    sampler = graph[node_of(graph, "H3SparkSampler")]["inputs"]
    assert (sampler["sampler_name"], sampler["scheduler"]) == ("res_multistep", "simple")
    if name.endswith("multiframe_reference"):
        guides = [n["inputs"]["frame_idx"] for n in graph.values() if n["class_type"] == "H3SparkAddGuide"]
        assert guides == [36, 72, 120]
    entry, _ = run_graph(server, graph, tmp_path)
    assert entry["status"]["status_str"] == "success", f"{entry['status']}\n{server.log_tail()}"
    saved = entry["outputs"][node_of(graph, "H3SparkSaveVideo")]["images"]
    path = server.output / saved[0]["subfolder"] / saved[0]["filename"]
    assert saved[0]["subfolder"] == "video" and path.name.startswith("MiniMax_H3"), saved

    from h3_spark.h3_model.media.files import probe

    info = probe(path)
    side = server.frame_size
    assert (info["width"], info["height"], info["frames"], info["channels"]) == (side, side, FRAMES, 2), info


def test_a_converted_comfy_org_text_to_image_template_saves_one_picture(server, tmp_path):
    from PIL import Image

    graph = converted_template("image_minimax_h3_t2i")
    assert graph[node_of(graph, "H3SparkTextToVideo")]["inputs"]["length"] == 1
    entry, _ = run_graph(server, graph, tmp_path)
    assert entry["status"]["status_str"] == "success", f"{entry['status']}\n{server.log_tail()}"
    saved = entry["outputs"][node_of(graph, "SaveImage")]["images"]
    assert len(saved) == 1 and saved[0]["filename"].startswith("image_minimax_h3_t2i"), saved
    with Image.open(server.output / saved[0]["subfolder"] / saved[0]["filename"]) as image:
        assert image.size == (server.frame_size, server.frame_size)


def test_the_demo_workflow_runs_as_shipped(server, tmp_path):
    """workflows/api/h3-spark-demo-t2va.json, unchanged, on the folders `h3-spark comfyui-demo` wrote."""
    graph = json.loads((WORKFLOWS / "api" / "h3-spark-demo-t2va.json").read_text())
    entry, _ = run_graph(server, graph, tmp_path)
    assert entry["status"]["status_str"] == "success", entry["status"]
    files = list(server.output.rglob("demo_*.mp4"))
    assert len(files) == 1 and files[0].parent.name == "h3-spark", f"{files}: {entry['outputs']}"


def test_a_value_not_on_disk_is_refused_by_prompt_validation(server):
    graph = workflow("ref2va")
    loader = node_of(graph, "H3SparkModelLoader")
    graph[loader]["inputs"]["dit_name"] = "no-such-h3-model.safetensors"
    reply = post(server, graph, uuid.uuid4().hex)
    assert reply.status_code == 400, reply.text
    body = reply.json()
    errors = body["node_errors"][loader]["errors"]
    assert any("dit_name" in e["details"] and "no-such-h3-model.safetensors" in e["details"] for e in errors), body
    assert server.alive()


def test_a_listed_model_missing_its_weights_is_a_node_error(server, tmp_path):
    graph = workflow("ref2va")
    loader = node_of(graph, "H3SparkModelLoader")
    graph[loader]["inputs"]["dit_name"] = BROKEN_DIT
    entry, _ = run_graph(server, graph, tmp_path)
    error = execution_error(entry)
    assert error["node_id"] == loader and error["node_type"] == "H3SparkModelLoader", error
    assert BROKEN_DIT.rstrip("/") in error["exception_message"], error
    assert server.alive()


def test_too_many_references_is_a_node_error(server, tmp_path):
    graph = workflow("ref2va")
    refs = node_of(graph, "H3SparkReferenceToVideo")
    image = graph[refs]["inputs"]["image_1"]
    # Five images: the node has image_1..image_4. ComfyUI passes a linked input the node does not declare.
    graph[refs]["inputs"].update({f"image_{i}": copy.deepcopy(image) for i in range(2, 6)})
    entry, _ = run_graph(server, graph, tmp_path)
    error = execution_error(entry)
    assert error["node_id"] == refs and error["node_type"] == "H3SparkReferenceToVideo", error
    assert "too many references" in error["exception_message"] and "image_5" in error["exception_message"], error
    # Named as the package, not as the path ComfyUI imported the pack under (".../custom_nodes/h3-spark.errors").
    assert error["exception_type"] == "h3_spark.errors.InputError", error
    assert server.alive()


def test_each_vae_slot_preselects_its_own_kind(server):
    """A fresh H3 VAE Loader shows the first name of each list: the video VAE first in vae_name, the audio VAE
    first in audio_vae_name (models/vae holds both, and both lists name every file there)."""
    info = requests.get(f"{server.url}/object_info/H3SparkVAELoader", timeout=30).json()["H3SparkVAELoader"]
    required = info["input"]["required"]
    assert required["vae_name"][0][0] == VIDEO_VAE and required["audio_vae_name"][0][0] == AUDIO_VAE, required
    assert sorted(required["vae_name"][0]) == sorted(required["audio_vae_name"][0])


def test_the_log_names_our_models_and_the_device(server):
    """Run after the graphs above: ComfyUI's "Requested to load <class>" names which of our models it loads, and
    our placement lines the device (--cpu here), not a GPU."""
    log = server.log.read_text(errors="replace")
    assert "Requested to load H3SparkDiT" in log and "Requested to load H3SparkTextEncoder" in log, server.log_tail()
    assert "Requested to load H3SparkVideoVAE" in log and "Requested to load H3SparkAudioVAE" in log
    assert "Requested to load Held" not in log
    assert "on cpu" in log and "on the GPU" not in log


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))


# ------------------------------------------------------------------------------------------ partial loading
# Run by ComfyUI's Python with ComfyUI's own model management (CPU here): the DiT our loader gives ComfyUI is
# loaded fully, partially unloaded (blocks start streaming), unloaded, partially loaded again, and unloaded by
# ComfyUI's unload_all_models; every forward in between equals the first bit for bit. Then the text encoder:
# resident, then streamed (partially loaded with only its minimum), the same embeddings.
PARTIAL_LOAD = r"""
import json, sys
from pathlib import Path
comfy_dir, pack_parent, dit_dir, text_dir = sys.argv[1:5]
sys.path[:0] = [comfy_dir, pack_parent]
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import torch
import comfy.model_management as mm
from h3_spark.nodes import engine as nodes_engine
from h3_spark.h3_model.dit import layout
from h3_spark.h3_model.engine.placement import Placement
from h3_spark.h3_model.pipeline.scheduler import CONDITION_VIDEO_T

patcher = nodes_engine.load_model(Path(dit_dir), "t2va/fl2va", "float32", "bf16", "sdpa")
dit = patcher.model.inner
c = dit.config
tags = torch.ones(9, dtype=torch.long)
tags[1:5] = 0
lay = layout.build_t2va(tags, 5, 2, 2, 10, c.patch_size)
gen = torch.Generator().manual_seed(4)
ts, idx = lay.row_timesteps(0.4, 0.7, CONDITION_VIDEO_T)
inputs = dict(hidden_states=torch.randn(1, lay.video_indices.numel(), c.video_patch_dim, generator=gen),
              audio_hidden_states=torch.randn(1, lay.audio_indices.numel(), c.audio_in_channels, generator=gen),
              encoder_hidden_states=torch.randn(1, lay.num_text, c.text_dim, generator=gen),
              token_tags=lay.token_tags, position_ids=lay.position_ids.float(), video_indices=lay.video_indices,
              audio_indices=lay.audio_indices, text_indices=lay.text_indices, timestep=ts, timestep_indices=idx)

def forward():
    with torch.no_grad():
        return [t.clone() for t in dit(**inputs)]

report = {"patcher": type(patcher).__name__}
mm.load_models_gpu([patcher])
want = forward()
size = patcher.model_size()
report["full"] = patcher.loaded_size() == size and dit.block_stream is None
freed = patcher.partially_unload(patcher.offload_device, size // 2)
report["unloaded_half"] = freed >= size // 2 and dit.block_stream is not None and patcher.loaded_size() <= size - freed
report["streamed_equal"] = all(torch.equal(a, b) for a, b in zip(forward(), want))
patcher.detach()
report["detached"] = patcher.loaded_size() == 0 and Placement.of(dit).device is None
added = patcher.partially_load(patcher.load_device, extra_memory=Placement.of(dit).minimum() + size // 3)
plan = Placement.of(dit).plan
report["partial"] = added > 0 and plan.streaming and 0 < plan.resident_blocks < len(plan.blocks)
report["partial_equal"] = all(torch.equal(a, b) for a, b in zip(forward(), want))
mm.load_models_gpu([patcher])  # ComfyUI's own call again: loads it fully, the memory is there
report["reloaded"] = patcher.loaded_size() == patcher.model_size() and dit.block_stream is None
report["reloaded_equal"] = all(torch.equal(a, b) for a, b in zip(forward(), want))
mm.unload_all_models()
report["unloaded_all"] = patcher.loaded_size() == 0

# The text encoder: resident, then its decoder layers streamed through its own patcher; the same embeddings.
from h3_spark.h3_model.engine.placement import TextPlacement
handle = nodes_engine.load_text_encoder(Path(text_dir), None, "float32", 2)
text = handle.patcher
report["text_patcher"] = type(text).__name__
prompt = "A lighthouse keeper hums while waves break on the rocks below."
want_text = handle.ready().encode(prompt).embeds.clone()
placement = TextPlacement.of(handle.encoder)
placement.depth = 1  # the demo keeps two decoder layers: one streams while one waits
handle.encoder.clear_cache()
text.detach()
added = text.partially_load(text.load_device, extra_memory=placement.minimum())
report["text_streamed"] = added > 0 and handle.encoder.layer_stream is not None
report["text_equal"] = torch.equal(handle.encoder.encode(prompt).embeds, want_text)
mm.unload_all_models()
report["text_unloaded"] = text.loaded_size() == 0
print("REPORT " + json.dumps(report))
"""


def test_comfyui_loads_the_dit_and_text_encoder_partially_through_our_patchers(installed, tmp_path):
    """ComfyUI's own load / partial unload / detach / partial load calls move our DiT between resident and
    streamed placements with no change to its forward; the text encoder streams its layers the same way."""
    import dataclasses

    from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint
    from h3_spark.h3_model.engine.demo import DIT_CONFIG, write_text_encoder

    dit_dir = tmp_path / "transformer"  # the demo DiT with six blocks: room for resident and streamed ones
    make_dit_checkpoint(dit_dir, dataclasses.replace(DIT_CONFIG, num_layers=6), "bf16", "diffusers", seed=3)
    text_dir = write_text_encoder(tmp_path / "text_encoder", seed=5)
    pack_parent = tmp_path / "pack"
    pack_parent.mkdir()
    (pack_parent / "h3_spark").symlink_to(ROOT / "h3_spark")
    script = tmp_path / "partial_load.py"
    script.write_text(PARTIAL_LOAD)
    out = subprocess.run([COMFY_PYTHON, str(script), COMFY_DIR, str(pack_parent), str(dit_dir), str(text_dir)],
                         cwd=COMFY_DIR, capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("REPORT ")]
    assert out.returncode == 0 and lines, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    report = json.loads(lines[-1][len("REPORT "):])
    assert report == {"patcher": "H3DiTPatcher", "full": True, "unloaded_half": True, "streamed_equal": True,
                      "detached": True, "partial": True, "partial_equal": True, "reloaded": True,
                      "reloaded_equal": True, "unloaded_all": True, "text_patcher": "H3TextPatcher",
                      "text_streamed": True, "text_equal": True, "text_unloaded": True}, report


def test_the_template_browser_lists_the_ui_workflows_with_thumbnails(server):
    """ComfyUI lists custom_nodes/*/workflows/*.json as templates: only our UI graphs (the API ones live in
    workflows/api/, which it does not read, and could not open), each with its .jpg thumbnail."""
    listed = requests.get(f"{server.url}/workflow_templates", timeout=30).json()
    ui = sorted(p.stem for p in WORKFLOWS.glob("*.json"))
    assert sorted(listed.get("h3-spark", [])) == ui
    for name in ui:
        graph = requests.get(f"{server.url}/api/workflow_templates/h3-spark/{name}.json", timeout=30)
        assert graph.status_code == 200 and "version" in graph.json() and graph.json()["nodes"]
        thumb = requests.get(f"{server.url}/api/workflow_templates/h3-spark/{name}.jpg", timeout=30)
        assert thumb.status_code == 200 and thumb.content[:3] == b"\xff\xd8\xff", name


# ------------------------------------------------------------------------------------------ the VAEs' loads
# Run by ComfyUI's Python with ComfyUI's own model management, on its GPU when it has one (else --cpu): a stand-in
# for the DiT (plain layers under ComfyUI's own ModelPatcher) is loaded, then H3 Decode runs. The video VAE's load
# must declare the decode's working memory and come before the audio VAE's; on a GPU, with the rest held outside
# ComfyUI so that room must come from the stand-in, ComfyUI partially unloads it. Then the stand-in's next load
# sends the VAEs back whole, unload_all_models does too, and (GPU) a decode without room for one tile is refused
# in one line with the VAE left where it was.
VAE_LOAD = r"""
import json, sys
from pathlib import Path
comfy_dir, pack_parent, video_vae, audio_vae, frames, height, width, tile = sys.argv[1:9]
sys.path[:0] = [comfy_dir, pack_parent]
import torch
gpu = torch.cuda.is_available()
sys.argv = [sys.argv[0]] + ([] if gpu else ["--cpu"])
from h3_spark.h3_model.text.torchvision_compat import ensure_importable
ensure_importable()  # PyPI's torchvision beside a CPU-only torch, as tests/conftest.py does
import comfy.options
comfy.options.enable_args_parsing()
import comfy.model_management as mm
from comfy.model_patcher import ModelPatcher
from h3_spark.errors import InputError
from h3_spark.nodes import engine, payload, vae as vaes

MB = 2 ** 20
handle = engine.load_vaes(Path(video_vae), Path(audio_vae), "float16" if gpu else "float32", int(tile))
g = torch.Generator().manual_seed(0)
z = torch.randn(1, handle.video.config.latent_channels, int(frames), int(height), int(width), generator=g)
latent = payload.pack_latent(z, payload.audio_to_comfy(torch.randn(2, handle.audio.config.latent_channels, 40,
                                                                    generator=g)))
device = mm.get_torch_device()
stand_in = ModelPatcher(torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(16)]), load_device=device,
                        offload_device=mm.unet_offload_device())
mm.load_models_gpu([stand_in])
calls, load_models_gpu = [], mm.load_models_gpu

def recorded(models, memory_required=0, **kwargs):
    calls.append([[getattr(m.model, "kind", "stand-in") for m in models], memory_required,
                  kwargs.get("minimum_memory_required")])
    return load_models_gpu(models, memory_required=memory_required, **kwargs)

mm.load_models_gpu = recorded
work = vaes.decode_work(handle.video, z.shape, handle.tile_size, handle.tile_batch)
margin = int(mm.minimum_inference_memory() - mm.extra_reserved_memory())
video = handle.video_patcher
hold = None
if gpu:  # 256 MB short of what ComfyUI frees for the VAE: its weights, the decode's memory and the reserve
    mm.soft_empty_cache()
    asked = video.model_size() * 1.1 + work.wanted + margin + mm.extra_reserved_memory()
    hold = torch.empty(int(mm.get_free_memory(device) - asked) + 256 * MB, dtype=torch.uint8, device=device)
before = stand_in.loaded_size()
images, audio = engine.decode(handle, latent)
report = {"gpu": gpu, "patcher": type(video).__name__, "frames": list(images.shape),
          "declared": calls[0] == [["vae"], work.wanted + margin, work.least + margin],
          "audio_after": [c[0] for c in calls] == [["vae"], ["audio_vae"]],
          "loaded": video.loaded_size() == video.model_size() and video in mm.loaded_models(),
          "made_room": 0 < stand_in.loaded_size() < before if gpu else None}
del hold
if gpu:  # the DiT's next load asks for all that is free
    mm.soft_empty_cache()
    mm.load_models_gpu([stand_in], memory_required=int(mm.get_free_memory(device)))
    report["pushed_out"] = video.loaded_size() == 0 and handle.video.device.type == "cpu"
engine.decode(handle, latent)
mm.unload_all_models()
report["unloaded_all"] = (video.loaded_size() == handle.audio_patcher.loaded_size() == 0
                          and video not in mm.loaded_models())
if gpu:  # 64 MB short of the weights, one tile's memory and the reserve, with nothing left to unload
    mm.soft_empty_cache()
    short = video.model_size() + work.least + int(mm.minimum_inference_memory()) - 64 * MB
    hold = torch.empty(int(mm.get_free_memory(device) - short), dtype=torch.uint8, device=device)
    try:
        engine.decode(handle, latent)
        report["refused"] = None
    except InputError as exc:
        report["refused"] = str(exc)
    report["stayed_off"] = handle.video.device.type == "cpu"
print("REPORT " + json.dumps(report))
"""


def test_comfyui_loads_the_vaes_with_their_working_memory_and_takes_them_back(installed, tmp_path):
    from h3_spark.h3_model.engine.demo import DEMO_VAE
    from h3_spark.h3_model.vae.synthetic import write_audio_vae_checkpoint, write_vae_checkpoint

    video = write_vae_checkpoint(tmp_path / "vae", DEMO_VAE, "diffusers", seed=1)
    audio = write_audio_vae_checkpoint(tmp_path / "audio_vae", "tiny", "diffusers", seed=2)
    pack_parent = tmp_path / "pack"
    pack_parent.mkdir()
    (pack_parent / "h3_spark").symlink_to(ROOT / "h3_spark")
    script = tmp_path / "vae_load.py"
    script.write_text(VAE_LOAD)
    # 256 x 256 px in 128 px tiles (nine a window), 22 frames.
    out = subprocess.run([COMFY_PYTHON, str(script), COMFY_DIR, str(pack_parent), str(video), str(audio), "7", "16",
                          "16", "128"], cwd=COMFY_DIR, capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("REPORT ")]
    assert out.returncode == 0 and lines, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    report = json.loads(lines[-1][len("REPORT "):])
    gpu = report.pop("gpu")
    want = {"patcher": "H3VAEPatcher", "frames": [22, 256, 256, 3], "declared": True, "audio_after": True,
            "loaded": True, "made_room": True if gpu else None, "unloaded_all": True}
    if gpu:
        refused = report.pop("refused")
        assert refused and "\n" not in refused and refused.startswith("the H3 video VAE decode needs "), refused
        want.update(pushed_out=True, stayed_off=True)
    assert report == want, report
