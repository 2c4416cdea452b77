"""The HLO collective parser on hand-written HLO (docs/design.md, "How we measure")."""

from __future__ import annotations

import pytest

from fsdp_tp.analysis import Collective, collective_summary, parse_collectives

HEADER = "HloModule m, is_scheduled=true, num_partitions=8\n"

BODY = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%inner_body (p: (s32[], f32[16,4])) -> (s32[], f32[16,4]) {
  %p = (s32[], f32[16,4]{1,0}) parameter(0)
  %x = f32[16,4]{1,0} get-tuple-element(%p), index=1
  %ar = f32[16,4]{1,0} all-reduce(%x), channel_id=3, replica_groups=[4,2]<=[8], to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[16,4]{1,0}) tuple(%i, %ar)
}

%inner_cond (p: (s32[], f32[16,4])) -> pred[] {
  %p = (s32[], f32[16,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%outer_body (q: (s32[], f32[16,4])) -> (s32[], f32[16,4]) {
  %q = (s32[], f32[16,4]{1,0}) parameter(0)
  %w = (s32[], f32[16,4]{1,0}) while(%q), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"5"}}
  %y = f32[16,4]{1,0} get-tuple-element(%w), index=1
  %cp = f32[16,4]{1,0} collective-permute(%y), channel_id=4, source_target_pairs={{0,1},{1,2}}
  %j = s32[] get-tuple-element(%w), index=0
  ROOT %u = (s32[], f32[16,4]{1,0}) tuple(%j, %cp)
}

%outer_cond (q: (s32[], f32[16,4])) -> pred[] {
  %q = (s32[], f32[16,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (w0: f32[2,8], w1: bf16[4,8], g: f32[32,8]) -> f32[8,8] {
  %w0 = f32[2,8]{1,0} parameter(0)
  %w1 = bf16[4,8]{1,0} parameter(1)
  %g = f32[32,8]{1,0} parameter(2)
  %ag = (f32[16,8]{1,0}, bf16[32,8]{1,0}) all-gather(%w0, /*index=1*/%w1), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %rs = f32[8,8]{1,0} reduce-scatter(%g), channel_id=2, replica_groups=mesh['data'=2,'fsdp'=4] {'fsdp'}, dimensions={0}, to_apply=%add
  %ags = (f32[2,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%w0), channel_id=5, replica_groups=[1,8]<=[8], dimensions={0}
  %agd = f32[16,8]{1,0} all-gather-done(%ags)
  %init = (s32[], f32[16,4]{1,0}) parameter(3)
  %loop = (s32[], f32[16,4]{1,0}) while(%init), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[8,8]{1,0} copy(%rs)
}
"""


@pytest.fixture(scope="module")
def found() -> dict[str, Collective]:
    return {c.name: c for c in parse_collectives(HEADER + BODY)}


def test_tuple_all_gather_with_index_comment(found):
    ag = found["ag"]
    assert (ag.kind, ag.operands, ag.operand_bytes, ag.group_size) == (
        "all-gather",
        2,
        2 * 8 * 4 + 4 * 8 * 2,
        8,
    )
    assert ag.wire_bytes == ag.operand_bytes * 7  # result (8 x operand) * (S - 1) / S


def test_mesh_spelling_of_replica_groups(found):
    rs = found["rs"]
    assert (rs.kind, rs.operand_bytes, rs.group_size, rs.executions) == ("reduce-scatter", 32 * 8 * 4, 4, 1)
    assert rs.wire_bytes == 32 * 8 * 4 * 3 / 4


def test_iota_spelling_and_async_start(found):
    assert found["ags"].kind == "all-gather" and found["ags"].group_size == 8
    assert "agd" not in found  # -done carries no bytes of its own


def test_nested_while_loops_multiply_trip_counts(found):
    assert found["ar"].group_size == 2 and found["ar"].executions == 15
    assert found["ar"].wire_bytes == 15 * 2 * (16 * 4 * 4) * 1 / 2
    assert found["cp"].executions == 3 and found["cp"].wire_bytes == 3 * 16 * 4 * 4


def test_summary_adds_per_kind(found):
    summary = collective_summary(list(found.values()))
    assert summary["all-gather"]["ops"] == 2
    assert summary["all-reduce"] == {"ops": 15, "wire_bytes": 15 * 256.0}


def test_empty_replica_groups_mean_all_partitions():
    text = (
        HEADER
        + """
ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %ar = f32[4]{0} all-reduce(%x), replica_groups={}, to_apply=%add
}
"""
    )
    (ar,) = parse_collectives(text)
    assert ar.group_size == 8 and ar.wire_bytes == 2 * 16 * 7 / 8
