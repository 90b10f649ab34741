"""The progress bar draws at a terminal only, in place, throttled, and ends its line."""

from __future__ import annotations

import io
import os
import pty

from elasticfed.common.progress import ProgressBar


def test_not_a_terminal_gets_nothing() -> None:
    out = io.StringIO()
    bar = ProgressBar(10, "edge", stream=out)
    bar.update(5, loss=0.5)
    bar.close()
    assert out.getvalue() == ""


def test_a_terminal_gets_one_line_redrawn_in_place() -> None:
    leader, follower = pty.openpty()
    with os.fdopen(follower, "w") as tty:
        bar = ProgressBar(10, "cloud", stream=tty, every_s=3600)
        assert bar.enabled  # decided by isatty(), not by the caller
        bar.update(5, epoch=2, loss=0.25)
        bar.update(6)  # within every_s: not drawn
        bar.update(10, force=True, loss=0.125)
        bar.close()
    # One read returns what the pty has buffered so far, not necessarily every write (CI once got
    # only the first line): read until the closed follower ends it (EIO on Linux).
    data = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    text = data.decode()
    os.close(leader)
    assert text.count("\r\x1b[2K") == 2
    assert "cloud [############            ] 5/10  epoch 2  loss 0.25" in text
    assert "6/10" not in text
    assert "[########################] 10/10  loss 0.125" in text
    assert text.endswith("\n") or text.endswith("\r\n")
