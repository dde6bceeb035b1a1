"""The planner's roofline walk over a scheduled program (``zjax plan --timeline``): compute, collectives, waits."""

from __future__ import annotations

import pytest

from zjax.planner import count_collectives
from zjax.planner._timeline import Links, timeline

# a 1000 x 1000 x 1000 bf16 matmul (2e9 FLOPs) beside a weight all-gather of 2 MB over two partitions (1 MB
# crosses per device); a loop whose body waits, after its matmul, for the gather the trip before started at its end
_DOT = """
%fused_dot (p0: bf16[1000,1000], p1: bf16[1000,1000]) -> bf16[1000,1000] {
  %p0 = bf16[1000,1000]{1,0} parameter(0)
  %p1 = bf16[1000,1000]{1,0} parameter(1)
  ROOT %d = bf16[1000,1000]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""

OVERLAPPED = (
    "HloModule m, num_partitions=2\n"
    + _DOT
    + """
ENTRY %main (a: bf16[1000,1000], b: bf16[1000,1000], w: bf16[500000]) -> bf16[1000000] {
  %a = bf16[1000,1000]{1,0} parameter(0)
  %b = bf16[1000,1000]{1,0} parameter(1)
  %w = bf16[500000]{0} parameter(2)
  %ag = ((bf16[500000]{0}), bf16[1000000]{0}) all-gather-start(%w), replica_groups={{0,1}}, dimensions={0}
  %f = bf16[1000,1000]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot
  ROOT %agd = bf16[1000000]{0} all-gather-done(%ag)
}
"""
)

STATE = "(s32[], bf16[1000,1000]{1,0}, bf16[500000]{0}, ((bf16[500000]{0}), bf16[1000000]{0}))"
PIPELINED = (
    "HloModule m, num_partitions=2\n"
    + _DOT
    + """
%body (s: STATE) -> STATE {
  %s = STATE parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %a = bf16[1000,1000]{1,0} get-tuple-element(%s), index=1
  %w = bf16[500000]{0} get-tuple-element(%s), index=2
  %prev = ((bf16[500000]{0}), bf16[1000000]{0}) get-tuple-element(%s), index=3
  %f = bf16[1000,1000]{1,0} fusion(%a, %a), kind=kCustom, calls=%fused_dot
  %agd = bf16[1000000]{0} all-gather-done(%prev)
  %ag = ((bf16[500000]{0}), bf16[1000000]{0}) all-gather-start(%w), replica_groups={{0,1}}, dimensions={0}
  ROOT %t = STATE tuple(%i, %f, %w, %ag)
}

