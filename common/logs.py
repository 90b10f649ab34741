"""Log set-up both roles share: text for people, or one JSON object per line for log shippers.

JSON lines carry the time (ISO 8601, UTC), level, logger, message, and the
role's fixed fields (e.g. the torchrun rank, the device name), so that logs from
a fleet can be filtered by field rather than by grepping text.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any, TextIO


class JsonFormatter(logging.Formatter):
    """One JSON object per record; `fields` are added to every line."""

    def __init__(self, fields: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **self.fields,
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stderr` is at the time of the record, not at set-up.

    A role run in-process (tests, notebooks) may outlive the stderr it started with.
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def configure_logging(level: str, fmt: str = "text", text_prefix: str = "", **fields: Any) -> None:
    """Root logger to stderr at `level`, as text (`text_prefix` after the time) or JSON lines.

    Replaces only the handler an earlier call installed; handlers others added stay.
    """
    handler = _StderrHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(fields))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {text_prefix}%(name)s %(message)s"))
    handler.set_name(_HANDLER_NAME)
    root = logging.getLogger()
    for old in list(root.handlers):
        if old.get_name() == _HANDLER_NAME:
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


_HANDLER_NAME = "elasticfed-stderr"
