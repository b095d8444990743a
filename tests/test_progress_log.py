"""Progress where bars are not drawn (a log file, a pipe, CI): plain lines on stderr, one once the
work has run for ``LogProgress.grace`` seconds, at most one every ``$DEPTHSCOPE_PROGRESS_EVERY``
seconds, one at the end with the elapsed time; ``DEPTHSCOPE_PROGRESS=0`` silences them. Driven by a fake clock."""

from __future__ import annotations

import sys
import time

import pytest

from depthscope.common import progress


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t

    def tick(self, seconds: float):
        self.t += seconds


@pytest.fixture
def log_mode(monkeypatch):
    """Not a terminal, no $CI, no override: the log-line mode; a fake clock."""
    for k in ("CI", "DEPTHSCOPE_PROGRESS", "DEPTHSCOPE_PROGRESS_EVERY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: False, raising=False)
    clock = FakeClock()
    monkeypatch.setattr(progress, "_clock", clock)
    monkeypatch.setattr(progress.LogProgress, "grace", 0)  # the start line at once (its own test below)
    monkeypatch.setattr(progress.LogProgress, "heartbeat", False)  # the fake clock alone decides (timer: below)
    return clock


def test_a_long_step_without_updates_still_writes_lines(log_mode, capsys, monkeypatch):
    """The timer thread writes the start line after the grace and then a line every ``every``
    seconds while no update comes (real clock, short intervals)."""
    monkeypatch.setattr(progress, "_clock", time.monotonic)
    monkeypatch.setattr(progress.LogProgress, "grace", 0.05)
    monkeypatch.setattr(progress.LogProgress, "heartbeat", True)
    monkeypatch.setenv("DEPTHSCOPE_PROGRESS_EVERY", "0.1")
    bar = progress.progress_bar(3, desc="sweep", unit="ckpt")
    time.sleep(0.6)
    bar.close()
    got = lines(capsys)
    assert got[0] == "sweep: 0/3 ckpt (0%)" and got[-1].startswith("sweep: finished 0/3 ckpt in ")
    assert 3 <= len(got) - 2 <= 7, got  # about one line per 0.1 s of the 0.55 s after the grace


def test_work_shorter_than_the_grace_writes_nothing(log_mode, capsys, monkeypatch):
    """A task closed within ``grace`` seconds writes no line at all; one still running after it is
    announced by the timer, even before its first update, and then gets its end line."""
    monkeypatch.setattr(progress.LogProgress, "grace", 0.05)
    monkeypatch.setattr(progress.LogProgress, "heartbeat", True)
    with progress.progress_bar(3, desc="short fit", unit="pass") as bar:
        bar.update(3)
    assert lines(capsys) == []
    bar = progress.progress_bar(3, desc="long step", unit="pass")
    time.sleep(0.3)
    assert lines(capsys) == ["long step: 0/3 pass (0%)"]
    bar.update(3)
    bar.close()
    assert lines(capsys) == ["long step: finished 3/3 pass in 0.0 s"]


def lines(capsys) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def test_modes(log_mode, monkeypatch):
    assert not progress.bars_enabled() and progress.log_enabled()
    monkeypatch.setenv("CI", "1")
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: True, raising=False)
    assert not progress.bars_enabled() and progress.log_enabled()  # CI: lines, not bars
    monkeypatch.delenv("CI")
    assert progress.bars_enabled() and not progress.log_enabled()  # a terminal: bars
    monkeypatch.setenv("DEPTHSCOPE_PROGRESS", "0")
    assert not progress.bars_enabled() and not progress.log_enabled()
    monkeypatch.setenv("DEPTHSCOPE_PROGRESS", "1")
    assert progress.bars_enabled() and not progress.log_enabled()


def test_start_rate_limited_updates_and_end_line(log_mode, capsys):
    bar = progress.progress_bar(100, desc="lens", unit="site")
    assert isinstance(bar, progress.LogProgress)
    assert lines(capsys) == ["lens: 0/100 site (0%)"]
    for _ in range(20):  # 20 updates within 9.5 s: no line
        log_mode.tick(0.475)
        bar.update(1)
    assert lines(capsys) == []
    log_mode.tick(0.5)  # 10 s since the start
    bar.update(1)
    got = lines(capsys)
    assert got == ["lens: 21/100 site (21%), 2.1 site/s, 38 s left"]
    for _ in range(39):  # the next line comes 10 s after the previous one, not before
        log_mode.tick(0.2)
        bar.update(1)
    assert lines(capsys) == []
    log_mode.tick(2.5)  # 10.3 s since the previous line
    bar.update(1)
    assert len(lines(capsys)) == 1
    bar.close()
    bar.close()  # twice: one end line
    assert lines(capsys) == ["lens: finished 61/100 site in 20 s"]
    assert bar.n == 61


def test_no_progress_line_when_complete_the_end_line_says_it(log_mode, capsys):
    bar = progress.progress_bar(2, desc="patching", unit="patch")
    log_mode.tick(30)
    bar.update(1)
    log_mode.tick(30)
    bar.update(1)  # complete: no progress line, the end line follows
    bar.close()
    assert lines(capsys) == [
        "patching: 0/2 patch (0%)",
        "patching: 1/2 patch (50%), 30 s/patch, 30 s left",
        "patching: finished 2/2 patch in 1 min 00 s",
    ]


