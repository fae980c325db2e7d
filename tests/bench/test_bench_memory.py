"""The GPT-2 bench fits the machine: at its defaults it picks the largest batch whose estimated peak fits
the memory available, and a --batch (or a machine) that cannot fit is refused in one line naming the flag before
anything runs. The OOM killer is never the answer: --batch 16 was killed at 23 GB resident on a 24 GB machine."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import memory_fit  # bench/ is not a package: on sys.path above


def test_a_24_gb_machine_gets_the_batch_that_ran_there_and_16_would_not_fit():
    assert memory_fit.needs_gib("gpt2", 16) > 23  # what the OOM killer ended
    batch, why = memory_fit.pick_batch("gpt2", None, 16, available=21.0)  # a 24 GB machine's MemAvailable
    assert batch == 4 and why.startswith("batch 4: --batch 16 would need ~") and "21.0 GiB is available" in why
    assert memory_fit.pick_batch("gpt2", None, 16, available=100.0) == (16, None)  # room for the default: no note
    assert memory_fit.pick_batch("minilm", None, 16, available=1.0) == (16, None)  # shapes that always fit


def test_a_batch_that_does_not_fit_is_refused_naming_one_that_does():
    with pytest.raises(SystemExit) as exc:
        memory_fit.pick_batch("gpt2", 16, 16, available=21.0)
    line = str(exc.value)
    assert "\n" not in line and line.startswith("error: --batch 16 with --model-shape gpt2 needs ~")
    assert line.endswith("use --batch 4 or lower")
    assert memory_fit.pick_batch("gpt2", 2, 16, available=21.0) == (2, None)


def test_available_memory_is_this_machines():
    total = next(int(ln.split()[1]) / (1 << 20) for ln in Path("/proc/meminfo").read_text().splitlines()
                 if ln.startswith("MemTotal:"))
    env = {k: v for k, v in os.environ.items() if k != memory_fit.MEMORY_ENV}
    code = "import sys; sys.path.insert(0, 'bench'); import memory_fit; print(memory_fit.available_gib())"
    got = float(subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                               check=True, timeout=60).stdout)
    assert 0 < got <= total


def test_the_bench_refuses_in_one_line_before_it_measures_anything():
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "glue_single_node.py"), "--model-shape", "gpt2"],
                         cwd=ROOT, env={**os.environ, memory_fit.MEMORY_ENV: "3"}, capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 1 and res.stdout == "", res.stdout + res.stderr
    assert res.stderr.splitlines() == [res.stderr.strip()] and "--batch 1" in res.stderr, res.stderr