%cond (s: STATE) -> pred[] {
  %s = STATE parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %n = s32[] constant(10)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: STATE) -> STATE {
  %x = STATE parameter(0)
  ROOT %loop = STATE while(%x), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"10"}}
}
""".replace("STATE", STATE)
)

PEAK, HBM = 1e12, 1e12  # FLOP/s, bytes/s
MATMUL = 2e9 / PEAK  # 2 ms: the roofline's FLOP side (its 6 MB of operands and result take 6 us)


@pytest.mark.parametrize(("intra", "wait"), [(1e9, 0.0), (1e8, 0.010 - MATMUL)])
def test_a_collective_waits_for_what_the_compute_beside_it_does_not_cover(intra, wait):
    """1 MB crosses per device: at 1 GB/s (1 ms) the 2 ms matmul covers it, at 100 MB/s (10 ms) the done waits 8."""
    t = timeline(OVERLAPPED, PEAK, HBM, Links(intra=intra, inter=intra / 10))
    assert t.compute == pytest.approx(MATMUL)
    assert t.comm == pytest.approx(1e6 / intra)
    assert t.wait == pytest.approx(wait, abs=1e-9)
    assert t.step == pytest.approx(t.compute + t.wait)


def test_a_group_across_hosts_takes_the_network():
    """The same two partitions on two hosts of one GPU each: the network's bandwidth, not NVLink's."""
    t = timeline(OVERLAPPED, PEAK, HBM, Links(intra=1e9, inter=1e8), gpus_per_host=1)
    assert t.comm == pytest.approx(1e6 / 1e8) and t.wait == pytest.approx(0.010 - MATMUL)


@pytest.mark.parametrize(("intra", "wait"), [(1e9, 0.0), (1e8, 10 * (0.010 - MATMUL))])
def test_a_loop_gather_started_for_the_next_trip_has_the_trip_to_cross(intra, wait):
    """XLA's pipeliner: each trip waits, after its matmul, for the gather the trip before started at its end. A
    trip is the 2 ms matmul: a 1 ms gather is hidden under it, a 10 ms one leaves 8 ms per trip, 10 trips."""
    t = timeline(PIPELINED, PEAK, HBM, Links(intra=intra, inter=intra))
    assert t.compute == pytest.approx(10 * MATMUL)
    assert t.comm == pytest.approx(10 * 1e6 / intra)
    assert t.wait == pytest.approx(wait, abs=1e-9)


def test_a_product_of_two_fp8_operands_runs_at_the_fp8_peak():
    """The same 2e9-FLOP product with e4m3 operands: at the fp8 peak when the target has one, else at the other."""
    fp8 = OVERLAPPED.replace("%p0 = bf16", "%p0 = f8e4m3fn").replace("%p1 = bf16", "%p1 = f8e4m3fn")
    links = Links(intra=1e12, inter=1e12)
    assert timeline(fp8, PEAK, HBM, links, fp8_flops=2 * PEAK).compute == pytest.approx(MATMUL / 2)
    assert timeline(fp8, PEAK, HBM, links).compute == pytest.approx(MATMUL)
    assert timeline(OVERLAPPED, PEAK, HBM, links, fp8_flops=2 * PEAK).compute == pytest.approx(MATMUL)  # bf16's


def test_a_fusion_that_slices_a_stacked_operand_through_a_bitcast_reads_the_slice():
    """A layer scan's fusion reads one layer of a stacked ``[L, ...]`` weight: a bitcast, then a dynamic-slice. It
    reads the slice (L = 100 layers of 1 MB: 1 MB, not 100), as XLA's fusion does."""
    hlo = """HloModule m, num_partitions=1

%fused (p0: bf16[100,1000,500], p1: s32[]) -> bf16[500] {
  %p0 = bf16[100,1000,500]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %b = bf16[100,500,1000]{2,1,0} bitcast(%p0)
  %z = s32[] constant(0)
  %ds = bf16[1,500,1000]{2,1,0} dynamic-slice(%b, %p1, %z, %z), dynamic_slice_sizes={1,500,1000}
  %r = bf16[500,1000]{1,0} bitcast(%ds)
  %m = bf16[] constant(0)
  ROOT %out = bf16[500]{0} reduce(%r, %m), dimensions={1}, to_apply=%max
}

ENTRY %main (w: bf16[100,1000,500], i: s32[]) -> bf16[500] {
  %w = bf16[100,1000,500]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  ROOT %f = bf16[500]{0} fusion(%w, %i), kind=kInput, calls=%fused
}
"""
    t = timeline(hlo, PEAK, HBM, Links(intra=1e12, inter=1e12))
    assert t.compute == pytest.approx((1e6 + 4 + 1000) / HBM)  # the slice, the index and the result


def test_a_loop_whose_count_xla_left_unrecorded_is_counted_from_its_fused_compare():
    """XLA:GPU drops ``known_trip_count`` from a layer scan whose body holds a loop (a chunked expert dispatch) and
    fuses the condition's compare: the bound is read inside that fusion, so the gathers count 10 trips, not 1."""
    fused = """
%fused_compare (p: s32[]) -> pred[] {
  %p = s32[] parameter(0)
  %n = s32[] constant(10)
  ROOT %lt = pred[] compare(%p, %n), direction=LT
}

%cond (s: STATE) -> pred[] {
  %s = STATE parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  ROOT %lt = pred[] fusion(%i), kind=kLoop, calls=%fused_compare
}
""".replace("STATE", STATE)
    start = PIPELINED.index("%cond (")
    unrecorded = PIPELINED[:start] + fused.lstrip("\n") + PIPELINED[PIPELINED.index("ENTRY") :]
    unrecorded = unrecorded.replace(', backend_config={"known_trip_count":{"n":"10"}}', "")
    assert "known_trip_count" not in unrecorded and "calls=%fused_compare" in unrecorded
    sizes = {"dp": 2}
    assert count_collectives(unrecorded, sizes).volume == count_collectives(PIPELINED, sizes).volume
    assert count_collectives(PIPELINED, sizes).volume["all-gather"] > 0
