"""`elasticfed demo` as a user runs it: the README's promise, measured on this machine."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fleet import process_env

from elasticfed.cloud.demo import _EdgeProcess


def run_demo(*flags: str) -> tuple[dict, str]:
    result = subprocess.run(
        [sys.executable, "-m", "elasticfed.common.cli", "demo", *flags],
        capture_output=True,
        text=True,
        env=process_env(),
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stdout


def run_folder(out: str) -> Path:
    """The run's folder, as the demo's header names it."""
    match = re.search(r"edge logs in (\S+)", out)
    assert match, out[:2000]
    return Path(match.group(1))


@pytest.mark.slow
def test_demo_at_its_default_30_percent_bursty_loss_reaches_93_percent() -> None:
    figures, out = run_demo()
    assert figures["loss"] == 0.3 and figures["edges"] == 4
    assert figures["accuracy"] >= 0.93, out[-2000:]
    assert (
        figures["audit_ok"]
        and figures["produced_steps"] == figures["applied_steps"] + figures["dropped_stale_steps"]
    )
    assert figures["weak_syncs"] > 0 and figures["retransmissions"] > 0  # the loss was felt
    for heading in ("test accuracy", "rounds", "time", "bytes", "weak syncs", "count audit        OK"):
        assert heading in out
    assert "the link is CURVE-encrypted, 4 devices enrolled" in out  # secured by default
    assert not run_folder(out).exists()  # logs and keys removed: nothing left in /tmp by default


@pytest.mark.slow
def test_demo_lossless_reaches_95_percent() -> None:
    # A deadline no lossless loopback push misses, even on a busy 2-core machine: a weak
    # sync here would be a protocol bug, not a slow scheduler.  Lossless rounds close every few
    # local steps and the test set is 360 digits, so one run's figure moves by a few digits with
    # the edges' timing: 800 rounds gave 93.6-96.9% (one CI run of about eight below 95%), 1500
    # rounds 95.8-97.8% in six runs (35-50 s).
    figures, out = run_demo("--loss", "0", "--timeout-ms", "2000", "--rounds", "1500", "--keep")
    assert figures["accuracy"] >= 0.95, out[-2000:]
    assert figures["weak_syncs"] == 0 and figures["audit_ok"]
    folder = run_folder(out)
    try:
        assert f"edge logs and keys kept in {folder}" in out
        assert (folder / "edge-0.log").is_file() and (folder / "keys").is_dir()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_demo_refuses_bad_flags_before_starting_anything() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "elasticfed.common.cli", "demo", "--loss", "1.5"],
        capture_output=True, text=True, env=process_env(), timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "--loss" in result.stderr


# An agent that takes a while to start (importing torch on a busy machine) and only then handles
# SIGTERM: it prints "start" once its handler is in, and a summary when stopped.
SLOW_STARTER = """
import json, signal, sys, threading, time
time.sleep(float(sys.argv[1]))
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
print(json.dumps({"event": "start"}), flush=True)
stop.wait(60)
print(json.dumps({"event": "summary", "steps": 0}), flush=True)
"""


def test_the_demo_stops_an_edge_only_once_it_has_started(tmp_path: Path) -> None:
    # The demo ends when its round budget is spent, possibly before a slow edge has started:
    # SIGTERM then would kill it without a summary, and the count audit would fail.
    edge = _EdgeProcess("slow", [sys.executable, "-c", SLOW_STARTER, "0.5"], tmp_path / "slow.log")
    edge.stop(start_deadline=time.monotonic() + 60)
    assert edge.finish(timeout=60) == 0
    assert edge.summary == {"event": "summary", "steps": 0}


def test_the_demo_gives_up_waiting_for_a_start_at_the_deadline(tmp_path: Path) -> None:
    edge = _EdgeProcess("slow", [sys.executable, "-c", SLOW_STARTER, "60"], tmp_path / "slow.log")
    edge.stop(start_deadline=time.monotonic())  # the start-up limit has passed: stop it now
    assert edge.finish(timeout=60) == -15 and edge.summary is None


@pytest.mark.slow
def test_a_demo_whose_gateway_diverges_stops_and_says_so() -> None:
    # FedAdam at a learning rate of 10 per coordinate blows the model up in its first round; the
    # gateway stops applying (its loss watch) and the demo must stop with it, say why and exit with
    # serve's code, instead of training on to its budget and printing the broken model's accuracy
    # as a result.
    import io

    from elasticfed.cloud import demo
    from elasticfed.cloud.config import DemoConfig
    from elasticfed.cloud.serve import EXIT_DIVERGED

    out = io.StringIO()
    figures: dict = {}
    config = DemoConfig(edges=2, loss=0.0, rounds=100_000, time_limit_s=300.0, drain_s=5.0, insecure=True)
    adam = {"optimizer": "adam", "lr": 10.0, "momentum": 0.0}
    code = demo.run(None, config, out=out, result=figures, gateway_settings=adam)
    text = out.getvalue()
    assert code == EXIT_DIVERGED, text[-2000:]
    assert "lower --gateway-lr" in (figures["diverged"] or "")
    assert "DIVERGED" in text and "lower --gateway-lr" in text
    assert figures["seconds"] < 150, text[-2000:]  # it stopped with the gateway, not at its 300 s budget
    assert figures["audit_ok"]  # what the edges produced is still accounted for
