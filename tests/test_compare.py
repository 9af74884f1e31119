"""`h3-spark compare` and the schema of the receipts in receipts/h200/."""

import copy
import json
from pathlib import Path

import pytest

from h3_spark.cli import main

ROOT = Path(__file__).resolve().parents[1]
RECEIPTS = ROOT / "receipts" / "h200"
BENCH = sorted(p for p in RECEIPTS.glob("*-960x544-124f.*.json") if ".sp2." not in p.name)


def _result(name="t2va-960x544-124f.auto.json"):
    return json.loads((RECEIPTS / name).read_text())


def _compare(tmp_path, capsys, result, *extra):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    code = main(["compare", "--result", str(path), *extra])
    return code, capsys.readouterr()


def test_exact_receipt_misses_only_the_speed_target(tmp_path, capsys):
    code, out = _compare(tmp_path, capsys, _result())
    assert code == 1
    lines = {line.split()[0]: line for line in out.out.splitlines()[2:-1]}
    assert lines["dit_forward_s_median"].endswith("FAIL")  # 2.07 s against the 1.95 s target
    for metric in ("sequence_length", "peak_gpu_memory_gb", "velocity_rel_l2_vs_diffusers", "speedup_vs_diffusers"):
        assert lines[metric].endswith("ok"), lines[metric]


def test_passes_when_every_limit_holds(tmp_path, capsys):
    result = _result()
    result["dit_forward_s_median"] = 1.9
    code, out = _compare(tmp_path, capsys, result)
    assert code == 0 and out.out.strip().endswith("PASS")


@pytest.mark.parametrize("change,message", [
    (lambda r: r.pop("stamp"), "required"),
    (lambda r: r.pop("noise_floor_rel_l2"), "no noise floor measured"),
    (lambda r: r.update(peak_gpu_memory_gb=99.0), "peak_gpu_memory_gb"),
    (lambda r: r["backends"]["attention"].update(requested="fa3_fp8"), "asked for fa3_fp8, ran fa3"),
    (lambda r: r["backends"]["settings"].update(linear="fp8"), "asked for fp8, ran bf16"),
    # The backend check cannot be skipped: no request, no record of what ran, or no backends at all fail.
    (lambda r: r["backends"].pop("settings"), "settings: no record of the attention backend asked for"),
    (lambda r: (r["backends"]["settings"].update(attention="fa3_fp8"), r["backends"].pop("attention")),
     "attention: no record of the backend that ran"),
    (lambda r: (r["backends"]["settings"].update(attention="fa3_fp8"),
                r["backends"]["attention"].update(requested="auto", chosen="sdpa")),
     "settings ask for fa3_fp8, the record says auto was requested"),
    (lambda r: r["backends"]["attention"].pop("chosen"), "the record names no backend that ran"),
    (lambda r: r.update(backends="fa3"), 'not an object: "fa3"'),
    (lambda r: r.update(backends={}), "settings: no record of the attention backend asked for"),
    (lambda r: r["backends"].pop("linear"), "linear: asked for auto, ran None"),
    (lambda r: (r["backends"]["settings"].update(modulation_fusion="exact"),
                r["backends"]["modulation"].update(impl="pytorch-reference")),
     "modulation: asked for the fused kernels (exact), ran pytorch-reference"),
    # Present is not enough: the required fields must hold what a receipt needs.
    (lambda r: r.update(stamp={}), "lacks time_utc and software"),
    (lambda r: r.update(weights=""), 'not a non-empty string: ""'),
])
def test_fails_closed(tmp_path, capsys, change, message):
    result = copy.deepcopy(_result())
    result["dit_forward_s_median"] = 1.9
    change(result)
    code, out = _compare(tmp_path, capsys, result)
    assert code == 1 and message in out.out


@pytest.mark.parametrize("field,value,shown", [
    ("dit_forward_s_median", "fast", '"fast"'),
    ("peak_gpu_memory_gb", True, "true"),
    ("sequence_length", "19540", '"19540"'),
    ("noise_floor_rel_l2", [0.04], "[0.04]"),
])
def test_malformed_numbers_are_input_errors(tmp_path, capsys, field, value, shown):
    result = _result()
    result[field] = value
    code, out = _compare(tmp_path, capsys, result)
    assert code == 2 and "Traceback" not in out.err
    assert f"result field '{field}' must be a number, got {shown}" in out.err


