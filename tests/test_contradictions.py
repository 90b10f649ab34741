"""Settings that are each valid but contradict each other are refused at start, through the real CLI,
with exit code 2 and a message naming both flags; the defaults contradict nothing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from elasticfed.cloud.config import CloudConfig, GatewaySettings
from elasticfed.cloud.config import contradictions as cloud_contradictions
from elasticfed.common.cli import main
from elasticfed.edge.config import EdgeConfig, EdgeThermal
from elasticfed.edge.config import contradictions as edge_contradictions
from elasticfed.edge.session import SessionOptions


def test_the_defaults_contradict_nothing() -> None:
    assert edge_contradictions(EdgeConfig()) is None
    assert cloud_contradictions(CloudConfig()) is None


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--timeout-ms", "6000", "--heartbeat-ms", "1000"], "longer than the silence after which"),
        (["--audit-mass", "--state-dir", ""], "--audit-mass writes to --state-dir"),
        (["--thermal-resume-below-c", "70"], "the guard is off"),
        (["--thermal-pause-above-c", "80", "--thermal-resume-below-c", "85"], "must be below"),
    ],
)
def test_an_edge_with_contradictory_settings_stops_before_anything_starts(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A gateway nobody runs and a task that would take seconds to load: the refusal comes first.
    assert main(["edge", "--insecure", "--gateway", "tcp://127.0.0.1:9", *flags]) == 2
    err = capsys.readouterr().err
    assert "elasticfed edge: error:" in err and says in err


def test_the_edge_limits_are_the_ones_just_inside() -> None:
    assert edge_contradictions(EdgeConfig(timeout_ms=5000, heartbeat_ms=1000)) is None  # 5 heartbeats
    assert edge_contradictions(EdgeConfig(timeout_ms=5001, heartbeat_ms=1000)) is not None
    ok = EdgeThermal(pause_above_c=80.0, resume_below_c=79.9)
    assert edge_contradictions(EdgeConfig(thermal=ok)) is None


def test_a_session_built_in_code_refuses_a_deadline_past_its_liveness() -> None:
    SessionOptions(gateway="tcp://127.0.0.1:9", client_id="e", timeout_s=5.0, heartbeat_s=1.0, liveness=5)
    with pytest.raises(ValueError, match="at most heartbeat_s x liveness"):
        SessionOptions(gateway="tcp://127.0.0.1:9", client_id="e", timeout_s=5.5, heartbeat_s=1.0, liveness=5)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--gateway-credit", "64", "--gateway-window", "32"], "more pushes outstanding than the verdicts"),
        (["--gateway-quorum", "9", "--gateway-max-clients", "8"], "no round could reach it"),
    ],
)
def test_a_gateway_with_contradictory_settings_stops_before_anything_starts(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["cloud", "serve", "--insecure", "--gateway-bind", "tcp://127.0.0.1:9", *flags]) == 2
    err = capsys.readouterr().err
    assert "elasticfed cloud serve: error:" in err and says in err


def test_the_gateway_limits_are_the_ones_just_inside() -> None:
    config = replace(CloudConfig(), gateway=GatewaySettings(credit=32, window=32, quorum=8, max_clients=8))
    assert cloud_contradictions(config) is None