def test_interval_from_the_environment(log_mode, monkeypatch, capsys):
    monkeypatch.setenv("DEPTHSCOPE_PROGRESS_EVERY", "2")
    with progress.progress_bar(None, desc="norms", unit="tok") as bar:
        for _ in range(10):
            log_mode.tick(1.0)
            bar.update(100)
    got = lines(capsys)
    assert got[0] == "norms: 0 tok"
    assert len(got) == 1 + 5 + 1  # a line every 2 s over 10 s, then the end
    assert got[1] == "norms: 200 tok, 100 tok/s, 2.0 s elapsed"
    assert got[-1] == "norms: finished 1000 tok in 10 s"
    monkeypatch.setenv("DEPTHSCOPE_PROGRESS_EVERY", "0")  # every update
    bar = progress.progress_bar(3, desc="x")
    for _ in range(3):
        bar.update()
    bar.close()
    assert len(lines(capsys)) == 1 + 2 + 1  # the last update completes it: the end line only
    monkeypatch.setenv("DEPTHSCOPE_PROGRESS_EVERY", "soon")  # not a number: the default
    assert progress.log_interval() == progress.DEFAULT_EVERY


def test_track_resume_and_postfix(log_mode, capsys):
    seen = []
    for item in progress.track(["a", "b", "c"], desc="sweep", unit="ckpt"):
        log_mode.tick(30)
        seen.append(item)
    assert seen == ["a", "b", "c"]
    got = lines(capsys)
    assert got[0] == "sweep: 0/3 ckpt (0%)"
    assert got[1] == "sweep: 1/3 ckpt (33%), 30 s/ckpt, 1 min 00 s left"
    assert got[-1] == "sweep: finished 3/3 ckpt in 1 min 30 s"
    # resumed at step 100 of 300; the rate counts this run's steps only
    bar = progress.progress_bar(300, desc="training tuned lens", unit="step", initial=100)
    log_mode.tick(10)
    bar.update(50)
    bar.set_postfix(kl="0.123")
    log_mode.tick(10)
    bar.update(50)
    bar.close()
    got = lines(capsys)
    assert got[0] == "training tuned lens: 100/300 step (33%)"
    assert got[1] == "training tuned lens: 150/300 step (50%), 5 step/s, 30 s left"
    assert got[2] == "training tuned lens: 200/300 step (67%), 5 step/s, 20 s left, kl=0.123"
    assert got[3] == "training tuned lens: finished 200/300 step in 20 s, kl=0.123"


def test_off_is_silent_and_enabled_false_too(log_mode, monkeypatch, capsys):
    bar = progress.progress_bar(5, desc="quiet", enabled=False)
    bar.update(5)
    bar.close()
    with progress.spinner("converting", enabled=False):
        pass
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("DEPTHSCOPE_PROGRESS", "0")
    bar = progress.progress_bar(5, desc="quiet")
    log_mode.tick(60)
    bar.update(5)
    bar.close()
    assert list(progress.track(range(3), desc="quiet")) == [0, 1, 2]
    with progress.spinner("converting"):
        log_mode.tick(60)
    assert capsys.readouterr().err == ""


def test_spinner_lines(log_mode, monkeypatch, capsys):
    monkeypatch.setenv("DEPTHSCOPE_PROGRESS_EVERY", "0.05")
    written = []
    emit = progress._emit
    monkeypatch.setattr(progress, "_emit", lambda line: (written.append(line), emit(line)))
    with progress.spinner("converting GGUF"):
        log_mode.tick(20)
        deadline = time.monotonic() + 10
        while len(written) < 2 and time.monotonic() < deadline:  # the beat thread writes meanwhile
            time.sleep(0.02)
    got = lines(capsys)
    assert got[0] == "converting GGUF..."
    assert "converting GGUF... 20 s" in got[1:-1]
    assert got[-1] == "converting GGUF: done in 20 s"
    with pytest.raises(RuntimeError):
        with progress.spinner("converting GGUF"):
            raise RuntimeError("broken file")
    assert lines(capsys)[-1].startswith("converting GGUF: stopped after")


def test_the_end_line_is_written_when_the_loop_fails(log_mode, capsys):
    with pytest.raises(ValueError):
        with progress.progress_bar(10, desc="patching", unit="patch") as bar:
            bar.update(3)
            raise ValueError
    assert lines(capsys)[-1] == "patching: finished 3/10 patch in 0.0 s"


def test_a_real_stage_writes_lines_in_a_log(tiny_factory, monkeypatch, capfd):
    """The lens job's bar (analyses/lens/logit.py) through the same helper: lines on a non-terminal."""
    from depthscope.analyses.jobs import Output
    from depthscope.analyses.jobs.configs import LensConfig, TextWindows
    from depthscope.analyses.jobs.lens import lens_job

    for k in ("CI", "DEPTHSCOPE_PROGRESS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("DEPTHSCOPE_PROGRESS_EVERY", "0")
    monkeypatch.setattr(progress.LogProgress, "grace", 0)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    m = tiny_factory("llama", n_layers=1, d_model=32)
    text = " ".join(["The capital of France is Paris. The cat sat on the mat."] * 20)
    res = lens_job(m, [text], LensConfig(progress=True, text=TextWindows(window=64), batch_size=1), Output(None))
    n = res.summary["n_positions"]
    err = [ln for ln in capfd.readouterr().err.splitlines() if "logit lens" in ln]
    assert err[0] == f"logit lens: 0/{n} tok (0%)"
    assert len(err) >= 3 and err[-1].startswith(f"logit lens: finished {n}/{n} tok in ")
