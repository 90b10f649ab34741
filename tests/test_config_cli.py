"""Role configs and the `elasticfed` CLI: every key from file or flag, every error names where."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elasticfed.cloud.config import CloudConfig, GatewaySettings
from elasticfed.cloud.gateway import GatewayOptions
from elasticfed.common import config as cfg
from elasticfed.common.cli import EXIT_USAGE, main
from elasticfed.edge.config import EdgeConfig


def write(tmp_path: Path, text: str, name: str = "edge.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_need_no_file() -> None:
    config = cfg.load(EdgeConfig)
    assert config.timeout_ms == 500 and config.sync_every == 1 and config.security.insecure is False


def test_file_then_flags_override_in_that_order(tmp_path: Path) -> None:
    path = write(tmp_path, "timeout_ms = 250\nsync_every = 4\n[security]\ninsecure = true\n")
    config = cfg.load(EdgeConfig, path, {"sync_every": "8"})
    assert (config.timeout_ms, config.sync_every, config.security.insecure) == (250, 8, True)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("timout_ms = 5\n", "unknown key 'timout_ms'; did you mean 'timeout_ms'?"),
        ("timeout_ms = 'fast'\n", "key 'timeout_ms' must be an integer, got 'fast'"),
        ("timeout_ms = 0\n", "key 'timeout_ms' must be >= 1, got 0"),
        ("timeout_ms = true\n", "key 'timeout_ms' must be an integer, got True"),
        ("log_level = 'loud'\n", "key 'log_level' must be one of debug, info, warning, error"),
        ("gateway = 'http://x'\n", "key 'gateway' must be a ZeroMQ TCP endpoint"),
        (
            "compression = 'topk:0'\n",
            "key 'compression' compression 'topk:0': the top-k ratio must be in (0, 1)",
        ),
        ("security = 3\n", "'security' must be a table"),
        ("[security]\ninsecur = true\n", "[security]: unknown key 'insecur'; did you mean 'insecure'?"),
        ("timeout_ms = \n", "not valid TOML"),
    ],
)
def test_file_errors_name_the_file_and_key(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(cfg.ConfigError) as info:
        cfg.load(EdgeConfig, path)
    assert str(path) in str(info.value)
    assert expected in str(info.value)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(cfg.ConfigError, match="nope.toml: no such config file"):
        cfg.load(EdgeConfig, tmp_path / "nope.toml")


def test_flag_errors_name_the_flag() -> None:
    with pytest.raises(cfg.ConfigError, match="--gateway-quorum: must be an integer"):
        cfg.load(CloudConfig, None, {"gateway.quorum": "many"})
    with pytest.raises(cfg.ConfigError, match="--insecure: must be true or false"):
        cfg.load(CloudConfig, None, {"security.insecure": "maybe"})


@pytest.mark.parametrize(
    ("cls", "overrides"),
    [
        (EdgeConfig, {"client_id": 'jetson "7"\tline', "timeout_ms": "42", "security.insecure": "true"}),
        (
            CloudConfig,
            {"edge_weight": "0.25", "gateway.round_deadline_s": "1e-2", "sync.strategy": "adaptive"},
        ),
    ],
)
def test_printed_config_reads_back_equal(tmp_path: Path, cls: type, overrides: dict[str, str]) -> None:
    changed = cfg.load(cls, None, overrides)
    assert changed != cls()
    path = write(tmp_path, cfg.to_toml(changed), "round.toml")
    assert cfg.load(cls, path) == changed


def test_compression_specs() -> None:
    from elasticfed.common.shared_settings import compression

    for good in ("none", "fp16", "bf16", "topk:0.01", "topk:1", "powersgd:4"):
        assert compression(good) is None, good
    for bad in ("topk", "topk:0", "topk:1.5", "powersgd:0", "zstd", "fp8"):
        assert compression(bad) is not None, bad


def test_cli_print_config_applies_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write(tmp_path, "[gateway]\nquorum = 2\n", "cloud.toml")
    code = main(
        [
            "cloud",
            "serve",
            "--config",
            str(path),
            "--gateway-max-staleness",
            "3",
            "--insecure",
            "--print-config",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "quorum = 2" in out and "max_staleness = 3" in out and "insecure = true" in out


def test_cli_bad_value_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["edge", "--timeout-ms", "-5"]) == EXIT_USAGE
    assert "--timeout-ms: must be >= 1, got -5" in capsys.readouterr().err


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.run(
        [sys.executable, "-m", "elasticfed.common.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_help_everywhere() -> None:
    for args in (
        [],
        ["demo"],
        ["cloud"],
        ["cloud", "train"],
        ["cloud", "serve"],
        ["edge"],
        ["keys"],
        ["keys", "generate"],
        ["linksim"],
    ):
        result = run_cli(*args, "--help")
        assert result.returncode == 0, (args, result.stderr)
        assert "usage: elasticfed" in result.stdout
    assert "--timeout-ms" in run_cli("edge", "--help").stdout


def test_cli_help_does_not_import_torch() -> None:
    # `elasticfed --help` on a Jetson should not wait seconds for torch to load.
    code = "import sys; from common.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


def test_no_command_prints_usage_and_fails() -> None:
    result = run_cli()
    assert result.returncode == EXIT_USAGE and "COMMAND" in result.stderr


def test_a_setting_of_an_unsupported_type_is_refused_at_declaration() -> None:
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Bad:
        hosts: list = cfg.setting(None, "a list, which flags and TOML here do not carry")

    with pytest.raises(TypeError, match="Bad.hosts"):
        list(cfg._keys(Bad))


def test_edge_compression_specs() -> None:
    from elasticfed.edge.config import uplink_compression_spec

    for good in ("none", "fp16", "int8", "topk:0.01", "topk:0.001+int8", "topk:0.05+fp16"):
        assert uplink_compression_spec(good) is None, good
    for bad in ("topk", "topk:0", "topk:1", "topk:1.5", "topk:x", "topk:0.01+bf8", "powersgd:4", "zstd"):
        assert uplink_compression_spec(bad) is not None, bad


def test_edge_refuses_a_compression_it_does_not_know(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["edge", "--compression", "powersgd:4", "--insecure"]) == 2
    assert "compression" in capsys.readouterr().err


def test_gateway_alone_refuses_a_bad_task(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["cloud", "serve", "--mode", "standalone", "--task", "nowhere.at_all:task", "--insecure"]
    assert main(argv) == 2
    assert "cannot import module 'nowhere.at_all'" in capsys.readouterr().err


def test_edge_refuses_a_mass_audit_with_nowhere_to_write_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["edge", "--audit-mass", "--state-dir", "", "--insecure"]) == 2
    assert "--audit-mass" in capsys.readouterr().err


def test_gateway_refuses_a_downlink_it_does_not_know(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["cloud", "serve", "--mode", "standalone", "--gateway-downlink", "topk:0", "--insecure"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--gateway-downlink" in err and "full or topk" in err


def test_the_buffered_rule_is_the_default_and_the_old_names_still_load_with_a_warning(
    tmp_path: Path,
) -> None:
    printed = run_cli("cloud", "serve", "--print-config")
    assert printed.returncode == 0, printed.stderr
    assert 'weighting = "buffered"' in printed.stdout
    for mode in ("standalone", "hybrid"):
        assert cfg.load(CloudConfig, None, {"mode": mode}).gateway.weighting == "buffered"
    for old, new in (("progress", "buffered"), ("success", "mean-step"), ("auto", "buffered")):
        with pytest.warns(FutureWarning, match=f"--gateway-weighting.*'{old}' is the old name of '{new}'"):
            assert cfg.load(CloudConfig, None, {"gateway.weighting": old}).gateway.weighting == new
        path = write(tmp_path, f'[gateway]\nweighting = "{old}"\n', "cloud.toml")
        with pytest.warns(FutureWarning, match=f"'{old}' is the old name of '{new}'"):
            assert cfg.load(CloudConfig, path).gateway.weighting == new
    with pytest.raises(cfg.ConfigError, match="must be one of buffered, mean-step; got 'fedavg'"):
        cfg.load(CloudConfig, None, {"gateway.weighting": "fedavg"})
    old_flag = run_cli("cloud", "serve", "--gateway-weighting", "success", "--print-config")
    assert old_flag.returncode == 0 and 'weighting = "mean-step"' in old_flag.stdout
    assert "FutureWarning" in old_flag.stderr
    assert "'success' is the old name of 'mean-step'" in old_flag.stderr


def test_edge_device_specs(capsys: pytest.CaptureFixture[str]) -> None:
    from elasticfed.edge.config import device_spec

    for good in ("auto", "cpu", "cuda", "cuda:1", "CUDA"):
        assert device_spec(good) is None, good
    for bad in ("gpu", "cuda:x", "cuda:", "mps", ""):
        assert device_spec(bad) is not None, bad
    assert main(["edge", "--train-device", "gpu", "--insecure"]) == 2
    assert "--train-device" in capsys.readouterr().err


def test_edge_refuses_a_gpu_it_does_not_have(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has the GPU the test asks for")
    # Asked for in so many words, a GPU that is not there is an error, not a silent CPU run.
    assert main(["edge", "--train-device", "cuda", "--insecure", "--state-dir", ""]) == 2
    assert "--train-device: cuda: torch sees no CUDA device" in capsys.readouterr().err


def test_every_gateway_setting_reaches_the_gateway_options() -> None:
    """`cloud serve` builds its gateway from the [gateway] section; a setting the mapping forgot
    would silently keep the built-in default whatever the config says."""
    options = {f.name for f in dataclasses.fields(GatewayOptions)}
    shared = [f.name for f in dataclasses.fields(GatewaySettings) if f.name in options]
    assert len(shared) >= 12, shared
    changed = {
        "bind": "tcp://127.0.0.1:9999",
        "norm_policy": "reject",
        "downlink": "topk:0.1",
        "audit_mass": True,
    }
    for name in shared:
        if name not in changed:
            value = getattr(GatewaySettings(), name)
            changed[name] = value * 2 + 17  # valid for every numeric setting's bounds
    built = GatewayOptions.from_settings(GatewaySettings(**changed))
    for name in shared:
        assert getattr(built, name) == changed[name], name
    assert built.downlink_ratio == 0.1
    # And a gateway built in code without options serves as `cloud serve` does by default.
    default = GatewayOptions.from_settings(GatewaySettings())
    assert GatewayOptions() == default


def test_a_task_spec_written_before_the_elasticfed_namespace_still_loads_with_a_warning() -> None:
    from elasticfed.common.task import TaskError, load_task

    with pytest.warns(FutureWarning, match="elasticfed.common.tasks.digits:task"):
        task = load_task("common.tasks.digits:task")
    assert task.metric == "accuracy"
    with pytest.raises(TaskError, match="cannot import module 'elasticfed.common.nothing'"):
        with pytest.warns(FutureWarning):
            load_task("common.nothing:task")
