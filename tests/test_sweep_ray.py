"""Sweeps on Ray: the combined table equals the local engine's on the same tiny training run
(2 workers), a killed worker is retried or recorded (no row lost or doubled), an unreachable
cluster and a missing Ray are clear errors; identical weights are marked ``duplicate_of``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import time

import pandas as pd
import pytest
import torch

from depthscope.analyses.sweeps.ray_engine import RayEngine, RayUnavailable
from depthscope.analyses.sweeps.series import discover_checkpoints, sweep

TEXT = [
    "The cat sat on the mat. The dog sat on the log. The cat and the dog sat together.",
    "A bird flew over the house and sang. The bird sang again in the morning.",
] * 20
needs_ray = pytest.mark.skipif(
    __import__("importlib").util.find_spec("ray") is None, reason="Ray is not installed (pip install 'depthscope[ray]')"
)


@pytest.fixture(scope="module")
def series(tmp_path_factory, tiny_tokenizer):
    """Four checkpoints of a real tiny training run, plus step80: a copy of step60 (same weights)."""
    from depthscope.hooks.toy import train_tiny_series

    d = tmp_path_factory.mktemp("series")
    train_tiny_series(d, TEXT, tiny_tokenizer, steps=60, save_every=20, d_model=32, n_layers=2, batch_size=8)
    shutil.copytree(d / "step60", d / "step80")
    return d


def stream_and_loss(model, texts):
    """A small analysis: mean stream norm per site and the model's own next-token loss."""
    rs = model.residual_stream(texts)
    m = rs.mask
    norms = rs.resid.norm(dim=-1)[:, m].mean(dim=1)
    logits = rs.logits[:, :-1][m[:, 1:]]
    target = rs.input_ids[:, 1:][m[:, 1:]]
    df = rs.site_frame()
    df["stream_norm"] = norms.float().cpu().numpy()
    df["loss"] = torch.nn.functional.cross_entropy(logits.float(), target).item()
    return {"by_site": df}


def die_once(model, texts, flag_dir, victim="step20", times=1):
    """The analysis, but the worker running ``victim`` is killed (SIGKILL) on its first ``times`` tries."""
    name = os.path.basename(model.source)
    tries = [p for p in os.listdir(flag_dir) if p.startswith(f"{name}.try")]
    open(os.path.join(flag_dir, f"{name}.try{len(tries)}"), "w").close()
    if name == victim and len(tries) < times:
        os.kill(os.getpid(), signal.SIGKILL)
    return stream_and_loss(model, texts)


def test_duplicate_weights_marked(series, tmp_path):
    res = sweep(
        discover_checkpoints(checkpoint_dir=series), stream_and_loss, tmp_path / "o", texts=TEXT[:2], progress=False
    )
    df = res.tables["by_site"]
    dup = df.groupby("checkpoint", sort=False)["duplicate_of"].first()
    assert dup["step80"] == "step60"
    assert dup.drop("step80").isna().all()
    a = df[df.checkpoint == "step60"].drop(columns=["checkpoint", "step", "duplicate_of"]).reset_index(drop=True)
    b = df[df.checkpoint == "step80"].drop(columns=["checkpoint", "step", "duplicate_of"]).reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b)  # the same weights give the same numbers: the digest did not lie
    done = json.loads((tmp_path / "o" / "checkpoints" / "step0.done.json").read_text())
    assert len(done["digest"]) == 32 and done["fingerprint"]["n_layers"] == 2  # a sha256 of every weight


