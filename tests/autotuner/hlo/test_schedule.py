"""The schedule estimate (`autotuner.hlo.schedule`) on hand-written scheduled modules: each figure
here is worked out by hand from the module and the chip's constants (no libtpu needed)."""

from __future__ import annotations

import pytest

from autotuner.hlo.chips import CHIPS, Chip, ChipError, chip_for
from autotuner.hlo.schedule import Placement, estimate

# round numbers: 1 GHz, 1 GB/s a link direction, 10 GB/s HBM, 1 us a transfer step
CHIP = Chip("test", "test", 1e9, "test", 1e15, 1e9, 10e9, 1, hop_latency_s=1e-6)
MB4 = 1024 * 1024 * 4  # bytes of an f32[1024,1024]
LINE = Placement(((0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0)))

DOT_COMP = """
%fc (x: f32[1024,1024]) -> f32[1024,1024] {
  %x = f32[1024,1024]{1,0} parameter(0)
  ROOT %c = f32[1024,1024]{1,0} convolution(%x, %x), dim_labels=bf_io->bf
}
"""


def module(entry: str, extra: str = "") -> str:
    return (f"HloModule m, is_scheduled=true, num_partitions=4\n{DOT_COMP}{extra}\n"
            f"ENTRY %main (a: f32[1024,1024]) -> f32[1024,1024] {{\n{entry}\n}}\n")


def test_an_async_permute_overlaps_the_dot_scheduled_inside_it():
    text = module("""  %a = f32[1024,1024]{1,0} parameter(0)
  %cp = (f32[1024,1024]{1,0}, f32[1024,1024]{1,0}, u32[], u32[]) collective-permute-start(%a), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3}}
  %f = f32[1024,1024]{1,0} fusion(%a), kind=kOutput, calls=%fc, backend_config={"estimated_cycles":"1000000"}
  %d = f32[1024,1024]{1,0} collective-permute-done(%cp)
  ROOT %r = f32[1024,1024]{1,0} add(%f, %d), backend_config={"estimated_cycles":"1000"}""")
    e = estimate(text, CHIP, LINE)
    transfer = 1e-6 + MB4 / 1e9            # each link carries one block: neighbours on a line
    assert e.compute_s == pytest.approx(1e-3 + 1e-6)
    assert e.collective_s == pytest.approx(transfer)
    assert e.exposed_s == pytest.approx(transfer - 1e-3)   # the dot hid 1 ms of it
    assert e.estimated_s == pytest.approx(transfer + 1e-6)
    assert (e.collectives, e.async_collectives, e.overlapped_collectives) == (1, 1, 1)
    assert e.hidden_fraction == pytest.approx(1e-3 / transfer)


def test_a_synchronous_gather_is_a_bidirectional_ring_that_blocks():
    text = module("""  %a = f32[1024,1024]{1,0} parameter(0)
  %g = f32[4096,1024]{1,0} all-gather(%a), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %f = f32[1024,1024]{1,0} fusion(%g), kind=kOutput, calls=%fc, backend_config={"estimated_cycles":"1000000"}""")
    e = estimate(text, CHIP, LINE)
    ring = 3 * (1e-6 + (4 * MB4) / 4 / (2 * 1e9))   # n-1 steps of 1/n of the result, both directions
    assert e.collective_s == pytest.approx(ring)
    assert e.exposed_s == pytest.approx(ring)
    assert e.estimated_s == pytest.approx(ring + 1e-3)
    assert (e.async_collectives, e.overlapped_collectives) == (0, 0)


def test_transfers_that_need_the_same_link_run_one_after_the_other():
    # 0 -> 2 crosses the links 0 -> 1 and 1 -> 2 (dimension order on a line); 1 -> 3, issued next,
    # needs 1 -> 2 too and waits for it; 1 -> 0 goes the other way and does not wait. No dot is
    # scheduled inside any of them: none overlapped.
    text = module("""  %a = f32[1024,1024]{1,0} parameter(0)
  %x = (f32[1024,1024]{1,0}, f32[1024,1024]{1,0}, u32[], u32[]) collective-permute-start(%a), channel_id=1, source_target_pairs={{0,2}}
  %z = (f32[1024,1024]{1,0}, f32[1024,1024]{1,0}, u32[], u32[]) collective-permute-start(%a), channel_id=2, source_target_pairs={{1,3}}
  %y = (f32[1024,1024]{1,0}, f32[1024,1024]{1,0}, u32[], u32[]) collective-permute-start(%a), channel_id=3, source_target_pairs={{1,0}}
  %dy = f32[1024,1024]{1,0} collective-permute-done(%y)
  %dx = f32[1024,1024]{1,0} collective-permute-done(%x)
  ROOT %dz = f32[1024,1024]{1,0} collective-permute-done(%z)""")
    e = estimate(text, CHIP, LINE)
    one = 1e-6 + MB4 / 1e9
    assert e.estimated_s == pytest.approx(2 * one)     # z after x; y beside them
    assert e.exposed_s == pytest.approx(2 * one)
    assert (e.async_collectives, e.overlapped_collectives) == (3, 0)
    assert LINE.route(0, 2) == [((0, 0, 0), 0, 1), ((1, 0, 0), 0, 1)]
    assert LINE.route(1, 0) == [((1, 0, 0), 0, -1)]


