"""`elasticfed demo` as a user runs it: the README's promise, measured on this machine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fleet import process_env

pytestmark = pytest.mark.slow


def run_demo(*flags: str) -> tuple[dict, str]:
    result = subprocess.run(
        [sys.executable, "-m", "common.cli", "demo", *flags],
        capture_output=True,
        text=True,
        env=process_env(),
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stdout


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


def test_demo_lossless_reaches_95_percent() -> None:
    # A deadline no lossless loopback push misses, even on a busy 2-core machine: a weak
    # sync here would be a protocol bug, not a slow scheduler.
    figures, out = run_demo("--loss", "0", "--timeout-ms", "2000")
    assert figures["accuracy"] >= 0.95, out[-2000:]
    assert figures["weak_syncs"] == 0 and figures["audit_ok"]


def test_demo_refuses_bad_flags_before_starting_anything() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "common.cli", "demo", "--loss", "1.5"],
        capture_output=True, text=True, env=process_env(), timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "--loss" in result.stderr
