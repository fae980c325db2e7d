"""loss.png: the Pillow chart fab draws at a run's end from the Trainer's log history."""
from __future__ import annotations

import json

from PIL import Image

from launch.staging.chart import BOTTOM, LEFT, RIGHT, TOP, S, ticks
from launch.staging.outputs import draw_loss

TRAIN, EVAL = (31, 119, 180), (255, 127, 14)


def _near(img: Image.Image, colour: tuple[int, int, int], tol: int = 40) -> list[tuple[int, int]]:
    px = img.load()
    return [(x, y) for x in range(img.width) for y in range(img.height)
            if all(abs(a - b) <= tol for a, b in zip(px[x, y], colour))]


def test_ticks_are_round_and_span_the_range():
    assert ticks(0.52, 0.71) == [0.55, 0.6, 0.65, 0.7]
    assert ticks(5, 105) == [20, 40, 60, 80, 100]
    assert ticks(0, 1500) == [0, 500, 1000, 1500]
    assert ticks(2.0, 2.0) == [2.0]
    for lo, hi in [(0.001, 0.0013), (3, 7.5), (-2, 2), (1e-6, 9e5)]:
        got = ticks(lo, hi)
        slack = 1e-6 * (hi - lo)
        assert 2 <= len(got) <= 7 and lo - slack <= got[0] and got[-1] <= hi + slack, (lo, hi, got)


def test_the_chart_has_both_losses_where_their_values_put_them_and_skips_a_diverged_step(tmp_path):
    history = [{"step": s, "loss": 1.0 - s / 200} for s in range(10, 101, 10)]
    history += [{"step": 105, "loss": float("nan")}, {"step": 50, "eval_loss": 0.9}, {"step": 100, "eval_loss": 0.6}]
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"log_history": history}))  # json writes NaN, as the Trainer does
    png = draw_loss(state, tmp_path / "loss.png")
    img = Image.open(png).convert("RGB")
    assert img.size == (600, 350)

    def legend(p):  # its samples, in the top right corner
        return p[0] > 600 - RIGHT // S - 140 and p[1] < TOP // S + 56

    train = [p for p in _near(img, TRAIN) if not legend(p)]
    evals = [p for p in _near(img, EVAL) if not legend(p)]
    assert train and evals
    # the training loss falls from step 10 to 100: its line runs from the top left of the plot to the bottom right
    left, right = min(train), max(train)
    assert left[0] < LEFT // S + 60 and left[1] < TOP // S + 40, left
    assert right[1] > 350 - BOTTOM // S - 60 and right[0] > 600 - RIGHT // S - 60, right
    # the eval loss's two points: the later, lower one sits right of and below the first
    first, last = min(evals), max(evals)
    assert last[0] - first[0] > 150 and last[1] > first[1]


def test_no_chart_without_a_loss(tmp_path):
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"log_history": [{"step": 3, "loss": float("inf")}, {"train_runtime": 1.0}]}))
    assert draw_loss(state, tmp_path / "loss.png") is None and not (tmp_path / "loss.png").exists()
    assert draw_loss(tmp_path / "missing.json", tmp_path / "loss.png") is None


def test_one_point_is_drawn_as_a_marker(tmp_path):
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"log_history": [{"step": 1, "loss": 0.7}]}))
    img = Image.open(draw_loss(state, tmp_path / "loss.png")).convert("RGB")
    assert [p for p in _near(img, TRAIN) if p[1] > 100]
