"""The engine's choice of CUDA allocator segments: expandable unless the environment chose, reported either way."""

import pytest

from h3_spark.h3_model.engine import cuda_allocator


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(cuda_allocator, "_chosen", None)
    for name in cuda_allocator.ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


def test_unset_environment_gets_expandable_segments():
    calls = []
    chosen = cuda_allocator.choose_allocator("cuda:0", set_settings=calls.append)
    assert calls == ["expandable_segments:True"]
    assert chosen["segments"] == "expandable_segments:True" and chosen["by"] == "h3-spark"
    assert cuda_allocator.chosen() is chosen
    # A second engine in the process does not set it again.
    assert cuda_allocator.choose_allocator("cuda", set_settings=calls.append) is chosen
    assert calls == ["expandable_segments:True"]


@pytest.mark.parametrize("name", cuda_allocator.ENV_NAMES)
def test_a_chosen_allocator_is_left_alone_and_named(monkeypatch, name):
    # ComfyUI chooses its allocator through this variable (backend:cudaMallocAsync).
    monkeypatch.setenv(name, "backend:cudaMallocAsync")
    calls = []
    chosen = cuda_allocator.choose_allocator("cuda", set_settings=calls.append)
    assert calls == []
    assert chosen == {"segments": "backend:cudaMallocAsync", "by": f"the environment ({name})"}


def test_cpu_models_leave_the_allocator_alone():
    calls = []
    assert cuda_allocator.choose_allocator("cpu", set_settings=calls.append) == {
        "segments": "not used", "by": "the models run on cpu"}
    assert calls == [] and cuda_allocator.chosen() is None


def test_engine_load_chooses_before_the_first_component_is_built(monkeypatch):
    from h3_spark.h3_model.engine import engine as engine_module
    from h3_spark.h3_model.engine.engine import Engine
    from h3_spark.h3_model.engine.loading import LoadOptions

    order = []
    monkeypatch.setattr(engine_module, "choose_allocator", lambda device: order.append(("allocator", device)))

    def build_failing():
        order.append(("build", "dit"))
        raise RuntimeError("stop after the first build")

    engine = Engine(options=LoadOptions(device="cuda:1"), overrides={"dit": build_failing})
    monkeypatch.setattr(engine, "preflight", lambda plan: None)
    monkeypatch.setattr(engine, "_resolve_auto_budget", lambda plan: None)
    with pytest.raises(RuntimeError, match="stop after the first build"):
        engine.load(["t2va"], dit_only=True)
    assert order == [("allocator", "cuda:1"), ("build", "dit")]
