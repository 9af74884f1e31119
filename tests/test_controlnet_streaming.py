"""The ControlNet tower under a VRAM budget (emulated on the CPU): its blocks stream through the DiT's BlockStream,
the plan says how many stay resident, and a room below the fully streamed tower is refused naming the minimum.

Exactness: the same tensors and the same ops, so a streamed tower's output equals the resident one's bit for bit.
"""

import copy

import pytest
import torch

from h3_spark.errors import InputError
from h3_spark.h3_model.controlnet.tower import ControlInjection
from h3_spark.h3_model.engine.memory import gb, measure_tower, plan_tower, streamed_minimum, tower_room
from h3_spark.h3_model.engine.placement import place_tower
from test_controlnet_tower import DIT, _args, _dit, _tower, case  # noqa: F401 (the fixture)

PLACES = (0, 1, 2, 3)


def _room(plan, resident):
    """Room for `resident` blocks beside the streamed minimum (AdaLN projections in host memory)."""
    return streamed_minimum(plan) + sum(plan.blocks[:resident])


@pytest.mark.parametrize("resident", [0, 1, 3])
def test_a_streamed_tower_gives_the_resident_output_bit_for_bit(case, resident):
    lay, data, hint = case
    dit, tower = _dit(DIT), _tower(DIT, PLACES)
    streamed = copy.deepcopy(tower)
    args = [_args(lay, data, 0.3), _args(lay, data, 0.6)]  # two forwards: the copies wrap to the next one's
    with torch.no_grad():
        dit.control = ControlInjection(tower, hint, strength=0.7)
        want = [dit(**a) for a in args]
        plan = plan_tower(streamed, _room(measure_tower(streamed), resident))
        assert (plan.resident_blocks, len(plan.streamed), plan.adaln_on_host) == (resident, 4 - resident, True)
        stream = place_tower(streamed, plan, "cpu")
        assert streamed.block_stream is stream and sorted(stream.units) == list(range(resident, 4))
        dit.control = ControlInjection(streamed, hint, strength=0.7)
        got = [dit(**a) for a in args]
    for g, w in zip(got, want):
        assert all(torch.equal(x, y) for x, y in zip(g, w))
    assert stream.stats.copies >= 2 * (4 - resident)  # every streamed block visited in each forward
    # Between turns a streamed block holds nothing: its weights live in the host buffer only.
    assert all(p.numel() == 0 for i in stream.units for p in streamed.control_blocks[i].attn.parameters())


def test_the_plan_counts_resident_and_streamed_blocks():
    tower = _tower(DIT, PLACES)
    whole = measure_tower(tower)
    assert whole.resident_blocks == 4 and not whole.streaming
    assert plan_tower(tower, None).resident_blocks == 4
    assert plan_tower(tower, whole.device_bytes).describe()["streamed_blocks"] == 0
    plan = plan_tower(tower, _room(whole, 2) + 1)
    described = plan.describe()
    assert (described["resident_blocks"], described["streamed_blocks"], described["adaln_in_host_memory"]) == (2, 2, True)
    assert plan.device_bytes <= _room(whole, 2) + 1 < plan.device_bytes + whole.blocks[2]
    # Its numbers are the packed blocks', and the slots hold the largest streamed unit.
    assert described["slot_bytes"] == 2 * max(whole.blocks[2:] + whole.adaln)
    assert described["host_bytes"] == sum(whole.blocks[2:]) + sum(whole.adaln)


def test_a_room_below_the_streamed_tower_is_refused_naming_the_minimum():
    tower = _tower(DIT, PLACES)
    least = streamed_minimum(measure_tower(tower))
    plan_tower(tower, least)  # exactly the minimum runs
    with pytest.raises(InputError, match=rf"leaves the ControlNet .* below the {gb(least)} its tower needs with every "
                                         r"block streamed: .* 2 block slots of .*--prefetch-depth"):
        plan_tower(tower, least - 1)
    assert all(p.numel() > 0 for p in tower.parameters())  # refused before anything moved
    with pytest.raises(InputError, match="prefetch depth must be at least 1, got 0"):
        plan_tower(tower, least, depth=0)


def test_the_tower_room_is_what_the_dit_plans_leave():
    from h3_spark.h3_model.engine.memory import GB, MemoryPlan, slack

    a = MemoryPlan(20 * GB, 1 * GB, [2 * GB] * 4, [0] * 4, 3 * GB, 64, resident_blocks=4)
    b = MemoryPlan(20 * GB, 1 * GB, [1 * GB] * 4, [0] * 4, 4 * GB, 64, resident_blocks=4)
    # weights 9 + 5 GB (all resident); the larger of the activations (4) and the other stages' 2 GB; 1 GB of slack
    assert tower_room(20 * GB, [a, b], 2 * GB) == 20 * GB - slack(20 * GB) - 14 * GB - 4 * GB
    assert tower_room(20 * GB, [a, b], 5 * GB) == 20 * GB - slack(20 * GB) - 14 * GB - 5 * GB


def test_the_host_budget_counts_the_streamed_tower():
    from h3_spark.h3_model.engine.memory import check_host

    tower = _tower(DIT, PLACES)
    plan = plan_tower(tower, _room(measure_tower(tower), 1))
    held = sum(plan.blocks[1:]) + sum(plan.adaln)
    report = check_host(None, [], None, [], tower=plan)
    assert report["controlnet_streamed_bytes"] == held == report["held_bytes"]
    with pytest.raises(InputError, match=rf"host memory budget .* below .* {gb(held)}: 0.0 MB of streamed DiT blocks "
                                         rf"\(page-locked\), {gb(held)} of streamed ControlNet blocks"):
        check_host(held - 1, [], None, [], tower=plan)
    check_host(held, [], None, [], tower=plan)
