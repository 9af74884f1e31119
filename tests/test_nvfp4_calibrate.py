"""`h3-spark calibrate`, its promotion gate and H3_NVFP4_STATIC_SCALES (measure/nvfp4_calibration.py,
h3_model/engine/static_scales.py), on the demo's tiny random text encoder and a tiny DiT of hidden width 32, with
the NVFP4 reference emulation on the CPU.

Oracles: the observer's figures against the artifact (scale = amax / (448 x 6), exactly); the gate's ratios
recomputed from its own amax; for use, a request outside the calibrated shapes must give the very latents of
dynamic scales (bit for bit), one inside them other latents (the static path ran) within the quality budget.
Every bad input is refused with its message, before any model is built.
"""

import json
import sys
import types

import pytest
import torch

import h3_spark.kernels.attention as att
import h3_spark.kernels.capability as cap
import h3_spark.kernels.dispatch as dispatch
from h3_spark.cli import main
from h3_spark.cli.calibrate import synthetic_recipe
from h3_spark.errors import InputError
from h3_spark.h3_model.engine import static_scales as artifact
from h3_spark.h3_model.engine.engine import Engine
from h3_spark.h3_model.engine.loading import LoadOptions
from h3_spark.h3_model.pipeline.generation import GenerationRequest
from h3_spark.kernels import nvfp4 as nv
from h3_spark.kernels import nvfp4_static
from h3_spark.kernels.dispatch import block_linears
from h3_spark.kernels.settings import KernelSettings
from h3_spark.measure import nvfp4_calibration as cal

CANVAS = {"width": 64, "height": 64, "frames": 124, "steps": 3}  # 2 evaluations each
CALIB = [{"prompt": "a paper boat in the rain", "seed": 1, **CANVAS},
         {"prompt": "thunder over a city at night", "seed": 2, **CANVAS}]
HELD_OUT = [{"prompt": "a cat walks across a piano", "seed": 7, **CANVAS}]


def write_requests(path, items) -> str:
    path.write_text(json.dumps({"requests": items}))
    return str(path)


def cli(*argv) -> int:
    return main(["calibrate", "--synthetic", "tiny", "--quiet", *map(str, argv)])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("calibrate")
    calib, held = write_requests(d / "calib.json", CALIB), write_requests(d / "held.json", HELD_OUT)
    assert cli("--requests", calib, "--out", d / "scales.safetensors") == 0
    assert cli("--verify", d / "scales.safetensors", "--requests", held, "--out", d / "promoted.safetensors") == 0
    return {"dir": d, "calib": calib, "held": held, "raw": d / "scales.safetensors",
            "promoted": d / "promoted.safetensors"}


# ------------------------------------------------------------------------------------------ calibrate
def test_artifact_holds_the_scales_of_the_amax_seen_and_its_stamps(files):
    art = artifact.read(files["raw"])
    h = art.header
    assert h["model"] == artifact.recipe_hash(synthetic_recipe("tiny", 0))
    assert h["partition"] == "t2va" and h["gate"] is None and h["excluded"] == []
    assert h["shapes"] == [{"mode": "t2va", "width": 64, "height": 64, "frames": 124, "evaluations": 2}]
    assert h["calibration"]["requests"] == 2 and h["calibration"]["evaluations"] == 4
    assert h["kernel_settings"]["linear"] == KernelSettings().linear and len(h["commit"] or "x") > 0
    assert len(art.scales) == 12  # 2 blocks x 6 linears
    for name, layer in h["layers"].items():
        assert layer["calls"] == 4  # every evaluation of every request, q/k/v each once
        group_amax = max(h["layers"][n]["amax_max"] for n in nvfp4_static.sharing_group(name))
        assert art.scales[name] == pytest.approx(group_amax / (448 * 6), rel=1e-6)
        assert 0 < layer["amax_mean"] <= layer["amax_max"]
    q, k = art.scales["transformer_blocks.0.attn.to_q"], art.scales["transformer_blocks.0.attn.to_k"]
    assert q == k  # one input, one scale


