"""Log set-up both roles share: text for people, or one JSON object per line for log shippers.

JSON lines carry the time (ISO 8601, UTC), level, logger, message, and the
role's fixed fields (e.g. the torchrun rank, the device name), so that logs from
a fleet can be filtered by field rather than by grepping text.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any


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


def configure_logging(level: str, fmt: str = "text", text_prefix: str = "", **fields: Any) -> None:
    """Root logger to stderr at `level`, as text (`text_prefix` after the time) or JSON lines."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(fields))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {text_prefix}%(name)s %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
