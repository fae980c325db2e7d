"""Rank 0's start-up marks for bench/first_step.py (training/runtime/timeline.py)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from training.runtime import timeline


def test_marks_print_only_on_rank_0_and_only_when_asked(monkeypatch, capsys):
    monkeypatch.delenv(timeline.ENV, raising=False)
    timeline.mark("x")
    monkeypatch.setenv(timeline.ENV, "1")
    timeline.mark("y", is_main=False)
    assert capsys.readouterr().out == "" and timeline.callbacks(False) == []
    timeline.mark("z", at=12.5)
    assert capsys.readouterr().out == "[timeline] z 12.500\n"


def test_the_process_start_is_when_the_process_began():
    before = time.time()
    code = "import time; time.sleep(0.5); from training.runtime import timeline; print(time.time() - timeline.process_start())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    age = float(out.stdout)
    assert 0.5 <= age < time.time() - before + 0.05  # 10 ms clock ticks
