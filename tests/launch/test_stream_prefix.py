"""Rank prefixes lead every line, also when a rank writes without a newline (mpirun -l tags each chunk)."""
from __future__ import annotations

import io
from types import SimpleNamespace

from launch.life.stream import OutputRouter


def _router():
    plan = SimpleNamespace(world_size=2, secret_env={}, rank_host=lambda r: f"node{r}")
    out, log = io.StringIO(), io.StringIO()
    return OutputRouter(plan, out, log), out, log


def test_a_chunk_without_its_newline_joins_the_rest_of_its_line():
    router, out, log = _router()
    router.write("[0] **Test process execution**")  # accelerate's test_script: print(..., end="") then more
    router.write("[0]  passed\n")
    router.flush_rest()
    assert out.getvalue().splitlines() == ["[0 node0] **Test process execution** passed"]
    assert "[0] **Test process execution** passed" in log.getvalue().splitlines()


def test_interleaved_ranks_each_get_their_own_line():
    router, out, _ = _router()
    router.write("[0] abc[1] xyz\n[0] def\n")
    router.flush_rest()
    assert out.getvalue().splitlines() == ["[1 node1] xyz", "[0 node0] abcdef"]


def test_a_partial_line_left_at_the_end_is_shown_with_its_prefix():
    router, out, _ = _router()
    router.write("[1] no newline at exit")
    router.flush_rest()
    assert out.getvalue().splitlines() == ["[1 node1] no newline at exit"]


def test_lines_that_are_not_ranks_and_tags_beyond_the_world_stay_as_they_are():
    router, out, _ = _router()
    router.write("mpirun: some notice\n[0] item [7] of a list\n")
    router.flush_rest()
    assert out.getvalue().splitlines() == ["mpirun: some notice", "[0 node0] item [7] of a list"]
