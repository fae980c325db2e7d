"""--min-nodes without a cluster: the flags' refusals, the accumulation that keeps the global batch (bundled jobs'
flag, a script's XC_GRAD_ACCUM, a Trainer's scaled by the rank hook), the size a run goes on with, the order of
examples at any world size, and the chain line of 'fab runs'."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from core.errors import ClusterError
from launch.life import elastic, runs
from launch.life.records import RunRecord, Status
from launch.plan import batch
from launch.plan.request import TrainRequest
from launch.supervision import restarts
from launch.supervision.train_flags import TrainFlags, resolve
from training.jobs import order
from training.runtime import preempt
from training.runtime.spec import Recovery


def _resolve(tmp_path, **flags):
    return resolve(TrainFlags(**flags), tmp_path)


def test_bad_min_nodes_is_one_line_naming_the_fix(tmp_path):
    for flags, said in (({"min_nodes": "0", "max_restarts": "1"}, "--min-nodes 0 is below 1"),
                        ({"min_nodes": "3", "nodes": "2", "max_restarts": "1"}, "--min-nodes 3 is above --nodes 2"),
                        ({"min_nodes": "x", "max_restarts": "1"}, "--min-nodes 'x' is not a whole number"),
                        ({"min_nodes": "1"}, "--min-nodes 1 applies when a run restarts by itself"),
                        ({"no_grow_back": True, "max_restarts": "1"}, "--no-grow-back goes with --min-nodes")):
        with pytest.raises(ClusterError) as err:
            _resolve(tmp_path, **flags)
        assert err.value.what.startswith(said) and err.value.fix, (flags, err.value.what)
    r = _resolve(tmp_path, min_nodes="1", nodes="2", max_restarts="2", no_grow_back=True)
    assert r.req.spec.recovery == Recovery(max_restarts=2, restart_wait=600, min_nodes=1, grow_back=False)
    assert _resolve(tmp_path).req.spec.recovery.min_nodes is None


def test_min_nodes_above_the_clusters_size_is_refused_before_anything_starts():
    cluster = SimpleNamespace(spec="local", nodes=("n0", "n1"))
    with pytest.raises(ClusterError, match=r"--min-nodes 3 is above the run's 2 node\(s\)"):
        restarts.check_min_nodes(cluster, TrainRequest.of(recovery=Recovery(max_restarts=1, min_nodes=3)))
    assert restarts.check_min_nodes(cluster, TrainRequest.of(recovery=Recovery(max_restarts=1, min_nodes=1))) == 2


def test_a_bundled_job_accumulates_more_on_fewer_ranks_and_less_when_it_grows_back():
    req = TrainRequest.of(job="glue")
    args = ["--per_device_train_batch_size", "8"]
    recorded, smaller, note = batch.same_global_batch(req.but(args=args), args, 2, 1)
    assert smaller[-2:] == ["--gradient_accumulation_steps", "2"] and recorded.spec.what.args == tuple(smaller)  # the next resume's
    assert note == "resuming on 1 rank(s) instead of 2: gradient accumulation 1 -> 2 keeps the global batch at 16"
    _, back, note = batch.same_global_batch(req, smaller, 1, 2)
    assert back.count("--gradient_accumulation_steps") == 1 and back[-1] == "1" and "2 -> 1" in note
    with pytest.raises(ClusterError, match="global batch 24 .* is not a multiple of 8 x 2"):
        batch.same_global_batch(req, args, 3, 2)


def test_a_script_gets_the_factor_in_its_environment_not_a_flag_it_may_not_have():
    req = TrainRequest.of(job=None, script="train.py", env={"A": "1"})
    smaller, args, note = batch.same_global_batch(req, ["--lr", "1"], 4, 2)
    assert args == ["--lr", "1"] and smaller.spec.what.env == {"A": "1", "XC_GRAD_ACCUM": "2"}
    assert "XC_GRAD_ACCUM 1 -> 2" in note
    back, _, _ = batch.same_global_batch(smaller, args, 2, 4)
    assert back.spec.what.env == {"A": "1"}  # factor 1: no variable at all
    with pytest.raises(ClusterError, match="XC_GRAD_ACCUM 1 is not a multiple of 3"):
        batch.same_global_batch(req, args, 4, 3)


def test_the_sizes_a_run_may_go_on_with_divide_its_batch():
    assert batch.smaller_sizes(units=4, ppn=1, least=1, most=3) == [2, 1]
    assert batch.smaller_sizes(units=6, ppn=2, least=1, most=2) == [1]
    assert batch.smaller_sizes(units=3, ppn=1, least=2, most=2) == []


def _rec(world=2, args=("--per_device_train_batch_size", "8"), ppn=1):
    return RunRecord("r1", Status.PREEMPTED, world_size=world, ppn=ppn, args=list(args), job="glue",
                     spec={"env": {}}, nodes=[{}] * (world // ppn))


def test_the_run_goes_on_with_the_most_ready_nodes_that_divide_it():
    assert elastic.go_on_size(_rec(world=4), ready=3, least=1, full=4) == 2  # 3 does not divide 4
    assert elastic.go_on_size(_rec(world=2), ready=1, least=1, full=2) == 1
    with pytest.raises(ClusterError, match=r"only 0 of 2 node\(s\) answered, fewer than --min-nodes 1"):
        elastic.go_on_size(_rec(world=2), ready=0, least=1, full=2)
    with pytest.raises(ClusterError, match="no node count from 2 to 2 .* divides the run's 3"):
        elastic.go_on_size(_rec(world=3), ready=2, least=2, full=3)


def test_ready_nodes_the_batch_leaves_out_are_named_idle_in_the_same_line(monkeypatch):
    said = []
    monkeypatch.setattr(restarts, "ready_prefix", lambda spec, full, endpoint: 3)
    req = TrainRequest.of(recovery=Recovery(max_restarts=1, min_nodes=1, grow_back=True))
    size, gave_up = restarts._smaller(_rec(world=4), ClusterError("node3 is gone"), req, 4, "aws:c", "", said.append)
    assert (size, gave_up) == (2, None) and len(said) == 1 and "\n" not in said[0]
    assert said[0] == (
        "node3 is gone: going on with 2 of 4 node(s) at the same global batch (--min-nodes 1); back to full size at "
        "the next checkpoint once they return; 1 ready node(s) sit idle, still billed: no count from 3 to 3 "
        "(1 rank(s) each) divides the run's 4 per-device batch(es) per step; a gradient accumulation 3x as large "
        "(the per-device batch 3x smaller keeps the global batch) would let 3 in, and --min-nodes 3 ends the chain "
        "instead of going on with idle nodes")
    # every ready node taken: nothing more is said
    assert elastic.idle_note(_rec(world=4), ready=2, size=2, full=4) == ""
    assert elastic.idle_note(_rec(world=2), ready=2, size=1, full=2) == ""  # the full size is not "going on smaller"
    # 2 ranks a node, accumulation 2: 16 per-device batches per step; 3 ready nodes need 6 | 16 x 3
    rec = _rec(world=8, ppn=2, args=("--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2"))
    assert elastic.go_on_size(rec, ready=3, least=1, full=4) == 2
    assert "1 ready node(s) sit idle" in elastic.idle_note(rec, 3, 2, 4)
    assert "divides the run's 16 per-device batch(es)" in elastic.idle_note(rec, 3, 2, 4)
    assert "accumulation 3x as large" in elastic.idle_note(rec, 3, 2, 4)


def _steps(sampler: order.GlobalOrder, world: int, accum: int, per_device: int) -> list[set[int]]:
    """What each optimizer step trains on, sharded as Accelerate shards: stream batch k to rank k mod world."""
    stream = list(sampler)
    batches = [stream[i:i + per_device] for i in range(0, len(stream), per_device)]
    per_step = world * accum
    return [{i for b in batches[s:s + per_step] for i in b} for s in range(0, len(batches), per_step)]


@pytest.mark.parametrize("lengths", [None, [i % 37 for i in range(803)]])
def test_every_optimizer_step_takes_the_same_examples_at_any_world_size(lengths):
    two = order.GlobalOrder(803, 16, seed=42, lengths=lengths)  # 2 ranks x 8, accumulation 1
    one = order.GlobalOrder(803, 16, seed=42, lengths=lengths)  # 1 rank x 8, accumulation 2
    for epoch in (0, 1):
        two.set_epoch(epoch)
        one.set_epoch(epoch)
        assert _steps(two, 2, 1, 8) == _steps(one, 1, 2, 8)
    assert len(two) == 800  # the tail short of a global batch waits for the next epoch's draw
    first, second = (list(order.GlobalOrder(803, 16, 42).__iter__()) for _ in range(2))
    assert first == second and len(set(first)) == 800
    if lengths:
        s = order.GlobalOrder(803, 16, 42, lengths)
        grouped = [lengths[i] for i in s]
        assert grouped[:800] == sorted(grouped[:800], reverse=True)  # 800 < one megabatch: one sorted group


def test_the_rank_hook_scales_a_trainers_accumulation_once(monkeypatch):
    trainer = SimpleNamespace(args=SimpleNamespace(gradient_accumulation_steps=3))
    monkeypatch.setenv("XC_GRAD_ACCUM", "2")
    assert preempt.scale_accumulation(trainer) == 6
    assert preempt.scale_accumulation(trainer) == 6  # a second train() call of the same trainer
    monkeypatch.delenv("XC_GRAD_ACCUM")
    assert preempt.scale_accumulation(SimpleNamespace(args=SimpleNamespace(gradient_accumulation_steps=3))) == 3


def test_fab_runs_shows_a_chains_sizes_and_its_steps_at_reduced_size():
    a = RunRecord("a", Status.PREEMPTED, nodes=[{}, {}], restarted_as="b",
                  segment={"nodes": 2, "from_step": 0, "to_step": 20})
    b = RunRecord("b", Status.STOPPED, nodes=[{}], restarted_as="c", segment={"nodes": 1, "from_step": 20, "to_step": 80})
    c = RunRecord("c", Status.OK, nodes=[{}, {}], segment={"nodes": 2, "from_step": 80, "to_step": 150})
    same = RunRecord("d", Status.PREEMPTED, nodes=[{}, {}], restarted_as="e")
    e = RunRecord("e", Status.OK, nodes=[{}, {}])
    assert runs.chain_lines([c, b, a, e, same]) == [
        "chain a: 2→1→2 nodes (a -> b -> c), ok; 60 of 150 optimizer steps at reduced size"]


def test_torch_sampler_protocol():
    s = order.GlobalOrder(10, 4, seed=0)
    assert isinstance(s, torch.utils.data.Sampler) and len(list(s)) == len(s) == 8


def test_grow_back_reads_the_runs_step_count_from_its_progress_events(tmp_path):
    from training.runtime import events

    run = tmp_path / "r1"
    run.mkdir()
    watcher = elastic.GrowBack("r1", tmp_path, None, 2, lambda: False, print)
    assert watcher._total() == 1 << 62  # no log yet: never reached
    lines = ["[0 node0] rank 0/1 backend=gloo", f"[0 node0] {events.progress(5, 40, 2.0, 0.69).line()}",
             f"[0 node0] {events.progress(10, 40, 4.0).line()}"]
    (run / "log.txt").write_text("\n".join(lines) + "\n")
    assert watcher._total() == 40