@pytest.mark.parametrize("change,message", [
    (lambda c: c["limits"].update(dit_forward_s_median={"Max": 0.01}),
     "limit 'dit_forward_s_median' has unknown key(s) Max; use equals, max, min, max_ratio_to_noise_floor"),
    (lambda c: c["limits"].update(dit_forward_s_median=0.01),
     'limit \'dit_forward_s_median\' must be an object such as {"max": 1.5}, got 0.01'),
    (lambda c: c["limits"].update(dit_forward_s_median={}), "must be an object such as"),
    (lambda c: c["limits"].update(dit_forward_s_median={"max": "1.95"}),
     "limit 'dit_forward_s_median' max must be a number, got \"1.95\""),
    (lambda c: c.update(limits={}), "limits must be a non-empty object of metric -> rule, got {}"),
])
def test_contract_limits_must_be_rules_we_check(tmp_path, capsys, change, message):
    contract = json.loads((ROOT / "benchmarks" / "t2va-960x544-124f.json").read_text())
    change(contract)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(contract))
    code, out = _compare(tmp_path, capsys, _result(), "--contract", str(path))
    assert code == 2 and message in out.err and "Traceback" not in out.err


def test_compare_input_errors(tmp_path, capsys):
    assert main(["compare", "--result", str(tmp_path / "none.json")]) == 2
    assert "no such result file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    assert main(["compare", "--result", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    bad.write_text(json.dumps({"dit_forward_s_median": 1.0}))
    assert main(["compare", "--result", str(bad)]) == 2
    assert "names no contract" in capsys.readouterr().err
    # A contract the checkout's benchmarks/ does not hold (or no checkout: an installed wheel has none beside it).
    bad.write_text(json.dumps({**_result(), "contract": "t2va-1x1-1f"}))
    assert main(["compare", "--result", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"the result names contract 't2va-1x1-1f', which is not in {ROOT / 'benchmarks'}" in err
    assert "pass its file with --contract" in err


@pytest.mark.parametrize("path", BENCH, ids=lambda p: p.name)
def test_bench_receipts_schema(path):
    r = json.loads(path.read_text())
    for key in ("contract", "sequence_length", "dit_forward_s_median", "dit_forward_s_all", "peak_gpu_memory_gb",
                "weights", "backends", "stamp", "limits", "velocity_rel_l2_vs_diffusers", "noise_floor_rel_l2",
                "diffusers"):
        assert key in r, key
    assert "synthetic" in r["weights"]
    stamp = r["stamp"]
    for when in ("gpu_before", "gpu_after"):
        for field in ("name", "driver_version", "clocks.sm", "clocks.mem", "power.limit"):
            assert stamp[when][field], (when, field)
    assert stamp["gpu_before"]["name"] == "NVIDIA H200"
    for field in ("torch", "cuda", "triton"):
        assert stamp["software"][field], field
    # The GPU machine gets the working tree without .git: the commit comes from H3_GIT_COMMIT when the
    # run set it (the first runs did not; docs/perf-notes.md names their commits).
    assert "h3_spark_commit" in stamp["software"]
    assert len(r["diffusers"]["blockwise_rel_l2"]) == 50


@pytest.mark.parametrize("path", sorted(RECEIPTS.glob("*.sp2.json")), ids=lambda p: p.name)
def test_parallel_receipts_schema(path):
    r = json.loads(path.read_text())
    assert r["world_size"] == 2 and r["speedup"] == pytest.approx(r["one_gpu_forward_s_median"] /
                                                                   r["split_forward_s_median"])
    assert r["velocity_rel_l2_split_vs_one_gpu"] <= 1e-5 and r["stamp"]["gpu_before"]["name"] == "NVIDIA H200"


def _exact_contracts(paths) -> set[str]:
    """Contracts with a receipt that says it ran exact; a receipt that does not say so does not count."""
    receipts = [json.loads(p.read_text()) for p in paths]
    return {r["contract"] for r in receipts if r["backends"].get("exact") is True}


def test_both_contracts_have_an_exact_receipt():
    assert {"t2va-960x544-124f", "ref2va-960x544-124f"} <= _exact_contracts(BENCH)


def test_a_receipt_without_exact_is_not_counted_as_exact(tmp_path):
    silent = tmp_path / "silent.json"
    silent.write_text(json.dumps({"contract": "x", "backends": {"attention": "sdpa"}}))
    said = tmp_path / "said.json"
    said.write_text(json.dumps({"contract": "y", "backends": {"exact": True}}))
    assert _exact_contracts([silent, said]) == {"y"}


@pytest.mark.parametrize("path", sorted(RECEIPTS.glob("vs-exact-*.json")), ids=lambda p: p.name)
def test_vs_exact_receipts_schema(path):
    r = json.loads(path.read_text())
    assert "synthetic" in r["weights"]
    assert r["stamp"]["gpu_before"]["name"] == "NVIDIA H200" and "h3_spark_commit" in r["stamp"]["software"]
    v = r["vs_exact"]
    assert v["speedup_vs_exact"] == pytest.approx(v["exact_forward_s_median"] / v["fast_forward_s_median"])
    assert len(v["per_block_rel_l2"]) == 50 and v["approximate_paths"]
    # What the verdict claims holds against the budget written beside it.
    assert v["verdict"].startswith("eligible") == (v["final_velocity_rel_l2_vs_exact"]
                                                   <= v["budget"]["final_velocity_rel_l2"])
