"""Run a function on N real processes joined by a real gloo process group, and collect results.

Each rank writes its result as JSON to a file (no pickle crosses back); an
exception in a rank is reported with its traceback.  A rank that does not
finish by the deadline is killed and reported, so a hang fails the test
instead of stalling the suite.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    kwargs: dict,
    out: str,
    pg_timeout_s: float,
    backend: str = "gloo",
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world, **kwargs)
        Path(out).write_text(json.dumps({"ok": result}))
    except BaseException as exc:  # reported to the test, with the traceback
        Path(out).write_text(
            json.dumps({"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()})
        )
    finally:
        # Skip interpreter teardown: a peer may already be gone, and gloo's destructors can block on it.
        os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    tmp: Path,
    *,
    deadline_s: float = 120.0,
    pg_timeout_s: float = 60.0,
    expect_errors: bool = False,
    wait_for: list[int] | None = None,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[dict]:
    """Run fn(rank, world, **kwargs) on `world` processes; return each rank's {"ok": ..} or {"error": ..}.

    With `wait_for`, the other ranks are killed as soon as those have finished
    (for scenarios where a rank is meant to hang).
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    outs = [tmp / f"rank{r}-{time.monotonic_ns()}.json" for r in range(world)]
    procs = [
        ctx.Process(
            target=_entry, args=(r, world, port, fn, kwargs, str(outs[r]), pg_timeout_s, backend), daemon=True
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    waited = procs if wait_for is None else [procs[r] for r in wait_for]
    for p in waited:
        p.join(max(0.0, end - time.monotonic()))
    if wait_for is not None:
        for r, p in enumerate(procs):
            if r not in wait_for and p.is_alive():
                p.kill()
                p.join()
    results: list[dict] = []
    for r, (p, out) in enumerate(zip(procs, outs)):
        if p.is_alive():
            p.kill()
            p.join()
            results.append({"error": f"rank {r} did not finish within {deadline_s} s", "tb": ""})
        elif out.exists():
            results.append(json.loads(out.read_text()))
        else:
            results.append({"error": f"rank {r} exited with code {p.exitcode} and no result", "tb": ""})
    if not expect_errors:
        errors = [
            f"rank {r}: {res['error']}\n{res.get('tb', '')}"
            for r, res in enumerate(results)
            if "error" in res
        ]
        if errors:
            raise AssertionError("\n".join(errors))
    return results