def test_ray_missing_says_the_install_command(series, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    cks = discover_checkpoints([series / "step0"])
    with pytest.raises(RayUnavailable, match=r"pip install 'depthscope\[ray\]'"):
        sweep(cks, stream_and_loss, tmp_path / "o", texts=TEXT[:2], progress=False, engine=RayEngine())


@contextlib.contextmanager
def hanging_port():
    """A loopback port whose connects hang: a listener with a backlog of 0 that never accepts,
    its queue filled by connects of our own (the kernel then drops further SYNs, so a client
    waits as it would for a host that never answers). Closed afterwards. Only this machine's
    loopback is dialled."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fillers = []
    try:
        for _ in range(64):  # until a connect of our own no longer completes: the queue is full
            c = socket.socket()
            c.settimeout(0.2)
            fillers.append(c)
            try:
                c.connect(("127.0.0.1", port))
            except TimeoutError:
                break
        else:
            pytest.skip("this kernel accepts every loopback connect; no hanging port can be made")
        yield port
    finally:
        for c in fillers:
            c.close()
        srv.close()


@needs_ray
def test_unreachable_address_is_a_bounded_clear_error(series, tmp_path):
    """A cluster address whose connect hangs ends in a clear error after ``connect_timeout``
    (the limit below only catches a hang: it is 10 times the timeout, not a speed goal)."""
    cks = discover_checkpoints([series / "step0"])
    with hanging_port() as port:
        t0 = time.monotonic()
        with pytest.raises(RayUnavailable, match=rf"no Ray cluster answers at 127\.0\.0\.1:{port}.*timed out"):
            engine = RayEngine(address=f"127.0.0.1:{port}", connect_timeout=2)
            sweep(cks, stream_and_loss, tmp_path / "a", texts=TEXT[:2], progress=False, engine=engine)
        assert time.monotonic() - t0 < 10 * 2  # bounded: not ray.init's minute of retries
    with pytest.raises(RayUnavailable, match="no Ray cluster answers at 127.0.0.1:1"):
        engine = RayEngine(address="127.0.0.1:1", connect_timeout=2)  # a closed port: refused at once
        sweep(cks, stream_and_loss, tmp_path / "b", texts=TEXT[:2], progress=False, engine=engine)
    for bad in ("nohost", "127.0.0.1:99999", "127.0.0.1:abc", "not a url::"):  # no port, out of range, not a number
        with pytest.raises(RayUnavailable, match="expected host:port"):
            sweep(cks, stream_and_loss, tmp_path / "c", texts=TEXT[:2], progress=False, engine=RayEngine(address=bad))


@needs_ray
@pytest.mark.slow
def test_ray_table_equals_local_and_survives_killed_workers(series, tmp_path):
    """One local Ray (2 CPUs) for the whole test: starting Ray costs seconds on a small machine."""
    import ray

    cks = discover_checkpoints(checkpoint_dir=series)
    local = sweep(cks, stream_and_loss, tmp_path / "local", texts=TEXT[:4], progress=False)
    path = os.pathsep.join(p for p in sys.path if p)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    try:
        on_ray = sweep(cks, stream_and_loss, tmp_path / "ray", texts=TEXT[:4], progress=False, engine=RayEngine())
        assert on_ray.ok and on_ray.done == [c.name for c in cks]
        pd.testing.assert_frame_equal(on_ray.tables["by_site"], local.tables["by_site"])
        assert (tmp_path / "ray" / "sweep_by_site.parquet").is_file()

        # a worker killed once mid-task: Ray retries it; the table is the local one, no row lost or doubled
        flags = tmp_path / "flags"
        flags.mkdir()
        res = sweep(
            cks, die_once, tmp_path / "killed", texts=TEXT[:4], flag_dir=str(flags), progress=False, engine=RayEngine()
        )
        assert res.ok and sorted(p.name for p in flags.iterdir() if p.name.startswith("step20")) == [
            "step20.try0",
            "step20.try1",
        ]
        pd.testing.assert_frame_equal(res.tables["by_site"], local.tables["by_site"])

        # killed on every try (no retries left): recorded as failed, the others finish; a re-run resumes it
        flags2 = tmp_path / "flags2"
        flags2.mkdir()
        out = tmp_path / "killed2"
        kw = dict(texts=TEXT[:4], flag_dir=str(flags2), progress=False)
        res = sweep(cks, die_once, out, engine=RayEngine(max_retries=0), **kw)
        assert list(res.failed) == ["step20"] and "died 1 time" in res.failed["step20"]
        assert (out / "checkpoints" / "step20.failed.json").is_file()
        assert set(res.tables["by_site"]["checkpoint"]) == {c.name for c in cks} - {"step20"}
        res = sweep(cks, die_once, out, engine=RayEngine(max_retries=0), **kw)
        assert res.ok and res.done == ["step20"] and len(res.skipped) == len(cks) - 1
        pd.testing.assert_frame_equal(res.tables["by_site"], local.tables["by_site"])
        assert not (out / "checkpoints" / "step20.failed.json").exists()
    finally:
        ray.shutdown()


@needs_ray
@pytest.mark.slow
def test_ray_engine_starts_its_own_local_ray_and_refuses_mixed_series(series, tmp_path, tiny_tokenizer):
    import ray
    from conftest import make_tiny

    other = tmp_path / "step99"
    make_tiny("gpt2", vocab_size=len(tiny_tokenizer), n_layers=2, d_model=32).save_pretrained(other)
    tiny_tokenizer.save_pretrained(other)
    cks = discover_checkpoints([series / "step0", other, series / "step20"])
    local = sweep(cks, stream_and_loss, tmp_path / "local", texts=TEXT[:2], progress=False)
    res = sweep(cks, stream_and_loss, tmp_path / "ray", texts=TEXT[:2], progress=False, engine=RayEngine(workers=2))
    assert not ray.is_initialized()  # the engine started Ray and shut it down
    assert list(res.failed) == list(local.failed) == ["step99"] and "mixed series" in res.failed["step99"]
    assert res.done == ["step0", "step20"]
    pd.testing.assert_frame_equal(res.tables["by_site"], local.tables["by_site"])
    assert not (tmp_path / "ray" / "checkpoints" / "step99.done.json").exists()


def test_cli_engine_ray_without_ray_says_the_install_command(series, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from depthscope.analyses.cli import app

    monkeypatch.setitem(sys.modules, "ray", None)
    args = ["sweep", str(series / "step0"), "-a", "lens", "-o", str(tmp_path / "o"), "--engine", "ray"]
    res = CliRunner().invoke(app, args)
    # the command prints the error (no traceback) and exits 2
    assert res.exit_code == 2 and "pip install 'depthscope[ray]'" in res.output, res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "o").exists()  # refused before any work
    res = CliRunner().invoke(app, [*args[:-2], "--address", "127.0.0.1:6379"])
    assert res.exit_code == 2 and "need --engine ray" in res.output
