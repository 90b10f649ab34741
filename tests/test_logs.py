"""Log set-up: JSON lines carry the fields, and a role run in-process follows sys.stderr."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest

from elasticfed.common.logs import configure_logging


@pytest.fixture
def restore_root():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_carry_time_level_logger_message_and_fields(restore_root, monkeypatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    configure_logging("info", "json", role="edge")
    logging.getLogger("elasticfed.edge").info("pushed %d layers", 3)
    logging.getLogger("elasticfed.edge").debug("not at info")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 1
    assert lines[0]["message"] == "pushed 3 layers" and lines[0]["level"] == "info"
    assert lines[0]["logger"] == "elasticfed.edge" and lines[0]["role"] == "edge"
    assert lines[0]["time"].endswith("+00:00")


def test_a_second_call_replaces_its_own_handler_and_follows_a_new_stderr(restore_root, monkeypatch) -> None:
    other = logging.NullHandler()
    logging.getLogger().addHandler(other)
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging("info", "text", text_prefix="rank0 ")
    configure_logging("info", "text", text_prefix="rank0 ")
    monkeypatch.setattr(sys, "stderr", second)
    first.close()  # the stream it was set up with is gone, as a test's captured stderr is
    logging.getLogger("elasticfed.cloud").warning("epoch 1")
    assert second.getvalue().count("rank0 elasticfed.cloud epoch 1") == 1
    assert other in logging.getLogger().handlers  # someone else's handler stays
