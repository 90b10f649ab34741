"""The stdlib-lm task: its data is the same in every process, its held-out files never train, its
partitions split what they claim, its sizes are what the README says, and the short task names work."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from fleet import process_env

from elasticfed.cloud.config import CloudConfig, DemoConfig
from elasticfed.common import config as cfg
from elasticfed.common.task import Task, TaskError, load_task, shard
from elasticfed.common.tasks import BUILT_IN
from elasticfed.common.tasks import stdlib_lm as lm
from elasticfed.edge.config import EdgeConfig

ROOT = Path(__file__).resolve().parents[1]

# Printed by a fresh interpreter (its own hash seed): what the data looks like from another process.
FINGERPRINT = """
import hashlib, json, sys
sys.path.insert(0, sys.argv[1])
from elasticfed.common.tasks import stdlib_lm as lm
train, test = lm.train_set(128), lm.test_set(128)
held = [p for p, out in zip(train.corpus.paths, train.corpus.held_out) if out]
print(json.dumps({
    "held_out": held,
    "train": hashlib.sha256(train.starts.numpy().tobytes()).hexdigest(),
    "test": hashlib.sha256(test.starts.numpy().tobytes()).hexdigest(),
    "bytes": hashlib.sha256(train.corpus.data.numpy().tobytes()).hexdigest(),
}))
"""


def _fingerprint() -> dict[str, object]:
    train, test = lm.train_set(128), lm.test_set(128)
    return {
        "held_out": [p for p, out in zip(train.corpus.paths, train.corpus.held_out) if out],
        "train": hashlib.sha256(train.starts.numpy().tobytes()).hexdigest(),
        "test": hashlib.sha256(test.starts.numpy().tobytes()).hexdigest(),
        "bytes": hashlib.sha256(train.corpus.data.numpy().tobytes()).hexdigest(),
    }


def test_windows_and_held_out_files_are_the_same_across_loads_and_processes() -> None:
    first = _fingerprint()
    lm.load_corpus.cache_clear()
    assert _fingerprint() == first  # read again from disk
    # Another process with a hash seed of its own (this one's is random unless set): a hash() slip shows.
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    env = {**os.environ, "PYTHONHASHSEED": seed}
    result = subprocess.run(
        [sys.executable, "-c", FINGERPRINT, str(ROOT)], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == first


def test_the_corpus_is_read_once_per_process() -> None:
    assert lm.train_set(128).corpus is lm.test_set(256).corpus


def test_held_out_files_never_train_and_are_about_seven_percent_of_the_bytes() -> None:
    train, test = lm.train_set(128), lm.windows(lm.load_corpus(str(lm.stdlib_root())), 128, held_out=True)
    corpus = train.corpus
    assert set(train.files.tolist()).isdisjoint(test.files.tolist())
    assert all(not corpus.held_out[f] for f in set(train.files.tolist()))
    assert all(corpus.held_out[f] for f in set(test.files.tolist()))
    sizes = (corpus.offsets[1:] - corpus.offsets[:-1]).tolist()
    held = sum(s for s, out in zip(sizes, corpus.held_out) if out) / sum(sizes)
    assert 0.03 < held < 0.15, held
    # The rule is the path's SHA-256, nothing else.
    assert [lm.is_held_out(p) for p in corpus.paths] == list(corpus.held_out)


def test_the_evaluation_set_is_bounded_spread_and_a_parameter() -> None:
    every = lm.windows(lm.load_corpus(str(lm.stdlib_root())), 128, held_out=True)
    test = lm.test_set(128)
    assert len(test) == lm.EVAL_WINDOWS < len(every)
    assert len(set(test.files.tolist())) > lm.EVAL_WINDOWS // 4  # many files, not the first one
    assert len(lm.task(eval_windows=16).test_set()) == 16


def test_windows_stay_inside_one_file_and_predict_the_next_byte() -> None:
    train = lm.train_set(128)
    corpus = train.corpus
    for i in (0, 1, len(train) // 2, len(train) - 1):
        start, f = int(train.starts[i]), int(train.files[i])
        assert corpus.offsets[f] <= start and start + 129 <= corpus.offsets[f + 1]
        x, y = train[i]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (128,)
        assert torch.equal(x[1:], y[:-1])


def test_no_test_suites_or_installed_packages_in_the_data() -> None:
    paths = lm.train_set(128).corpus.paths
    parts = {part for p in paths for part in p.split("/")[:-1]}
    assert parts.isdisjoint({"test", "tests", "site-packages", "dist-packages", "encodings"})
    assert "os.py" in paths and "json/decoder.py" in paths


def test_the_package_partition_gives_each_part_whole_packages_and_covers_every_window() -> None:
    train = lm.train_set(128)
    groups = train.groups()
    parts = [shard(train, i, 4, "package", seed=3) for i in range(4)]
    owned = [{groups[j] for j in part.indices} for part in parts]
    for a in range(4):
        for b in range(a + 1, 4):
            assert owned[a].isdisjoint(owned[b])
    everything = sorted(j for part in parts for j in part.indices)
    assert everything == list(range(len(train)))
    sizes = [len(part) for part in parts]
    assert max(sizes) < 1.5 * min(sizes), (
        sizes
    )  # balanced by bytes (windows), as well as whole packages allow
    again = shard(train, 2, 4, "package", seed=3)
    assert again.indices == parts[2].indices  # deterministic with the seed
    assert "json" in {g for g in groups} and "os" in set(groups)  # packages, and modules as their own


def test_the_iid_partition_is_disjoint_and_covering() -> None:
    train = lm.train_set(128)
    parts = [shard(train, i, 3, "iid", seed=0) for i in range(3)]
    everything = sorted(j for part in parts for j in part.indices)
    assert everything == list(range(len(train)))


def test_partitions_that_do_not_fit_the_data_say_so() -> None:
    with pytest.raises(ValueError, match="not one label each"):
        shard(lm.train_set(128), 0, 4, "shards")
    digits = load_task("digits").train_set()
    with pytest.raises(ValueError, match="groups"):
        shard(digits, 0, 4, "package")
    with pytest.raises(ValueError, match="iid, shards, package"):
        shard(digits, 0, 4, "by-colour")


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_model_sizes_are_as_documented() -> None:
    torch.manual_seed(0)
    small, base = lm.task().build_model(), lm.base_task().build_model()
    assert 0.8e6 <= _params(small) <= 1.3e6, _params(small)
    assert 5e6 <= _params(base) <= 10e6, _params(base)
    assert small.context == 128 and base.context >= 256
    assert lm.task().train_set()[0][0].shape == (128,)
    assert lm.base_task().train_set()[0][0].shape == (base.context,)


def test_initialisation_is_deterministic_given_the_seed() -> None:
    torch.manual_seed(5)
    a = lm.task().build_model().state_dict()
    torch.manual_seed(5)
    b = lm.task().build_model().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_loss_evaluate_and_sample_shapes() -> None:
    task = lm.task(eval_windows=8)
    torch.manual_seed(0)
    model = task.build_model()
    x, y = next(iter(torch.utils.data.DataLoader(task.train_set(), batch_size=3)))
    logits = model(x)
    assert logits.shape == (3, 128, 256)
    loss = task.loss(logits, y)
    assert loss.shape == () and abs(float(loss.detach()) - math.log(256)) < 0.4
    model.train()
    bpb = task.evaluate(model, task.test_set())
    assert abs(bpb - 8.0) < 0.5, bpb  # untrained: about a uniform guess, log2(256) bits
    assert model.training  # evaluate restores the mode it found
    text = lm.sample(model, b"def ", 20, seed=1)
    assert text.startswith(b"def ") and len(text) == 24
    assert lm.sample(model, b"def ", 20, seed=1) == text
    assert lm.sample(model, b"x" * 300, 2, temperature=0).startswith(b"x" * 300)  # longer than the context
    assert task.sample is not None  # the demo's: a prompt and a length bound to `sample`


def test_a_short_training_run_lowers_bits_per_byte() -> None:
    """A tiny model of the same kind, the task's loss and metric: 60 SGD steps take it well below 8 bits."""
    task = lm.task(eval_windows=8)
    torch.manual_seed(0)
    model = lm.ByteLM(context=32, dim=32, layers=1, heads=2)
    train = lm.windows(lm.load_corpus(str(lm.stdlib_root())), 32, held_out=False)
    test = lm.windows(train.corpus, 32, held_out=True)
    test = lm.Windows(test.corpus, test.starts[:: len(test) // 32], test.files[:: len(test) // 32], 32)
    before = task.evaluate(model, test)
    loader = torch.utils.data.DataLoader(
        train, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    opt = torch.optim.SGD(model.parameters(), lr=task.lr, momentum=task.momentum)
    for step, (x, y) in enumerate(loader):
        loss = task.loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 60:
            break
    after = task.evaluate(model, test)
    assert after < before - 2.0, (before, after)


@pytest.mark.slow
def test_the_small_task_trains_visibly_with_its_own_settings() -> None:
    task = lm.task(eval_windows=16)
    torch.manual_seed(0)
    model = task.build_model()
    before = task.evaluate(model, task.test_set())
    loader = torch.utils.data.DataLoader(
        task.train_set(), batch_size=task.batch_size, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    opt = torch.optim.SGD(model.parameters(), lr=task.lr, momentum=task.momentum)
    for step, (x, y) in enumerate(loader):
        loss = task.loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 80:
            break
    after = task.evaluate(model, task.test_set())
    assert after < before - 3.0, (before, after)


def test_the_metric_is_named_with_its_direction() -> None:
    task = lm.task()
    assert (task.metric, task.metric_label, task.higher_is_better) == ("bits_per_byte", "bpb", False)
    assert task.describe(3.14159) == "bits per byte 3.142 (lower is better)"
    assert task.figures(2.5) == {
        "metric": "bits_per_byte",
        "bits_per_byte": 2.5,
        "metric_higher_is_better": False,
    }
    digits = load_task("digits")
    assert digits.describe(0.95) == "accuracy 95.00% (higher is better)"
    assert digits.figures(0.95)["accuracy"] == 0.95


@pytest.mark.parametrize(
    ("name", "function"),
    [("digits", "task"), ("stdlib-lm", "task"), ("stdlib-lm-base", "base_task")],
)
def test_short_names_resolve_to_the_built_ins(name: str, function: str) -> None:
    task = load_task(name)
    assert isinstance(task, Task) and task.name == name
    assert BUILT_IN[name].endswith(f":{function}")
    assert load_task(BUILT_IN[name]).name == name  # module:function still works


def test_an_unknown_short_name_lists_the_known_ones() -> None:
    with pytest.raises(
        TaskError, match=r"'stdlib-llm': not a built-in task \(digits, stdlib-lm, stdlib-lm-base\)"
    ):
        load_task("stdlib-llm")


def test_every_role_accepts_short_names_and_module_function() -> None:
    for role in (EdgeConfig, CloudConfig, DemoConfig):
        assert cfg.load(role).task == "digits"
        assert cfg.load(role, None, {"task": "stdlib-lm-base"}).task == "stdlib-lm-base"
        assert cfg.load(role, None, {"task": "mypkg.mytask:task"}).task == "mypkg.mytask:task"
        with pytest.raises(cfg.ConfigError, match="built-in task"):
            cfg.load(role, None, {"task": "stdlib-llm"})
    assert cfg.load(EdgeConfig, None, {"train.partition": "package"}).train.partition == "package"
    assert cfg.load(DemoConfig, None, {"partition": "package"}).partition == "package"


def test_a_missing_stdlib_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = sysconfig.get_paths

    def moved(*args: object, **kwargs: object) -> dict[str, str]:
        return {**real(*args, **kwargs), "stdlib": str(tmp_path / "nowhere")}  # type: ignore[arg-type]

    monkeypatch.setattr(sysconfig, "get_paths", moved)
    with pytest.raises(TaskError, match=r"no standard library sources at .*nowhere.*sysconfig"):
        lm.task().train_set()
    (tmp_path / "nowhere").mkdir()
    with pytest.raises(TaskError, match="no .py files"):
        lm.task().test_set()


def test_a_small_fake_stdlib_splits_by_its_own_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for path, size in {"alpha/__init__.py": 500, "alpha/x.py": 3000, "beta/y.py": 2000, "gamma.py": 1500,
                       "delta/z.py": 1000, "test/test_alpha.py": 4000}.items():  # fmt: skip
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(bytes(i % 251 for i in range(size)))
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(tmp_path)})
    train = lm.train_set(64)
    assert "test/test_alpha.py" not in train.corpus.paths
    groups = train.groups()
    assert set(groups) <= {"alpha", "beta", "gamma", "delta"}
    owned = [{groups[j] for j in shard(train, i, 2, "package").indices} for i in range(2)]
    assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == set(groups)


def _demo(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elasticfed.common.cli", "demo", *flags],
        capture_output=True,
        text=True,
        env=process_env(),
        timeout=600,
    )


@pytest.mark.slow
def test_the_demo_shows_bits_per_byte_falling_and_ends_with_sampled_text() -> None:
    result = _demo("--task", "stdlib-lm", "--edges", "2", "--time-limit-s", "40", "--drain-s", "5")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["metric"] == "bits_per_byte" and figures["metric_higher_is_better"] is False
    assert "accuracy" not in figures and figures["audit_ok"]
    first = float(out.split(" bpb ", 1)[1].split()[0])  # the progress line's first figure
    assert first > 7.5 and figures["bits_per_byte"] < first - 0.5, out[-3000:]
    assert "test bits per byte" in out and "(lower is better)" in out
    assert "sampled from the final model:\n    | def " in out


@pytest.mark.slow
def test_the_demo_refuses_a_partition_its_task_cannot_split() -> None:
    result = _demo("--task", "digits", "--partition", "package")
    assert result.returncode == 2
    assert "--partition package" in result.stderr and "groups" in result.stderr


@pytest.mark.slow
def test_an_edge_refuses_a_partition_its_task_cannot_split() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "elasticfed.edge", "--task", "digits", "--train-shard", "0/4",
        "--train-partition",
         "package", "--insecure", "--state-dir", ""],
        capture_output=True, text=True, env=process_env(), timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "elasticfed edge: error: --train-partition package" in result.stderr
