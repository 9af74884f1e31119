"""workflows/*.json against the node pack: every node exists, every required input is given with the right
type, every link joins an output to an input of the same type (API format and UI graph format)."""

import json
from pathlib import Path

import pytest

from h3_spark import NODE_CLASS_MAPPINGS

ROOT = Path(__file__).resolve().parents[1]
MODES = ("t2va", "fl2va", "ref2va", "demo-t2va")
# The UI graphs are named as ComfyUI's template browser should title them (it shows the file name).
UI_NAMES = {"t2va": "H3 Text to Video", "fl2va": "H3 First-Last Frame to Video", "ref2va": "H3 Reference to Video",
            "demo-t2va": "H3 Demo, Text to Video (no download)"}


def ui_path(mode: str, suffix: str = ".json") -> Path:
    return ROOT / "workflows" / f"{UI_NAMES[mode]}{suffix}"
# The ComfyUI core nodes the workflows use to bring media in: inputs and outputs.
CORE = {"LoadImage": ({"image": "STRING"}, ("IMAGE", "MASK")), "LoadAudio": ({"audio": "STRING"}, ("AUDIO",))}
WIRE_TYPES = {"MODEL", "H3_MODEL", "CONDITIONING", "LATENT", "IMAGE", "AUDIO", "MASK", "H3_TEXT_ENCODER", "H3_VAE"}


def is_wire(kind) -> bool:
    return isinstance(kind, str) and kind in WIRE_TYPES


def signature(class_type):
    """({input: (type, required)}, output types) of a node class."""
    if class_type in CORE:
        inputs, outputs = CORE[class_type]
        return {k: (v, True) for k, v in inputs.items()}, outputs
    assert class_type in NODE_CLASS_MAPPINGS, f"unknown node {class_type}"
    cls = NODE_CLASS_MAPPINGS[class_type]
    spec = cls.INPUT_TYPES()
    inputs = {k: (v[0], True) for k, v in spec["required"].items()}
    inputs.update({k: (v[0], False) for k, v in spec.get("optional", {}).items()})
    return inputs, tuple(cls.RETURN_TYPES)


# Combos that list model files on disk (none here): only the value's shape is checked.
MODEL_COMBOS = {"dit_name", "text_encoder_name", "tokenizer", "vae_name", "audio_vae_name", "lora_name"}


def value_ok(kind, options, value, name="") -> bool:
    if isinstance(kind, list):
        return (isinstance(value, str) and bool(value)) if name in MODEL_COMBOS else value in kind
    if kind == "INT":
        return isinstance(value, int) and options.get("min", value) <= value <= options.get("max", value)
    if kind == "FLOAT":
        return isinstance(value, (int, float)) and options.get("min", value) <= value <= options.get("max", value)
    if kind == "STRING":
        return isinstance(value, str)
    return False


def options_of(class_type, name):
    if class_type in CORE:
        return {}
    spec = NODE_CLASS_MAPPINGS[class_type].INPUT_TYPES()
    entry = spec["required"].get(name) or spec.get("optional", {})[name]
    return entry[1] if len(entry) > 1 else {}


@pytest.mark.parametrize("mode", MODES)
def test_api_workflow(mode):
    prompt = json.loads((ROOT / "workflows" / "api" / f"h3-spark-{mode}.json").read_text())
    for node_id, node in prompt.items():
        inputs, _ = signature(node["class_type"])
        given = node["inputs"]
        assert set(given) <= set(inputs), (node_id, set(given) - set(inputs))
        for name, (kind, required) in inputs.items():
            if name not in given:
                assert not required, f"{node_id}.{name} is required"
                continue
            value = given[name]
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                src = prompt[value[0]]
                _, outputs = signature(src["class_type"])
                assert outputs[value[1]] == kind, f"{node_id}.{name}: {outputs[value[1]]} into {kind}"
            else:
                assert not is_wire(kind), f"{node_id}.{name} needs a {kind} link"
                assert value_ok(kind, options_of(node["class_type"], name), value, name), (node_id, name, value)
    assert any(n["class_type"] == "H3SparkSaveVideo" for n in prompt.values())


