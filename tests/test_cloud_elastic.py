"""torchrun elastic restarts: a killed rank's job resumes from the last epoch checkpoint, bit-exactly.

Two gloo workers under `torchrun --max-restarts=3` with `--train-checkpoint-dir`.
Once a few epochs are checkpointed, rank 1 gets SIGKILL; torchrun restarts both
workers, they resume from the newest checkpoint and finish.  The result equals,
to the bit, an uninterrupted run of the same job: same accuracy and same final
loss (model, optimizer momentum, schedule and data order all came back).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

EPOCHS = 60


def job(tmp: Path, marker: str, restarts: int = 0, checkpoints: Path | None = None) -> subprocess.Popen[str]:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env["ELASTICFED_TEST_JOB"] = marker  # inherited by the workers: how the test finds them
    cmd = [
        str(torchrun), "--standalone", "--nproc_per_node=2", f"--max-restarts={restarts}", "-m",
        "elasticfed.cloud",
        "--train-epochs", str(EPOCHS), "--train-backend", "gloo", "--log-level", "info",
        # A restarted round whose gloo rendezvous fails (torch reuses the store; seen in CI as
        # "connectFullMesh ... Connection refused") then fails in 30 s and torchrun tries again,
        # instead of retrying the connection for the default 300 s.
        "--sync-timeout-s", "30",
    ]  # fmt: skip
    if checkpoints is not None:
        cmd += ["--train-checkpoint-dir", str(checkpoints)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp)


def result(proc: subprocess.Popen[str]) -> tuple[dict[str, Any], str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def worker(marker: str, rank: int) -> int | None:
    """The pid of this job's worker of `rank` (from the environment torchrun gave it)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(
                item.split("=", 1) for item in (entry / "environ").read_text().split("\0") if "=" in item
            )
        except OSError:
            continue
        if env.get("ELASTICFED_TEST_JOB") == marker and env.get("RANK") == str(rank) and "LOCAL_RANK" in env:
            return int(entry.name)
    return None


def test_a_killed_rank_is_restarted_by_torchrun_and_the_job_resumes_bit_exactly(tmp_path: Path) -> None:
    reference, _ = result(job(tmp_path, uuid.uuid4().hex))
    checkpoints = tmp_path / "checkpoints"
    marker = uuid.uuid4().hex
    # More than one restart allowed: a restart whose gloo rendezvous fails (seen once in CI:
    # "connectFullMesh ... Connection refused") is retried by torchrun, as in production.
    elastic = job(tmp_path, marker, restarts=3, checkpoints=checkpoints)
    deadline = time.monotonic() + 120
    victim = None
    while time.monotonic() < deadline and elastic.poll() is None:  # epoch 5 on disk: kill rank 1
        if (checkpoints / "ckpt-0000000005.safetensors").exists():
            victim = worker(marker, 1)
            if victim is not None:
                break
        time.sleep(0.01)
    assert victim is not None, "no checkpoint of epoch 5, or no rank-1 worker to kill"
    os.kill(victim, signal.SIGKILL)
    resumed, log = result(elastic)
    assert "resumed from" in log, log[-3000:]
    assert resumed["resumed_from_epoch"] >= 5 and resumed["epochs"] == EPOCHS, resumed
    assert resumed["resumed_from_epoch"] < EPOCHS  # the kill landed before the end
    # Bit-exact: model, momentum, learning-rate schedule and data order all came back.
    assert resumed["accuracy"] == reference["accuracy"], (resumed, reference)
    assert resumed["final_loss"] == reference["final_loss"], (resumed, reference)
    assert reference["accuracy"] >= 0.95, reference
