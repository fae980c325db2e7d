"""The RunEvent codec: each kind is written as the readable line people know and read back as the same event."""
from __future__ import annotations

import pytest

from training.runtime import events
from training.runtime.events import RunEvent
from training.runtime.notice import SPOT, Notice

LINES = [
    (RunEvent(events.PROGRESS, 0, 5, payload={"total": 40, "elapsed": 10.0, "eta": 70.0, "loss": 0.6931, "epoch": 0.25}),
     "[progress] step 5/40 (12%) loss 0.6931 epoch 0.25 elapsed 10s eta 70s"),
    (RunEvent(events.PROGRESS, 0, 40, payload={"total": 40, "elapsed": 80.0, "eta": 0.0}),
     "[progress] step 40/40 (100%) elapsed 80s eta 0s"),
    (RunEvent(events.EVAL, 0, 20, payload={"loss": 3.5, "perplexity": 33.12}),
     "[progress] eval step 20 loss 3.5000 perplexity 33.12"),
    (RunEvent(events.FINISHED, 3), "[finished] rank 3"),
    (RunEvent(events.REBALANCE, 0, 12), "[rebalance] step=12: checkpoint now, training goes on"),
    (RunEvent(events.MARK, 0, None, 12.5, {"name": "first_step"}), "[timeline] first_step 12.500"),
    (Notice(SPOT, rank=1, step=20, checkpoint="checkpoint-20", durable=True).event(),
     '[preempted] {"checkpoint": "checkpoint-20", "durable": true, "rank": 1, "step": 20}'.replace(
         '{"checkpoint"', '{"cause": "spot interruption", "checkpoint"')),
]


@pytest.mark.parametrize("event,line", LINES, ids=[e.kind + str(i) for i, (e, _) in enumerate(LINES)])
def test_each_event_is_its_readable_line_and_back(event, line):
    assert event.line() == line
    back = events.parse(line, event.rank)
    assert (back.kind, back.rank, back.step) == (event.kind, event.rank, event.step)
    if event.kind == events.MARK:
        assert back.time == event.time and back.payload == event.payload
    elif event.kind not in (events.REBALANCE, events.FINISHED):
        assert back.payload == {k: (round(v, 2) if event.kind == events.EVAL else v)
                                for k, v in event.payload.items()}


def test_a_store_event_says_whether_the_checkpoint_made_it():
    ok = RunEvent(events.DURABLE, 0, 8, payload={"ok": True, "where": "s3://b/runs/r/checkpoints/checkpoint-8",
                                                 "bytes": 12e6, "seconds": 1.25, "after": 2.0})
    bad = RunEvent(events.DURABLE, 0, 9, payload={"ok": False, "error": "AccessDenied"})
    assert ok.line() == ("[store] checkpoint step 8 durable in s3://b/runs/r/checkpoints/checkpoint-8: 12 MB uploaded "
                         "in 1.2s (2.0s after its save)")
    assert bad.line() == "[store] error: checkpoint step 9 did not reach the store: AccessDenied"
    assert (events.parse(ok.line()).step, events.parse(ok.line()).payload["ok"]) == (8, True)
    assert (events.parse(bad.line()).step, events.parse(bad.line()).payload["ok"]) == (9, False)


def test_lines_that_are_not_events_are_none():
    for text in ("", "loss 0.3", "[result] accuracy 0.75", "[progress] something else", "[preempted] {not json",
                 "[timeline]", "[finished]x", "progress step 1/2"):
        assert events.parse(text) is None, text


def test_the_first_event_of_a_kind_is_found_behind_mpirun_or_fab_prefixes():
    notice = Notice(SPOT, rank=1, step=7, checkpoint="checkpoint-7", durable=False)
    lines = ["[1] hello", "[0] [progress] step 1/2 (50%) elapsed 1s eta 1s", "[0 node0] " + notice.event().line(),
             "[0] " + notice.event().line()]
    assert Notice.parse(lines) == notice
    assert events.first(lines, events.PROGRESS).step == 1
    assert events.first(lines, events.FINISHED) is None
    log = ("[0] [progress] step 3/9 (33%) elapsed 1s eta 2s\n[1] [progress] x\n"
           "[0] [progress] step 6/9 (67%) loss 0.5000 elapsed 2s eta 1s\n")
    assert events.steps(log) == [3, 6]


def test_a_progress_event_without_a_finite_loss_leaves_it_out():
    e = events.progress(2, 4, elapsed=3.0, loss=float("nan"))
    assert "loss" not in e.payload and e.line() == "[progress] step 2/4 (50%) elapsed 3s eta 3s"


def test_a_rank_appends_each_event_to_its_own_file_and_the_file_reads_back(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(events.FILE_ENV, str(tmp_path / "events" / "{rank}.jsonl"))
    monkeypatch.setenv("RANK", "1")
    first = events.progress(1, 4, 2.0, loss=0.69)
    events.emit(first)
    events.emit(RunEvent(events.FINISHED, 1, time=first.time + 1))
    assert capsys.readouterr().out.splitlines() == [first.line(), "[finished] rank 1"]  # the readable lines as before
    text = (tmp_path / "events" / "1.jsonl").read_text()
    back = events.read_jsonl(text + '{"kind": "progress", "ra')  # a torn last line (the rank killed mid-write)
    assert back == [first, RunEvent(events.FINISHED, 1, time=first.time + 1)]
    assert events.read_jsonl(RunEvent(events.FINISHED, 0, time=5.0).to_json() + "\n" + text)[0].time == 5.0  # in time order


def test_without_an_events_file_a_rank_only_prints(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(events.FILE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    events.emit(RunEvent(events.FINISHED, 0))
    assert capsys.readouterr().out == "[finished] rank 0\n" and list(tmp_path.iterdir()) == []


def test_an_unwritable_events_file_warns_and_the_line_still_goes_out(tmp_path, monkeypatch, capsys):
    (tmp_path / "events").write_text("a file where the folder should be")
    monkeypatch.setenv(events.FILE_ENV, str(tmp_path / "events" / "{rank}.jsonl"))
    events.emit(RunEvent(events.FINISHED, 0))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[finished] rank 0" and out[1].startswith("warning: the event was not written to ")