@pytest.mark.parametrize("mode", MODES)
def test_ui_workflow(mode):
    graph = json.loads(ui_path(mode).read_text())
    nodes = {n["id"]: n for n in graph["nodes"]}
    links = {link[0]: link for link in graph["links"]}
    assert graph["last_link_id"] == max(links) and graph["last_node_id"] == max(nodes)
    for node in nodes.values():
        inputs, outputs = signature(node["type"])
        wired = [(k, v) for k, v in inputs.items() if is_wire(v[0])]
        assert [i["name"] for i in node["inputs"]] == [k for k, _ in wired], node["type"]
        for slot, (item, (name, (kind, required))) in enumerate(zip(node["inputs"], wired)):
            assert item["type"] == kind
            if item["link"] is None:
                assert not required, f"{node['type']}.{name} is required"
                continue
            link_id, src, src_slot, dst, dst_slot, link_type = links[item["link"]]
            assert (dst, dst_slot) == (node["id"], slot) and link_type == kind
            src_outputs = signature(nodes[src]["type"])[1]
            assert src_outputs[src_slot] == kind
            assert item["link"] in nodes[src]["outputs"][src_slot]["links"]
        assert [o["type"] for o in node["outputs"]] == list(outputs)
        widgets = [(k, v) for k, v in inputs.items() if not is_wire(v[0])]
        values = list(node["widgets_values"])
        for name, (kind, _) in widgets:
            value = values.pop(0)
            assert value_ok(kind, options_of(node["type"], name), value, name), (node["type"], name, value)
            if options_of(node["type"], name).get("control_after_generate"):
                assert values.pop(0) in ("fixed", "increment", "decrement", "randomize")
        assert not values, f"{node['type']}: extra widget values {values}"


@pytest.mark.parametrize("mode", MODES)
def test_both_formats_describe_the_same_graph(mode):
    api = json.loads((ROOT / "workflows" / "api" / f"h3-spark-{mode}.json").read_text())
    ui = json.loads(ui_path(mode).read_text())
    assert {int(k): v["class_type"] for k, v in api.items()} == {n["id"]: n["type"] for n in ui["nodes"]}
    api_links = {(int(v[0]), v[1], int(k), name) for k, node in api.items() for name, v in node["inputs"].items()
                 if isinstance(v, list)}
    ui_nodes = {n["id"]: n for n in ui["nodes"]}
    ui_links = {(src, slot, dst, ui_nodes[dst]["inputs"][dst_slot]["name"])
                for _, src, slot, dst, dst_slot, _ in ui["links"]}
    assert api_links == ui_links


def test_the_demo_workflow_names_the_folders_the_demo_command_writes():
    from h3_spark.h3_model.engine.demo import COMFY_FOLDERS, TEXT_READ_LAYER

    api = json.loads((ROOT / "workflows" / "api" / "h3-spark-demo-t2va.json").read_text())
    inputs = {node["class_type"]: node["inputs"] for node in api.values()}
    names = {name + "/" for _, name in COMFY_FOLDERS.values()}
    assert {inputs["H3SparkModelLoader"]["dit_name"], inputs["H3SparkTextEncoderLoader"]["text_encoder_name"],
            inputs["H3SparkVAELoader"]["vae_name"], inputs["H3SparkVAELoader"]["audio_vae_name"]} <= names
    assert inputs["H3SparkTextEncoderLoader"]["layer"] == TEXT_READ_LAYER
    t2v = inputs["H3SparkTextToVideo"]
    assert t2v["width"] * t2v["height"] <= 128 * 64 and inputs["H3SparkSampler"]["steps"] <= 2  # seconds on a CPU


@pytest.mark.parametrize("mode", MODES)
def test_each_ui_workflow_has_a_thumbnail_for_the_template_browser(mode):
    """ComfyUI's template browser asks for <workflow>.jpg beside each custom node's workflows/*.json and shows it
    in a 256 x 256 box (object-contain): a picture of that size, made by scripts/workflow_thumbnails.py (a frame
    of the demo's video, a rendered card for the others), not a screenshot of the page."""
    from PIL import Image

    thumb = ui_path(mode, ".jpg")
    with Image.open(thumb) as image:
        assert (image.format, image.size, image.mode) == ("JPEG", (256, 256), "RGB"), thumb.name
        assert len(set(image.resize((32, 32)).getdata())) > 16  # a picture, not a flat fill


def test_the_template_browser_titles_the_graphs_and_lists_the_demo_first():
    """ComfyUI 0.3.64's browser titles a custom node's template by its file name and lists them in the folder's
    order (a fresh checkout writes them sorted by name): the names are the titles, the demo sorts first."""
    names = sorted(p.stem for p in (ROOT / "workflows").glob("*.json"))
    assert names == sorted(UI_NAMES.values())
    assert names[0] == UI_NAMES["demo-t2va"]
    assert all(" " in name and not name.startswith("h3-spark") for name in names)


def test_only_ui_workflows_sit_where_the_template_browser_looks():
    for path in (ROOT / "workflows").glob("*.json"):
        graph = json.loads(path.read_text())
        assert "nodes" in graph and "links" in graph, f"{path.name} is not a UI workflow: move it to workflows/api/"


