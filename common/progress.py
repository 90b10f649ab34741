"""A one-line progress bar for people at a terminal, and nothing for everyone else.

Drawn on stderr only when stderr is a terminal: under systemd, Kubernetes or a
test harness the bar would be noise in the logs, and the JSON status lines and
log lines already carry the same numbers.  Redrawn at most `every_s`, so a fast
loop pays one clock read per step.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """`update(done, **fields)` redraws `label [####    ] done/total fields...` in place."""

    def __init__(
        self,
        total: int,
        label: str,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        every_s: float = 0.1,
        width: int = 24,
    ) -> None:
        self.total = max(0, total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = enabled if enabled is not None else bool(isatty and isatty())
        self.every_s = every_s
        self.width = width
        self._drawn_at = -float("inf")
        self._shown = False

    def update(self, done: int, force: bool = False, **fields: object) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._drawn_at < self.every_s:
            return
        self._drawn_at = now
        # A tensor (a GPU loss) is read only when drawn: reading it every step would wait for the GPU.
        fields = {k: v.item() if hasattr(v, "item") else v for k, v in fields.items()}
        if self.total:
            filled = min(self.width, self.width * done // self.total)
            bar = f"[{'#' * filled}{' ' * (self.width - filled)}] {done}/{self.total}"
        else:
            bar = str(done)
        extra = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())
        self.stream.write(f"\r\x1b[2K{self.label} {bar}  {extra}".rstrip())
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        """End the line, so that the next log line starts on its own."""
        if self.enabled and self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = False
