"""ComfyUI's own web frontend in headless Chromium, driven over the DevTools protocol, with the pack installed.

Opt-in like the integration test: COMFYUI_DIR and COMFYUI_PYTHON (docs/comfyui.md "Integration tests"), plus
Debian's `chromium` on PATH and the `websocket-client` package; otherwise skipped with one line. The server
is the integration test's (tiny demo models written by `h3-spark comfyui-demo`, a temporary folder for
everything ComfyUI writes). For each shipped UI workflow the page loads it as a user's drag-and-drop would:
no missing node type, no two nodes overlapping as the frontend draws them. Then the demo workflow is queued
from the page (as the Run button does): it must finish, show H3 Sampler's live preview in the page and write
its video. Screenshots go to H3_BROWSER_SHOTS (a folder) when set, else to the test's temporary folder.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

if not (os.environ.get("COMFYUI_DIR") and os.environ.get("COMFYUI_PYTHON")):
    pytest.skip("set COMFYUI_DIR and COMFYUI_PYTHON to run the browser test", allow_module_level=True)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no chromium on PATH (Debian: apt install chromium) for the browser test", allow_module_level=True)
websocket = pytest.importorskip("websocket", reason="the browser test drives Chromium with websocket-client")
requests = pytest.importorskip("requests")

from test_comfyui_integration import WORKFLOWS, installed, server  # noqa: E402,F401 - fixtures

# The shipped graphs and Comfy-Org's templates as convert-workflow rebuilt them on our nodes.
UI_WORKFLOWS = sorted(WORKFLOWS.glob("*.json")) + sorted((WORKFLOWS / "templates").glob("*.json"))


class Page:
    """One Chromium tab over the DevTools protocol: navigate, evaluate, screenshot."""

    def __init__(self, port: int):
        for _ in range(120):
            try:
                tabs = requests.get(f"http://127.0.0.1:{port}/json", timeout=2).json()
                break
            except requests.RequestException:
                time.sleep(0.5)
        else:
            raise AssertionError("Chromium's DevTools endpoint did not answer")
        tab = next(t for t in tabs if t["type"] == "page")
        # No Origin header: Chromium refuses DevTools websockets from an origin it was not told to allow.
        self.ws = websocket.create_connection(tab["webSocketDebuggerUrl"], timeout=120, suppress_origin=True)
        self.next_id = 0
        self.call("Page.enable")
        self.call("Runtime.enable")

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                return message

    def js(self, expression: str):
        reply = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        result = reply.get("result", {})
        if "exceptionDetails" in result:
            raise AssertionError(f"page error: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    def wait(self, expression: str, seconds: float, what: str):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}")

    def shot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["result"]["data"]
        path.write_bytes(base64.b64decode(data))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def page(server, tmp_path_factory):
    port = _free_port()
    profile = tmp_path_factory.mktemp("chromium")
    chrome = subprocess.Popen([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
                               f"--user-data-dir={profile}", f"--remote-debugging-port={port}",
                               "--window-size=1600,1000", "about:blank"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        p = Page(port)
        p.call("Page.navigate", url=server.url)
        p.wait("!!(window.app && window.app.graph && window.LiteGraph && window.app.canvas)", 180, "the frontend")
        yield p
    finally:
        chrome.terminate()
        chrome.wait(timeout=30)


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    folder = os.environ.get("H3_BROWSER_SHOTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("shots")
    path.mkdir(parents=True, exist_ok=True)
    return path


LOAD = """(async () => {{
  await window.app.loadGraphData({graph});
  await new Promise(r => setTimeout(r, 1500));
  document.querySelectorAll('.p-dialog-close-button, .p-dialog-header-close').forEach(b => b.click());
  const g = window.app.graph, c = window.app.canvas;
  const x = Math.min(...g._nodes.map(n => n.pos[0])), y = Math.min(...g._nodes.map(n => n.pos[1]));
  c.ds.scale = 0.8; c.ds.offset = [-x + 20, -y + 40]; c.setDirty(true, true);
  return g._nodes.length;
}})()"""
# Read after a frame is drawn: drawing grows a node to what its slots and widgets need.
BOXES = """(() => {
  const title = LiteGraph.NODE_TITLE_HEIGHT || 30;
  window.app.canvas.draw(true, true);
  return window.app.graph._nodes.map(n => ({id: n.id, type: n.type,
    known: !!LiteGraph.registered_node_types[n.type],
    box: [n.pos[0], n.pos[1] - title, n.size[0], n.size[1] + title]}));
})()"""


def _overlaps(nodes: list[dict]) -> list[tuple]:
    found = []
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            ax, ay, aw, ah = a["box"]
            bx, by, bw, bh = b["box"]
            if ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah:
                found.append((a["type"], a["box"], b["type"], b["box"]))
    return found


@pytest.mark.parametrize("workflow", UI_WORKFLOWS, ids=lambda p: p.stem)
def test_each_ui_workflow_loads_whole_and_without_overlaps(page, shots, workflow):
    assert page.js(LOAD.format(graph=workflow.read_text())) > 0
    time.sleep(0.5)
    page.shot(shots / f"{workflow.stem}.png")
    nodes = page.js(BOXES)
    assert nodes and all(n["known"] for n in nodes), [n["type"] for n in nodes if not n["known"]]
    assert not _overlaps(nodes), _overlaps(nodes)


def test_the_demo_workflow_runs_from_the_page_with_a_live_preview(page, shots, server):
    demo = WORKFLOWS / "H3 Demo, Text to Video (no download).json"
    page.js(LOAD.format(graph=demo.read_text()))
    before = set(server.output.rglob("*.mp4"))
    # Watch the sampler node for preview images while it runs (ComfyUI puts them in node.imgs).
    page.js("""(() => { window.__h3_previews = 0;
      const api = window.app.api || window.comfyAPI?.api?.api;
      api.addEventListener('b_preview', () => { window.__h3_previews += 1; });
      return true; })()""")
    assert page.js("window.app.queuePrompt(0, 1).then(() => true).catch(e => String(e))") is True
    page.wait("(window.__h3_previews || 0) > 0", 240, "a live preview from H3 Sampler")
    page.shot(shots / "demo-preview.png")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (set(server.output.rglob("*.mp4")) - before):
        time.sleep(1)
    written = set(server.output.rglob("*.mp4")) - before
    assert written, f"the demo wrote no video:\n{server.log_tail()}"
    time.sleep(2)
    page.shot(shots / "demo-done.png")
    # The live preview grows the sampler node downwards: nothing may sit under it.
    assert not _overlaps(page.js(BOXES)), _overlaps(page.js(BOXES))
    # The demo's video, kept: scripts/workflow_thumbnails.py makes the demo card from its middle frame.
    shutil.copy(sorted(written)[0], shots / "demo.mp4")


def test_a_real_weights_workflow_offers_the_downloads_of_its_missing_files(page, shots):
    """ComfyUI's frontend reads each loader's properties.models and, the files being absent here, opens its
    missing-models dialog with the official files and their Hugging Face addresses."""
    graph = (WORKFLOWS / "H3 Text to Video.json").read_text()
    page.js(f"window.app.loadGraphData({graph}).then(() => true)")
    text = page.wait("""(() => { const d = document.querySelector('.p-dialog');
        return d && d.innerText.includes('minimax_h3_video_vae_fp16') ? d.innerText : ''; })()""", 60,
                     "the missing-models dialog")
    page.shot(shots / "missing-models.png")
    for name in ("minimax_h3_fl2va_pruned_int8_convrot.safetensors", "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors",
                 "minimax_h3_video_vae_fp16.safetensors", "minimax_h3_audio_vae_fp32.safetensors"):
        assert name in text, text
    page.js("document.querySelectorAll('.p-dialog-close-button, .p-dialog-header-close').forEach(b => b.click())")


def test_the_template_browser_shows_titled_cards_with_their_thumbnails(page, shots, server):
    """ComfyUI's template browser, h3-spark's category: a card per UI workflow, titled by its file name, in the
    order the server lists them (the demo first when the folder lists it first), each with its 256 x 256 picture."""
    from io import BytesIO
    from urllib.parse import quote

    from PIL import Image

    listed = requests.get(f"{server.url}/workflow_templates", timeout=30).json()["h3-spark"]
    page.js("window.app.extensionManager.command.execute('Comfy.BrowseTemplates').then(() => true)")
    page.wait("""(() => { const item = [...document.querySelectorAll('.p-listbox-option, li')]
        .find(e => e.innerText.trim() === 'h3-spark'); if (item) item.click(); return !!item; })()""", 60,
              "the h3-spark category in the template browser")
    try:
        cards = page.wait("""(() => { const cards = [...document.querySelectorAll('[data-testid^="template-workflow-"]')];
            const first = cards.length && cards[0].querySelector('img');
            if (!first || !first.complete || !first.naturalWidth) return null;  // the first card's picture drawn
            return cards.map(c => ({title: c.querySelector('h3')?.innerText.trim(),
                                    width: c.querySelector('img')?.naturalWidth || 0})); })()""",
                          60, "the h3-spark cards")
    finally:
        time.sleep(2)
        page.shot(shots / "template-browser.png")
    assert [c["title"] for c in cards] == listed, cards
    assert cards[0]["width"] == 256, cards  # the others load as they scroll into view
    for name in listed:  # where the card asks for its picture
        picture = requests.get(f"{server.url}/api/workflow_templates/h3-spark/{quote(name)}.jpg", timeout=30)
        assert picture.status_code == 200, name
        with Image.open(BytesIO(picture.content)) as image:
            assert image.size == (256, 256), name
    assert sorted(listed)[0].startswith("H3 Demo")
    page.js("document.querySelectorAll('.p-dialog-close-button, .p-dialog-header-close').forEach(b => b.click())")