def test_a_loop_runs_its_trip_count_read_from_its_condition():
    body_cond = """
%body (p: (s32[], f32[1024,1024])) -> (s32[], f32[1024,1024]) {
  %p = (s32[], f32[1024,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[1024,1024]{1,0} get-tuple-element(%p), index=1
  %two = s32[] constant(2)
  %n = s32[] add(%i, %two)
  %w = f32[1024,1024]{1,0} fusion(%v), kind=kOutput, calls=%fc, backend_config={"estimated_cycles":"1000"}
  ROOT %t = (s32[], f32[1024,1024]{1,0}) tuple(%n, %w)
}

%cond (q: (s32[], f32[1024,1024])) -> pred[] {
  %q = (s32[], f32[1024,1024]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %lim = s32[] constant(8)
  ROOT %lt = pred[] compare(%j, %lim), direction=LT
}
"""
    text = module("""  %a = f32[1024,1024]{1,0} parameter(0)
  %z = s32[] constant(0)
  %z2 = s32[] copy(%z)
  %init = (s32[], f32[1024,1024]{1,0}) tuple(%z2, %a)
  %loop = (s32[], f32[1024,1024]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[1024,1024]{1,0} get-tuple-element(%loop), index=1""", body_cond)
    e = estimate(text, CHIP, LINE)
    assert e.unknown_trips == 0
    assert e.compute_s == pytest.approx(4 * 1e-6)   # from 0 to 8 by 2: four trips
    known = text.replace("condition=%cond, body=%body", 'condition=%cond, body=%body, '
                         'backend_config={"known_trip_count":{"n":"3"}}')
    assert estimate(known, CHIP, LINE).compute_s == pytest.approx(3 * 1e-6)
    unknown = text.replace("%lim = s32[] constant(8)", "%lim = s32[] get-tuple-element(%q), index=0")
    e = estimate(unknown, CHIP, LINE)
    assert e.unknown_trips == 1 and e.compute_s == pytest.approx(1e-6)   # said, and run once


def test_every_generation_has_its_constants_and_unknown_kinds_say_so():
    assert chip_for("TPU v5 lite") is CHIPS["v5e"]
    assert {c.generation for c in CHIPS.values()} == {"v4", "v5e", "v5p", "v6e"}
    for c in CHIPS.values():
        assert c.clock_hz > 5e8 and c.link_bytes_per_s > 1e10 and c.clock_source
    with pytest.raises(ChipError, match="TPU v9"):
        chip_for("TPU v9")


def test_a_fused_all_reduce_scatter_is_a_reduce_scatter_and_named_groups_are_read():
    fused = """
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%all-reduce-scatter (input: f32[1024,1024]) -> f32[256,1024] {
  %input = f32[1024,1024]{1,0} parameter(0)
  %ar = f32[1024,1024]{1,0} all-reduce(%input), channel_id=1, replica_groups=mesh['axis_0'=1,'axis_1'=4] {'axis_1'}, to_apply=%add
  %zero = s32[] constant(0)
  %pid = u32[] partition-id()
  ROOT %ds = f32[256,1024]{1,0} dynamic-slice(%ar, %pid, %zero), dynamic_slice_sizes={256,1024}
}
"""
    text = module("""  %a = f32[1024,1024]{1,0} parameter(0)
  ROOT %rs = f32[256,1024]{1,0} fusion(%a), kind=kCustom, calls=%all-reduce-scatter""", fused)
    e = estimate(text, CHIP, LINE)
    ring = 3 * (1e-6 + MB4 / 4 / (2 * 1e9))   # one pass (a reduce-scatter), not an all-reduce's two
    assert (e.collectives, e.collective_s, e.estimated_s) == (1, pytest.approx(ring), pytest.approx(ring))