def ui_widget_values(node) -> dict:
    """A UI node's widget values by input name (the seed's control_after_generate entry left out)."""
    inputs, _ = signature(node["type"])
    values, named = list(node["widgets_values"]), {}
    for name, (kind, _) in inputs.items():
        if is_wire(kind):
            continue
        named[name] = values.pop(0)
        if options_of(node["type"], name).get("control_after_generate"):
            values.pop(0)
    return named


@pytest.mark.parametrize("mode", MODES)
def test_both_formats_give_the_same_settings(mode):
    """The API graph gives every setting the UI graph shows (the sampler's `recipe` and cache ones included),
    with the same values: what runs from a script is what the page shows."""
    api = json.loads((ROOT / "workflows" / "api" / f"h3-spark-{mode}.json").read_text())
    ui = json.loads(ui_path(mode).read_text())
    for node in ui["nodes"]:
        given = {k: v for k, v in api[str(node["id"])]["inputs"].items() if not isinstance(v, list)}
        assert given == ui_widget_values(node), (mode, node["type"])


def test_the_docs_name_every_sampler_setting():
    docs = (ROOT / "docs" / "comfyui.md").read_text()
    spec = NODE_CLASS_MAPPINGS["H3SparkSampler"].INPUT_TYPES()
    for name, entry in [*spec["required"].items(), *spec["optional"].items()]:
        if not is_wire(entry[0]):
            assert f"`{name}`" in docs, name
    for mode in spec["optional"]["cache"][0]:
        assert f"`{mode}`" in docs, mode


# The official Comfy-Org files, with the download addresses ComfyUI's own H3 templates give for them
# (Comfy-Org/workflow_templates: templates/video_minimax_h3_r2v.json @ 2ace74d3 and video_minimax_h3_t2v.json
# @ 78487a52, their "Model Links" notes and VAELoader properties.models), and the models/ folder each goes in.
OFFICIAL_FILES = {
    "minimax_h3_fl2va_pruned_int8_convrot.safetensors": (
        "https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main/diffusion_models/"
        "minimax_h3_fl2va_pruned_int8_convrot.safetensors", "diffusion_models"),
    "minimax_h3_ref2va_pruned_int8_convrot.safetensors": (
        "https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main/diffusion_models/"
        "minimax_h3_ref2va_pruned_int8_convrot.safetensors", "diffusion_models"),
    "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors": (
        "https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main/text_encoders/"
        "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors", "text_encoders"),
    "minimax_h3_video_vae_fp16.safetensors": (
        "https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main/vae/minimax_h3_video_vae_fp16.safetensors", "vae"),
    "minimax_h3_audio_vae_fp32.safetensors": (
        "https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main/vae/minimax_h3_audio_vae_fp32.safetensors", "vae"),
}


@pytest.mark.parametrize("mode", ("t2va", "fl2va", "ref2va"))
def test_the_real_weights_workflows_say_where_each_file_comes_from(mode):
    """ComfyUI's frontend reads a node's properties.models (name, url, directory), keeps the entries whose name
    is one of the node's widget values, and offers the missing ones for download: every official file a loader
    names has its entry, with the address ComfyUI's own templates give."""
    ui = json.loads(ui_path(mode).read_text())
    named = 0
    for node in ui["nodes"]:
        values = {v for v in node.get("widgets_values", []) if isinstance(v, str)}
        official = sorted(values & set(OFFICIAL_FILES))
        models = node.get("properties", {}).get("models", [])
        assert sorted(m["name"] for m in models) == official, node["type"]
        for entry in models:
            assert (entry["url"], entry["directory"]) == OFFICIAL_FILES[entry["name"]], entry
        named += len(official)
    assert named == 4  # DiT, text encoder and both VAEs


def test_the_demo_workflow_downloads_nothing():
    ui = json.loads(ui_path("demo-t2va").read_text())
    assert not any(node.get("properties", {}).get("models") for node in ui["nodes"])
    assert "install.py --demo" in ui["extra"]["h3_spark_demo"]


@pytest.mark.parametrize("mode", MODES)
def test_every_wire_runs_left_to_right_without_long_diagonals(mode):
    """The graph reads left to right as it runs: each link leaves a node for one further right, and none climbs
    or falls further than half a screen (a long diagonal across the canvas is hard to follow)."""
    ui = json.loads(ui_path(mode).read_text())
    nodes = {n["id"]: n for n in ui["nodes"]}
    for _, src, _, dst, _, kind in ui["links"]:
        (sx, sy), (dx, dy) = nodes[src]["pos"], nodes[dst]["pos"]
        assert sx + nodes[src]["size"][0] <= dx, (mode, nodes[src]["type"], nodes[dst]["type"], kind)
        assert abs(sy - dy) <= 520, (mode, nodes[src]["type"], nodes[dst]["type"], kind)
