"""h3-spark convert-workflow against Comfy-Org's real MiniMax H3 templates (comfyui-workflow-templates-json
0.1.123, pinned in the test extra): every local H3 template converts, each setting it carries has the value the
template gives (the expected values below are read off the templates and their notes by hand, not computed by
the converter), the nodes it cannot carry are named, and what is not an H3 template is refused in one line."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

from h3_spark import NODE_CLASS_MAPPINGS
from h3_spark.cli import main as cli_main
from h3_spark.comfy_templates import convert, expression, folding, ui_graph, writers
from h3_spark.errors import InputError

templates_json = pytest.importorskip("comfyui_workflow_templates_json")
TEMPLATES = Path(templates_json.__file__).resolve().parent / "templates"
ROOT = Path(__file__).resolve().parents[1]
CORE = {"LoadImage": ("IMAGE", "MASK"), "SaveImage": ()}

# template -> what it runs (canvas, length, seed, steps, sampler, scheduler, shifts, recipe, dit, LoRA).
EXPECTED = {
    "video_minimax_h3_t2v": dict(node="H3SparkTextToVideo", canvas=(864, 480), length=124, seed=757358688076805,
                                 steps=20, sampler="res_multistep", scheduler="simple", shifts=(12, 3), recipe="",
                                 dit="minimax_h3_fl2va_pruned_int8_convrot.safetensors",
                                 lora=("minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors", 1.0, 8)),
    "video_minimax_h3_i2v": dict(node="H3SparkFirstLastFrameToVideo", canvas=(640, 640), length=124,
                                 seed=757358688076805, steps=20, sampler="res_multistep", scheduler="simple",
                                 shifts=(12, 3), recipe="", dit="minimax_h3_fl2va_pruned_int8_convrot.safetensors",
                                 lora=("minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors", 1.0, 8),
                                 first_frame="transparent_rgb_gaming_mouse.png"),
    "video_minimax_h3_i2v_continuation": dict(node="H3SparkFirstLastFrameToVideo", canvas=(640, 640), length=124,
                                              seed=757358688076805, steps=20, sampler="res_multistep",
                                              scheduler="simple", shifts=(12, 3), recipe="", prompt="",
                                              dit="minimax_h3_fl2va_pruned_int8_convrot.safetensors",
                                              first_frame="transparent_rgb_gaming_mouse.png"),
    "video_minimax_h3_r2v": dict(node="H3SparkReferenceToVideo", canvas=(864, 480), length=124,
                                 seed=261662374822964, steps=20, sampler="res_multistep", scheduler="simple",
                                 shifts=(12, 3), recipe="", dit="minimax_h3_ref2va_pruned_int8_convrot.safetensors",
                                 lora=("minimax_h3_ref2v_turbo_4step_v0.1_comfyui_bf16.safetensors", 1.0, 4),
                                 refs=["red_superboy_on_city_roof.png", "mecha_dragon_lightning.png"]),
    "video_minimax_h3_multiframe_reference": dict(
        node="H3SparkReferenceToVideo", canvas=(864, 480), length=124, seed=148096032077131, steps=20,
        sampler="res_multistep", scheduler="simple", shifts=(12, 3), recipe="",
        dit="minimax_h3_ref2va_pruned_int8_convrot.safetensors",
        lora=("minimax_h3_ref2v_turbo_4step_v0.1_comfyui_bf16.safetensors", 1.0, 4), refs=["h3_frame_ref_1.png"],
        guides=[(36, "h3_frame_ref_2.png"), (72, "h3_frame_ref_3.png"), (120, "h3_frame_ref_4.png")]),
    "video_minimax_h3_fun_controlnet_union": dict(node="H3SparkReferenceToVideo", canvas=(864, 480), length=124,
                                                  seed=1086599926715797, steps=20, sampler="res_multistep",
                                                  scheduler="simple", shifts=(12, 3), recipe="",
                                                  dit="minimax_h3_ref2va_pruned_int8_convrot.safetensors"),
    "video_fastvideo_fasth3_t2v": dict(node="H3SparkTextToVideo", canvas=(640, 640), length=124,
                                       seed=631153434041465, steps=8, sampler="res_multistep", scheduler="simple",
                                       shifts=(10, 3), recipe="fasth3-v2:sparsity=0.9,start=0.2", attention="ck_int8",
                                       dit="fastvideo_fasth3_8step_v2_pruned_int8_convrot.safetensors"),
    "video_fastvideo_fasth3_i2v": dict(node="H3SparkFirstLastFrameToVideo", length=124, seed=793369680225544,
                                       steps=8, sampler="res_multistep", scheduler="simple", shifts=(10, 3),
                                       recipe="fasth3-v2:sparsity=0.9,start=0.2", attention="ck_int8",
                                       dit="fastvideo_fasth3_8step_v2_pruned_int8_convrot.safetensors",
                                       first_frame="red_line_barrier.png"),
    "video_fasth3_ominiref_r2v": dict(node="H3SparkReferenceToVideo", canvas=(1376, 768), length=124,
                                      seed=771204598, steps=8, sampler="euler", scheduler="simple", shifts=(12, 3),
                                      recipe="omniref:sparsity=0.9,start=0", attention="ck_int8",
                                      dit="fasth3_omniref_8step_pruned_int8_convrot.safetensors",
                                      refs=["yellow_plane_ref.png"]),
    "image_minimax_h3_t2i": dict(node="H3SparkTextToVideo", canvas=(1280, 736), length=1, seed=697447143149280,
                                 steps=30, sampler="res_multistep", scheduler="simple", shifts=(12, 3), recipe="",
                                 attention="ck_int8", dit="minimax_h3_fl2va_pruned_int8_convrot.safetensors",
                                 lora=("minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors", 1.0, None)),
}
# Nodes each template has that the converted graph cannot carry yet, by id and type.
NOT_CARRIED = {
    "video_minimax_h3_fun_controlnet_union": {
        ("172", "MiniMaxH3FunControlNetApply"), ("173", "ModelPatchLoader"), ("174", "LoadVideo"),
        ("705", "Video Slice"), ("704", "PreviewImage"), ("700:671", "SDPoseKeypointExtractor"),
        ("700:672", "SDPoseDrawKeypoints"), ("700:673", "CheckpointLoaderSimple"), ("700:674", "ResizeImageMaskNode"),
        ("700:677", "UNETLoader"), ("700:678", "RTDETR_detect"), ("700:692", "GetVideoComponents")},
    "video_fastvideo_fasth3_i2v": {("141", "GetImageSize"), ("142", "ImageScaleToTotalPixels")},
}


def load(name: str) -> dict:
    return json.loads((TEMPLATES / f"{name}.json").read_text(encoding="utf-8"))


def convert_graph(graph: dict, name: str = "template"):
    conversion = convert.convert(ui_graph.FlatGraph(graph, name))
    return conversion, writers.api_prompt(conversion), writers.ui_workflow(conversion)


def one(api: dict, class_type: str) -> dict:
    found = [node["inputs"] for node in api.values() if node["class_type"] == class_type]
    assert len(found) == 1, (class_type, len(found))
    return found[0]


def source(api: dict, link) -> dict:
    return api[link[0]]


@pytest.fixture(scope="module")
def converted():
    return {name: convert_graph(load(name), name) for name in EXPECTED}


@pytest.mark.parametrize("name", EXPECTED)
def test_every_local_h3_template_converts_with_its_settings(name, converted):
    want = EXPECTED[name]
    conversion, api, _ = converted[name]
    assert conversion.complete == (name not in NOT_CARRIED)
    sampler = one(api, "H3SparkSampler")
    assert (sampler["seed"], sampler["steps"], sampler["sampler_name"], sampler["scheduler"]) == (
        want["seed"], want["steps"], want["sampler"], want["scheduler"])
    assert (sampler["shift_video"], sampler["shift_audio"]) == want["shifts"]
    assert sampler["recipe"] == want["recipe"]
    loader = one(api, "H3SparkModelLoader")
    assert loader["dit_name"] == want["dit"]
    # FastH3 file names name no partition: the graph's conditioning says which one runs.
    assert loader["partition"] == ("ref2va" if want["node"] == "H3SparkReferenceToVideo" else "t2va/fl2va")
    assert one(api, "H3SparkTextEncoderLoader")["text_encoder_name"] == "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"
    cond = one(api, want["node"])
    if "canvas" in want:
        assert (cond["width"], cond["height"]) == want["canvas"]
    assert cond["length"] == want["length"]
    if "prompt" in want:
        assert cond["prompt"] == want["prompt"]
    else:
        assert len(cond["prompt"]) > 40
    if "first_frame" in want:
        assert source(api, cond["first_frame"])["inputs"]["image"] == want["first_frame"]
    if "refs" in want:
        assert [source(api, cond[f"image_{i + 1}"])["inputs"]["image"] for i in range(len(want["refs"]))] == \
            want["refs"]
        assert cond["reference_size"] == "match" and "image_%d" % (len(want["refs"]) + 1) not in cond
    attention = [n["inputs"]["backend"] for n in api.values() if n["class_type"] == "H3SparkAttentionPatch"]
    assert attention == ([want["attention"]] if "attention" in want else [])
    # The LoRA switch is off in every template: the API graph runs without it.
    assert not any(n["class_type"] == "H3SparkLoraLoader" for n in api.values())


def test_the_multiframe_template_guides_at_36_72_and_120_in_order(converted):
    _, api, _ = converted["video_minimax_h3_multiframe_reference"]
    sampler = one(api, "H3SparkSampler")
    guides, node = [], source(api, sampler["positive"])
    while node["class_type"] == "H3SparkAddGuide":
        guides.append((node["inputs"]["frame_idx"], source(api, node["inputs"]["image"])["inputs"]["image"]))
        assert source(api, node["inputs"]["latent"])["class_type"] == "H3SparkReferenceToVideo"
        node = source(api, node["inputs"]["positive"])
    assert node["class_type"] == "H3SparkReferenceToVideo"
    assert guides[::-1] == EXPECTED["video_minimax_h3_multiframe_reference"]["guides"]


def test_a_prompt_naming_guide_pictures_is_flagged(converted, tmp_path, capsys):
    """The multiframe template's prompt calls its three guides <Picture 2..4>; ComfyUI's AddGuide does not show
    them to the text encoder, which reads the labels as plain words (the H3 nodes too): said up front."""
    conversion, _, _ = converted["video_minimax_h3_multiframe_reference"]
    assert conversion.settings["warnings"] == [
        "[136] MiniMaxH3ReferenceToVideo: the prompt names <Picture 2>, <Picture 3>, <Picture 4>, but the text "
        "encoder is given 1 picture(s) (guide pictures are not shown to it): read as plain text, as ComfyUI reads "
        "it"]
    assert not any("warnings" in converted[n][0].settings for n in EXPECTED if "multiframe" not in n)
    assert cli_main(["convert-workflow", str(TEMPLATES / "video_minimax_h3_multiframe_reference.json"), "--out",
                     str(tmp_path / "m.json"), "--api"]) == 0
    assert "warning: [136] MiniMaxH3ReferenceToVideo: the prompt names <Picture 2>" in capsys.readouterr().err


def enable_lora(graph: dict) -> dict:
    """The template with its LoRA switch on, wherever the template keeps it: a "... LoRA" boolean node, or the
    BOOLEAN subgraph input labelled turbo_mode / enable_turbo_lora that the instance sets."""
    graph = copy.deepcopy(graph)
    subgraphs = {sg["id"]: sg for sg in graph.get("definitions", {}).get("subgraphs", [])}
    for node in graph["nodes"]:
        if node["type"] == "PrimitiveBoolean" and "LoRA" in (node.get("title") or ""):
            node["widgets_values"], node["widgets_values_named"] = [True], {"value": True}
        for item in subgraphs.get(node["type"], {}).get("inputs", []):
            if item.get("type") == "BOOLEAN" and "turbo" in (item.get("label") or ""):
                node["widgets_values_named"][item["name"]] = True
    return graph


@pytest.mark.parametrize("name", [n for n, w in EXPECTED.items() if "lora" in w])
def test_the_lora_switch_picks_the_lora_branch_and_its_steps(name, converted):
    lora_name, strength, steps = EXPECTED[name]["lora"]
    _, _, ui = converted[name]
    off = [n for n in ui["nodes"] if n["type"] == "H3SparkLoraLoader"]
    assert [(n["mode"], n["widgets_values"]) for n in off] == [(4, [lora_name, strength])]  # carried, bypassed
    if steps is not None:  # the steps the template's switch would give with it, on the node's title
        assert off[0]["title"] == f"H3 LoRA Loader (off as in the template; on: H3 Sampler steps {steps})"
    _, api, _ = convert_graph(enable_lora(load(name)), name)
    lora = one(api, "H3SparkLoraLoader")
    assert (lora["lora_name"], lora["strength"]) == (lora_name, strength)
    assert source(api, lora["model"])["class_type"] == "H3SparkModelLoader"
    sampler = one(api, "H3SparkSampler")
    assert sampler["steps"] == (steps or EXPECTED[name]["steps"])
    model = source(api, sampler["model"])
    while model["class_type"] != "H3SparkLoraLoader":
        model = source(api, model["inputs"]["model"])


def test_text_to_image_is_one_frame_on_the_32_pixel_grid(converted):
    conversion, api, _ = converted["image_minimax_h3_t2i"]
    save = one(api, "SaveImage")
    assert save["filename_prefix"] == "image_minimax_h3_t2i"
    assert source(api, save["images"])["class_type"] == "H3SparkDecode"
    # Resolution Selector 16:9, 0.9 MP, multiple 8 gives 1296 x 728; h3-spark's canvas is on the 32 px grid.
    assert conversion.settings["canvas_from_template"] == [1296, 728]
    assert any("728 is off H3's 32-pixel grid" in s for s in conversion.settings["settings_not_carried"])
    vae = one(api, "H3SparkVAELoader")
    assert vae["vae_name"] == "minimax_h3_video_vae_fp16.safetensors"
    assert vae["audio_vae_name"] == "minimax_h3_audio_vae_fp32.safetensors"  # the loader needs one; none in the template
    ui_vae = next(n for n in converted["image_minimax_h3_t2i"][2]["nodes"] if n["type"] == "H3SparkVAELoader")
    assert [m["name"] for m in ui_vae["properties"]["models"]] == ui_vae["widgets_values"][:2]  # both downloadable
    fates = {e["id"]: (e["type"], e["fate"], e["detail"]) for e in conversion.report}
    assert fates["79"] == ("ResolutionSelector", "folded", "= 1296 x 728")
    assert fates["58:39"][:2] == ("LTXVSeparateAVLatent", "absorbed")  # H3 Decode reads the video latent itself
    assert fates["58:52"] == ("ComfySwitchNode", "folded", "switch False: takes on_false")


@pytest.mark.parametrize("name", NOT_CARRIED)
def test_the_nodes_not_carried_are_named(name, converted, tmp_path, capsys):
    conversion, _, _ = converted[name]
    assert {(e["id"], e["type"]) for e in conversion.not_carried} == NOT_CARRIED[name]
    out, report = tmp_path / "out.json", tmp_path / "report.json"
    assert cli_main(["convert-workflow", str(TEMPLATES / f"{name}.json"), "--out", str(out), "--report",
                     str(report)]) == 0
    err = capsys.readouterr().err
    for node_id, node_type in NOT_CARRIED[name]:
        assert f"not carried: [{node_id}] {node_type}: " in err
    saved = json.loads(report.read_text())
    assert saved["complete"] is False
    assert {(e["id"], e["type"]) for e in saved["not_carried"]} == NOT_CARRIED[name]
    assert "nodes" in json.loads(out.read_text())
    # --strict writes nothing
    strict = tmp_path / "strict.json"
    assert cli_main(["convert-workflow", str(TEMPLATES / f"{name}.json"), "--out", str(strict), "--strict"]) == 2
    assert not strict.exists()
    assert "nothing written (--strict)" in capsys.readouterr().err


@pytest.mark.parametrize("name", EXPECTED)
def test_every_template_node_has_a_fate(name, converted):
    conversion, _, _ = converted[name]
    graph = ui_graph.FlatGraph(load(name), name)
    assert {e["id"] for e in conversion.report} == set(graph.nodes)
    fates = {e["fate"] for e in conversion.report}
    assert fates <= {"converted", "absorbed", "folded", "kept", "unused", "not_carried"}


def wire(kind) -> bool:
    return isinstance(kind, str) and kind.isupper() and kind not in ("INT", "FLOAT", "STRING", "BOOLEAN")


@pytest.mark.parametrize("name", EXPECTED)
def test_the_converted_graphs_are_valid_for_the_pack(name, converted):
    _, api, ui = converted[name]
    for node_id, node in api.items():
        if node["class_type"] in CORE:
            continue
        spec = NODE_CLASS_MAPPINGS[node["class_type"]].INPUT_TYPES()
        for required in spec["required"]:
            assert required in node["inputs"], (name, node["class_type"], required)
        for value in node["inputs"].values():
            if isinstance(value, list):
                assert value[0] in api, (name, node_id, value)
    nodes = {n["id"]: n for n in ui["nodes"]}
    for link_id, src, src_slot, dst, dst_slot, kind in ui["links"]:
        assert nodes[dst]["inputs"][dst_slot]["link"] == link_id and nodes[dst]["inputs"][dst_slot]["type"] == kind
        assert link_id in nodes[src]["outputs"][src_slot]["links"] and nodes[src]["outputs"][src_slot]["type"] == kind
        assert nodes[src]["pos"][0] + nodes[src]["size"][0] <= nodes[dst]["pos"][0]  # left to right
    for node in ui["nodes"]:
        if node["type"] in CORE:
            continue
        spec = NODE_CLASS_MAPPINGS[node["type"]].INPUT_TYPES()
        declared = [k for group in ("required", "optional") for k, v in spec.get(group, {}).items() if wire(v[0])]
        assert [i["name"] for i in node["inputs"]] == declared


def test_the_committed_workflows_are_what_the_converter_makes_now():
    spec = importlib.util.spec_from_file_location("convert_comfy_templates",
                                                  ROOT / "scripts" / "convert_comfy_templates.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--check"]) == 0  # else: python scripts/convert_comfy_templates.py
    assert sorted(p.name for p in (ROOT / "workflows" / "api" / "templates").glob("*.json")) == sorted(
        f"{n}.json" for n in EXPECTED if n not in NOT_CARRIED)


# ------------------------------------------------------------------------------ folding, against the templates' notes
# The t2v template's own note [118] tabulates Resolution Selector's sizes at 16:9 with multiple 32.
NOTE_TABLE = {0.2: (608, 352), 0.3: (736, 416), 0.4: (864, 480), 0.5: (960, 544), 0.6: (1056, 608),
              0.7: (1152, 640), 0.8: (1216, 672), 0.9: (1280, 736), 0.98: (1344, 768)}


def test_resolution_selector_matches_the_templates_table():
    note = next(n for n in load("video_minimax_h3_t2v")["nodes"] if n["id"] == 118)["widgets_values"][0]
    for megapixels, size in NOTE_TABLE.items():
        assert f"| {megapixels} | 16:9 | {size[0]} x {size[1]}" in note  # the table is the template's
        assert folding.resolution("16:9 (Widescreen)", megapixels, 32) == size
    assert folding.resolution("1:1 (Square)", 0.4, 32) == (640, 640)
    with pytest.raises(InputError, match=r"unknown aspect ratio '5:1'"):
        folding.resolution("5:1", 1.0, 32)


LENGTH = "max(5, round(a * 24)) + (5 - (max(5, round(a * 24)) % 17)) % 17"


@pytest.mark.parametrize("seconds, frames", [(5, 124), (2, 56), (0.1, 5), (14.375, 345), (14.4, 362), (10, 243)])
def test_the_duration_formula_snaps_up_to_17k_plus_5(seconds, frames):
    assert expression.outputs(LENGTH, {"a": seconds})[1] == frames
    assert (frames - 5) % 17 == 0


@pytest.mark.parametrize("text, message", [
    ("__import__('os').system('true')", "is not plain arithmetic"),
    ("a.real", "is not plain arithmetic"),
    ("b + 1", "uses 'b', which is not one of its inputs"),
    ("2 ** 1000", "exponent 1000 is above 64"),
    ("a / 0", "divides by zero"),
    ("round(a", "does not parse"),
    ("a > 1", "not a number"),
])
def test_the_math_evaluator_refuses_what_is_not_arithmetic(text, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace("*", r"\*")):
        expression.outputs(text, {"a": 2.5})


# ------------------------------------------------------------------------------ refusals
def test_a_template_that_is_not_h3s_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert cli_main(["convert-workflow", str(TEMPLATES / "3d_hunyuan3d-v2.1.json"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("h3-spark convert-workflow: error: 3d_hunyuan3d-v2.1: not a MiniMax H3 template (no MiniMaxH3 "
                   "node and no CLIPLoader of type minimax)")
    assert not out.exists()
    assert cli_main(["convert-workflow", str(TEMPLATES / "api_minimax_h3_t2v.json"), "--out", str(out)]) == 2
    assert "not a local MiniMax H3 template: it calls MiniMax's cloud API" in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ("{not json", "not a JSON workflow"),
    ('{"nodes": []}', "not a ComfyUI UI workflow (no 'nodes' and 'links' lists)"),
    ('{"1": {"class_type": "H3SparkSampler", "inputs": {}}}', "an API-format prompt; convert-workflow reads UI"),
])
def test_a_malformed_file_is_refused(tmp_path, capsys, text, message):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    assert cli_main(["convert-workflow", str(bad), "--out", str(tmp_path / "out.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and str(bad) in err and err.count("\n") == 1


def test_a_link_to_a_missing_node_is_refused():
    graph = load("video_minimax_h3_r2v")
    graph["links"] = [[l[0], 9999, *l[2:]] if l[0] == 270 else l for l in graph["links"]]
    with pytest.raises(InputError, match=r"link 270 into \[126\] BasicGuider.conditioning starts at node 9999"):
        convert_graph(graph, "r2v")


def test_a_subgraph_that_holds_itself_is_refused():
    graph = load("video_minimax_h3_t2v")
    definition = graph["definitions"]["subgraphs"][0]
    definition["nodes"].append({"id": 999, "type": definition["id"], "inputs": [], "outputs": []})
    with pytest.raises(InputError, match=r"is nested more than 16 deep \(at node 140:999:999"):
        convert_graph(graph, "t2v")


def test_a_switch_that_feeds_itself_is_refused():
    graph = load("video_minimax_h3_r2v")
    graph["links"] = [[l[0], 141, 0, *l[3:]] if l[0] == 287 else l for l in graph["links"]]  # on_false <- itself
    with pytest.raises(InputError, match=r"\[141\] ComfySwitchNode \(If/Else Switch \(model\)\) feeds itself"):
        convert_graph(graph, "r2v")


def test_the_output_is_not_written_over_the_template(tmp_path):
    src = tmp_path / "t.json"
    src.write_text((TEMPLATES / "video_minimax_h3_t2v.json").read_text())
    assert cli_main(["convert-workflow", str(src), "--out", str(src)]) == 2
    out = tmp_path / "out.json"
    assert cli_main(["convert-workflow", str(src), "--out", str(out), "--report", str(out)]) == 2
    assert not out.exists()


@pytest.mark.parametrize("name", EXPECTED)
def test_a_graph_saved_without_named_widget_values_converts_the_same(name, converted):
    """The packaged templates name each widget value; a graph saved by ComfyUI's frontend lists them by position
    only. Both read the same."""
    graph = load(name)
    for node in [*graph["nodes"], *(n for sg in graph.get("definitions", {}).get("subgraphs", []) for n in sg["nodes"])]:
        node.pop("widgets_values_named", None)
    assert convert_graph(graph, name)[1] == converted[name][1]


def test_an_embedding_stays_in_the_prompt_as_written():
    """Style embeddings are named in the prompt as `embedding:NAME` (the templates' notes); carried verbatim."""
    graph = load("video_minimax_h3_r2v")
    prompt = next(n for n in graph["nodes"] if n["type"] == "PrimitiveStringMultiline")
    text = "embedding:minimaxh3_art_is_explosion, <Picture 1> fights <Picture 2> over the city."
    prompt["widgets_values"], prompt["widgets_values_named"] = [text], {"value": text}
    _, api, _ = convert_graph(graph, "r2v")
    assert one(api, "H3SparkReferenceToVideo")["prompt"] == text


# Inputs of H3 Sampler the converter writes before every pack declares them (ComfyUI drops undeclared values).
PENDING_SAMPLER_INPUTS = ["sampler_name", "scheduler"]


@pytest.mark.parametrize("name", EXPECTED)
def test_the_ui_graphs_widget_values_line_up_with_the_nodes_widgets(name):
    """Each node's widgets_values, read in its widgets' order, are valid values for them (ComfyUI's frontend
    reads them by position): the committed UI graph against the pack's node definitions."""
    from test_workflows import is_wire, options_of, signature, value_ok

    ui = json.loads((ROOT / "workflows" / "templates" / f"{name}.json").read_text())
    for node in ui["nodes"]:
        if node["type"] in CORE:
            assert node["widgets_values"] and all(isinstance(v, str) for v in node["widgets_values"])
            continue
        inputs, _ = signature(node["type"])
        values = list(node["widgets_values"])
        for input_name, (kind, _) in inputs.items():
            if is_wire(kind):
                continue
            value, options = values.pop(0), options_of(node["type"], input_name)
            one_frame = (node["type"], input_name, value) == ("H3SparkTextToVideo", "length", 1)
            assert value_ok(kind, options, value, input_name) or (one_frame and options["min"] > 1), \
                (node["type"], input_name, value)
            if options.get("control_after_generate"):
                assert values.pop(0) in ("fixed", "randomize")
        if node["type"] == "H3SparkSampler":
            pending = [i for i in PENDING_SAMPLER_INPUTS if i not in inputs]
            assert len(values) == len(pending)  # written after the declared ones, in this order
            values = []
        assert not values, (node["type"], values)