def test_calibrates_an_nvfp4_file_from_its_stored_codes(files, tmp_path_factory, capsys):
    from h3_spark.h3_model.checkpoint.make import make_dit_checkpoint
    from h3_spark.h3_model.text.stand_in import TEXT_READ_LAYER
    from h3_spark.measure.synthetic import tiny_nvfp4_config

    d = tmp_path_factory.mktemp("nvfp4_file")
    dit, other = d / "dit.safetensors", d / "other.safetensors"
    make_dit_checkpoint(dit, tiny_nvfp4_config(), "nvfp4", "comfy", seed=0)
    make_dit_checkpoint(other, tiny_nvfp4_config(), "nvfp4", "comfy", seed=1)
    te = d / "te.safetensors"
    assert main(["make-checkpoint", str(te), "--component", "text_encoder", "--preset", "tiny"]) == 0
    models = ["--text-encoder", str(te), "--tokenizer", str(d / "te.tokenizer"), "--text-encoder-layer",
              str(TEXT_READ_LAYER), "--quiet"]
    out = d / "scales.safetensors"
    assert main(["calibrate", "--dit", str(dit), *models, "--requests", files["calib"], "--out", str(out)]) == 0
    h = artifact.read(out).header
    assert h["model"] == artifact.model_hash(dit) and h["model"]["method"] == "sampled-sha256-v1"
    assert h["linear_sources"] == {"NVFP4 checkpoint, used as stored": 12}
    capsys.readouterr()
    assert main(["calibrate", "--dit", str(other), *models, "--verify", str(out), "--requests", files["held"]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"h3-spark calibrate: error: --verify {out}: stale: calibrated on model "
                          f"{h['model']['hash'][:16]} (sampled-sha256-v1, {dit}), this DiT is ")


def test_model_hash_reads_samples_of_a_large_file(tmp_path, monkeypatch):
    monkeypatch.setattr(artifact, "_MIB", 16)  # "large" = over 64 x 16 bytes here
    gen = torch.Generator().manual_seed(0)
    data = bytearray(torch.randint(0, 256, (5000,), generator=gen, dtype=torch.uint8).numpy().tobytes())
    f = tmp_path / "m.safetensors"
    f.write_bytes(bytes(data))
    base = artifact.model_hash(f)["hash"]
    for where, changes in ((10, True), (4999, True), (8 * 16 + 1, True), (8 * 16 + 30, False)):
        edited = bytearray(data)
        edited[where] ^= 0xFF
        f.write_bytes(bytes(edited))
        assert (artifact.model_hash(f)["hash"] != base) == changes, where
    f.write_bytes(bytes(data) + b"x")  # the size is part of it
    assert artifact.model_hash(f)["hash"] != base


# ------------------------------------------------------------------------------------------ the gate
def test_gate_promotes_and_records_its_figures(files):
    art = artifact.read(files["promoted"])
    g = art.gate
    assert g["verdict"] == "promoted" and g["limit"] == 1.0 and g["static_layers"] == 12
    assert g["failing_layers"] == {} and g["excluded_layers"] == []
    assert 0 < g["max_ratio"] <= 1.0 and g["max_ratio"] == pytest.approx(max(g["ratios"].values()), rel=1e-5)
    drift = g["velocity_drift"]
    assert drift["evaluations"] == 2 and 0 < drift["max"] <= drift["budget"] == cal.quality_budget()
    assert g["held_out"]["requests"] == 1
    assert art.scales == artifact.read(files["raw"]).scales


def test_gate_refuses_over_the_limit_and_excludes_on_request(files, capsys):
    ratios = artifact.read(files["promoted"]).gate["ratios"]
    limit = sorted(ratios.values())[len(ratios) // 2]  # about half the layers over it
    out = files["dir"] / "refused.safetensors"
    assert cli("--verify", files["raw"], "--requests", files["held"], "--limit", limit, "--out", out) == 1
    g = artifact.read(out).gate
    failing = {n for n, r in g["ratios"].items() if r > limit}
    assert g["verdict"] == "refused" and set(g["failing_layers"]) == failing and failing
    assert g["why"].startswith(f"{len(failing)} layer(s) over the limit {limit:g}")
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["verdict"] == "refused" and set(summary["failing_layers"]) == failing

    out2 = files["dir"] / "excluded.safetensors"
    assert cli("--verify", files["raw"], "--requests", files["held"], "--limit", limit, "--exclude-failing",
               "--out", out2) == 0
    art = artifact.read(out2)
    want = {m for n in failing for m in nvfp4_static.sharing_group(n)}
    assert art.excluded == want and art.gate["verdict"] == "promoted" and art.gate["passes"] == 2
    assert art.gate["static_layers"] == 12 - len(want)


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("item, message", [
    ({"prompt": "x", "width": 100, "height": 64}, "request 0: width and height must be multiples of 32, got 100x64 (nearest valid: 96x64)"),
    ({"prompt": "x", "width": 640, "height": 64}, "request 0: aspect ratio 640:64 (10) is outside 1:4 .. 4:1"),
    ({"prompt": "x", "frames": 30}, "request 0: 30 frames snaps to 39 (1.62 s); H3 generates 124..345 frames (5-15 s at 24 fps; "
                                  "nearest valid: 124 frames, 5.17 s)"),
    ({"prompt": "x", "mode": "ref2va"}, "request 0: mode 'ref2va': calibration requests are t2va"),
    ({"prompt": "x", "canvas": 3}, "request 0: unknown field(s) ['canvas']"),
])
def test_requests_h3_does_not_accept_are_refused(tmp_path, capsys, item, message):
    path = write_requests(tmp_path / "bad.json", [item])
    assert cli("--requests", path, "--out", tmp_path / "a.safetensors") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"h3-spark calibrate: error: calibration file {path}: {message}")
    assert "\n" not in err and not (tmp_path / "a.safetensors").exists()


def test_flags_of_the_other_step_are_refused(files, tmp_path, capsys):
    assert cli("--requests", files["calib"], "--out", tmp_path / "a.safetensors", "--limit", "0.9") == 2
    assert capsys.readouterr().err.strip().endswith("error: --limit and --exclude-failing belong to --verify")
    assert cli("--verify", files["raw"], "--requests", files["held"], "--margin", "1.5") == 2
    assert capsys.readouterr().err.strip().endswith("error: --margin belongs to calibration (the artifact's scales "
                                                    "are verified as they are)")
    assert cli("--requests", files["calib"], "--out", files["raw"]) == 2
    assert capsys.readouterr().err.strip().endswith(f"error: --out {files['raw']} exists; add --force to replace it")
    assert cli("--requests", files["calib"], "--out", tmp_path / "a.safetensors", "--margin", "0.5") == 2
    assert capsys.readouterr().err.strip().endswith("error: --margin must be a finite number >= 1.0 (a range below "
                                                    "the calibrated amax saturates), got 0.5")


def test_zero_held_out_requests_are_refused(files, tmp_path, capsys):
    path = write_requests(tmp_path / "none.json", [])
    assert cli("--verify", files["raw"], "--requests", path) == 2
    assert capsys.readouterr().err.strip() == (f"h3-spark calibrate: error: held-out file {path}: zero requests; "
                                               "give at least one")


def test_held_out_requests_must_be_new_and_on_calibrated_shapes(files, tmp_path, capsys):
    assert cli("--verify", files["raw"], "--requests", files["calib"], "--out", tmp_path / "x.safetensors") == 2
    assert "request 0 is one of the calibration requests" in capsys.readouterr().err
    other = write_requests(tmp_path / "other.json", [{**HELD_OUT[0], "width": 128}])
    assert cli("--verify", files["raw"], "--requests", other, "--out", tmp_path / "x.safetensors") == 2
    assert capsys.readouterr().err.strip().endswith(
        "request 0 (t2va-128x64-124f-2ev) is outside the calibrated shapes (t2va-64x64-124f-2ev)")


def test_artifact_of_another_model_or_partition_is_refused(files, tmp_path, capsys):
    assert main(["calibrate", "--synthetic", "tiny", "--seed", "3", "--quiet", "--verify", str(files["raw"]),
                 "--requests", files["held"], "--out", str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"h3-spark calibrate: error: --verify {files['raw']}: stale: calibrated on model ")
    assert "synthetic:tiny:dit-hidden-32:seed=0" in err and "seed=3" in err
    art = artifact.read(files["raw"])
    ref = tmp_path / "ref.safetensors"
    artifact.write(ref, {**art.header, "partition": "ref2va"}, art.scales)
    assert cli("--verify", ref, "--requests", files["held"], "--out", tmp_path / "x.safetensors") == 2
    assert capsys.readouterr().err.strip() == (f"h3-spark calibrate: error: --verify {ref}: stale: calibrated on the "
                                               "ref2va partition, this DiT is the t2va partition")


def tampered(src, dst, edit) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    edit(meta, tensors)
    save_file(tensors, str(dst), metadata=meta)


def test_tampered_artifact_is_refused(files, tmp_path, capsys):
    def promote(meta, tensors):  # an edited verdict
        h = json.loads(meta[artifact.HEADER_KEY])
        h["gate"] = {"verdict": "promoted"}
        meta[artifact.HEADER_KEY] = json.dumps(h)

    def rescale(meta, tensors):  # an edited scale
        tensors["transformer_blocks.1.ff.net.2.input_scale"] *= 2

    for i, edit in enumerate((promote, rescale)):
        bad = tmp_path / f"bad{i}.safetensors"
        tampered(files["promoted"], bad, edit)
        assert cli("--verify", bad, "--requests", files["held"], "--out", tmp_path / "x.safetensors") == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"h3-spark calibrate: error: --verify {bad}: corrupted: content hash ")
        assert err.endswith("(the file changed after it was written)")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(files["promoted"].read_bytes()[:-7])
    assert cli("--verify", cut, "--requests", files["held"], "--out", tmp_path / "x.safetensors") == 2
    assert f"--verify {cut}: corrupted: not a readable safetensors file" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ use
class FakeKitchen:
    """comfy-kitchen with only the FP4 GEMM's name: the engine's linears run the emulation (set below), so it is
    never called; it lets H3_LINEAR=nvfp4 resolve on a pretend Blackwell."""

    def __init__(self):
        self.module = types.ModuleType("comfy_kitchen")
        self.module.scaled_mm_nvfp4 = self.scaled_mm_nvfp4

    def scaled_mm_nvfp4(self, *args, **kwargs):
        raise AssertionError("the emulated linears do not call the FP4 GEMM")


@pytest.fixture
def blackwell(monkeypatch):
    for module in (cap, dispatch, att):
        monkeypatch.setattr(module, "capability", lambda device: (10, 0))
        monkeypatch.setattr(module, "describe_device", lambda device: "pretend B200 (sm_100)")
    monkeypatch.setattr(dispatch, "require_triton", lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "comfy_kitchen", FakeKitchen().module)


def engine_with(path, seed: int = 0, linear: str = "nvfp4") -> Engine:
    from h3_spark.measure.synthetic import synthetic_dit, synthetic_text_encoder, tiny_nvfp4_config

    settings = KernelSettings(attention="sdpa", linear=linear, swiglu_nvfp4_fusion="off", modulation_fusion="off",
                              q_rms_rope_int8_fusion="off", nvfp4_static_scales=str(path) if path else "")
    engine = Engine(options=LoadOptions(kernels=settings), overrides={
        "dit": lambda: synthetic_dit(tiny_nvfp4_config(), torch.bfloat16, "cpu", seed=seed)})
    engine.model_ids["dit"] = synthetic_recipe("tiny", seed)
    engine.components.text_encoder = synthetic_text_encoder("tiny", "cpu", torch.bfloat16, seed)
    return engine


def run_emulated(engine, item) -> tuple[torch.Tensor, dict]:
    for m in block_linears(engine.components.dit).values():
        m.emulate = True  # the CPU's stand-in for the FP4 GEMM; the static scales are what is tested
    engine.pipeline.decode = False
    result = engine.generate(GenerationRequest(mode="t2va", **item))
    return result.video_latents, result.info


def test_promoted_artifact_runs_static_on_its_shapes_and_dynamic_elsewhere(files, blackwell):
    engine = engine_with(files["promoted"]).load(["t2va"], dit_only=True)
    lin = engine.kernel_reports["dit"]["linear"]
    assert lin["static_scales"]["static_layers"] == 12 and lin["static_scales"]["calibrated_shapes"] == [
        "t2va-64x64-124f-2ev"]
    dynamic = engine_with(None).load(["t2va"], dit_only=True)

    inside = HELD_OUT[0]
    got, info = run_emulated(engine, inside)
    want, want_info = run_emulated(dynamic, inside)
    assert "nvfp4_static_scales" not in want_info
    s = info["nvfp4_static_scales"]
    assert s["static"] is True and s["shape"] == "t2va-64x64-124f-2ev" and s["saturated_blocks"] >= 0
    assert not torch.equal(got, want)  # the static scales were used ...
    assert ((got - want).norm() / want.norm()).item() < 0.05  # ... and stay close to dynamic

    outside = {**inside, "width": 96}
    got, info = run_emulated(engine, outside)
    want, _ = run_emulated(dynamic, outside)
    s = info["nvfp4_static_scales"]
    assert s["static"] is False and s["note"] == ("t2va-96x64-124f-2ev is outside the calibrated shapes "
                                                  "(t2va-64x64-124f-2ev): this request ran dynamic NVFP4 scales")
    assert torch.equal(got, want) and s["saturated_blocks"] == 0
    assert all(m.static_on for m in block_linears(engine.components.dit).values())


def load_error(path, seed=0, linear="nvfp4") -> str:
    with pytest.raises(InputError) as exc:
        engine_with(path, seed, linear).load(["t2va"], dit_only=True)
    assert "\n" not in str(exc.value)
    return str(exc.value)


def test_use_refuses_missing_unpromoted_stale_and_corrupted_artifacts(files, blackwell, tmp_path, monkeypatch):
    src = "H3_NVFP4_STATIC_SCALES"
    built = []
    monkeypatch.setattr(Engine, "_configure", lambda self, name, model: built.append(name))
    assert load_error(tmp_path / "nope.safetensors") == f"{src} {tmp_path / 'nope.safetensors'}: no such file"
    assert load_error(files["raw"]).startswith(f"{src} {files['raw']}: not promoted: no gate verdict yet")
    refused = tmp_path / "refused.safetensors"
    art = artifact.read(files["promoted"])
    artifact.write(refused, {**art.header, "gate": {**art.gate, "verdict": "refused", "why": "2 layer(s) over"}},
                   art.scales)
    assert load_error(refused) == f"{src} {refused}: not promoted: the gate refused it (2 layer(s) over)"
    assert load_error(files["promoted"], seed=5).startswith(f"{src} {files['promoted']}: stale: calibrated on model ")
    ref = tmp_path / "ref.safetensors"
    artifact.write(ref, {**art.header, "partition": "ref2va"}, art.scales)
    assert load_error(ref) == f"{src} {ref}: calibrated for the ref2va partition, which this run does not load"
    bad = tmp_path / "bad.safetensors"
    tampered(files["promoted"], bad, lambda meta, t: t.update({k: v * 0.5 for k, v in t.items()}))
    assert load_error(bad).startswith(f"{src} {bad}: corrupted: content hash ")
    assert load_error(files["promoted"], linear="bf16") == (
        f"{src} {files['promoted']}: static scales are for NVFP4 linears, and the t2va DiT's linears run bf16 here "
        "(requested: exact, model dtype); unset H3_NVFP4_STATIC_SCALES or run NVFP4 (Blackwell)")
    assert built == []  # every refusal came before a model was built


def test_stale_layer_shapes_are_refused_at_install(files, blackwell):
    art = artifact.read(files["promoted"])
    layers = {**art.header["layers"]}
    layers["transformer_blocks.0.ff.net.2"] = {**layers["transformer_blocks.0.ff.net.2"], "shape": [32, 128]}
    with pytest.raises(InputError, match=r"stale: transformer_blocks.0.ff.net.2 was calibrated as \[32, 128\], "
                                         r"this DiT's is \[32, 64\]$"):
        artifact.check_layers(artifact.Artifact(art.path, {**art.header, "layers": layers}, art.scales),
                              {n: v["shape"] for n, v in art.header["layers"].items()}, "H3_NVFP4_STATIC_SCALES")


def test_env_variable_keeps_the_paths_case():
    s = KernelSettings.from_env({"H3_NVFP4_STATIC_SCALES": " /Data/Scales.safetensors "})
    assert s.nvfp4_static_scales == "/Data/Scales.safetensors" and KernelSettings.from_env({}).nvfp4_static_scales == ""
    assert isinstance(nv.StaticInput.of(1.0, "cpu").scale, torch.Tensor)
