"""deploy/: the artefacts parse, agree with each other and with the CLI, and the edge installer works.

What cannot run here is checked as far as it can be: no container runtime, no
cluster, no Jetson. So the Dockerfiles are parsed, not built; the Kubernetes
manifests are checked field by field, and the key folder the init container
assembles is rebuilt on disk the way the kubelet lays out Secret and ConfigMap
volumes and handed to the real gateway code; the systemd unit goes through
`systemd-analyze verify`; the edge installer's Python side runs for real, with
pip cut off from every index, so that it cannot have fetched torch.

Every flag the artefacts pass and every metric the dashboard queries is looked
up in the CLI's --help and in the code's metric declarations: a rename there
fails here.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CLOUD = DEPLOY / "cloud"
EDGE = DEPLOY / "edge"
K8S = CLOUD / "k8s"
UNIT = EDGE / "elasticfed-edge.service"
# The version of NVIDIA's torch wheel for JetPack 6.0 (torch-2.3.0a0+40ec155e58.nv24.03).
JETPACK_TORCH = "2.3.0a0+40ec155e58.nv24.03"

# --- the CLI and the metric families, as the code declares them ---------------------------------


def _cli(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "elasticfed.common.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        **kwargs,
    )


@cache
def _flags(role: tuple[str, ...]) -> frozenset[str]:
    """The long options `elasticfed <role> --help` lists."""
    result = _cli(*role, "--help")
    assert result.returncode == 0, result.stderr
    return frozenset(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", result.stdout))


def _check_flags(role: tuple[str, ...], args: list[str]) -> None:
    """Every --flag in args is one `elasticfed <role>` takes."""
    missing = sorted({a.split("=")[0] for a in args if a.startswith("--")} - _flags(role))
    assert not missing, f"`elasticfed {' '.join(role)} --help` does not list {missing}"


def _metric_families() -> set[str]:
    """Exposed names of every metric declared in cloud/, edge/, common/ (prefix elasticfed_)."""
    names: set[str] = set()
    declaration = re.compile(r"\.(counter|gauge|histogram)\(\s*\"([a-z][a-z0-9_]*)\"", re.S)
    # Gauges computed at scrape time (common/metrics_http.py's ExtraGauge): ("name", "help", callable).
    extra = re.compile(r"\(\s*\"([a-z][a-z0-9_]*)\",\s*f?\"[^\"]*\",", re.S)
    for package in ("cloud", "edge", "common"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            for kind, name in declaration.findall(text):
                full = f"elasticfed_{name}"
                names.update(
                    {f"{full}_bucket", f"{full}_sum", f"{full}_count"} if kind == "histogram" else {full}
                )
            if "-> list[ExtraGauge]" in text:
                names.update(f"elasticfed_{name}" for name in extra.findall(text))
    assert len(names) > 20, "the metric declarations were not found: has the registry API changed?"
    return names


# --- shell scripts ------------------------------------------------------------------------------


def _shellcheck() -> str:
    found = shutil.which("shellcheck")
    if found is None:
        pytest.skip("shellcheck is not installed (CI installs it: .ci/run)")
    return found


@pytest.mark.parametrize("script", sorted(DEPLOY.rglob("*.sh")), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_shell_script_passes_shellcheck(script: Path) -> None:
    result = subprocess.run(
        [_shellcheck(), "--external-sources", str(script)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in script.read_text()
    assert os.access(script, os.X_OK), f"{script} is not executable (git update-index --chmod=+x)"


def test_init_container_script_passes_shellcheck() -> None:
    script = _init_container()["command"][2]
    result = subprocess.run([_shellcheck(), "--shell=sh", "-"], input=script, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# --- the edge: systemd unit, configuration, install script --------------------------------------


def _unit() -> dict[str, list[tuple[str, str]]]:
    """Sections of the unit file, each a list of (key, value): keys may repeat."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def _unit_value(section: str, key: str) -> str:
    values = [v for k, v in _unit()[section] if k == key]
    assert values, f"{UNIT.name}: no {key}= in [{section}]"
    return values[-1]


def _seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|min|)", value)
    assert match, f"cannot read {value!r} as a time span"
    return float(match.group(1)) * (60 if match.group(2) == "min" else 1)


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """`systemd-analyze verify` on a copy whose ExecStart names an executable that exists here.

    verify exits 0 even for unknown keys or values it cannot parse ("..., ignoring"), so
    any line it prints about the unit file fails the test too.
    """
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (CI installs systemd: .ci/run)")
    real = shutil.which("elasticfed", path=str(Path(sys.executable).parent)) or shutil.which("true")
    assert real
    text = UNIT.read_text()
    assert "/opt/elasticfed/venv/bin/elasticfed" in text
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace("/opt/elasticfed/venv/bin/elasticfed", real))
    result = subprocess.run([analyze, "verify", "--man=no", str(copy)], capture_output=True, text=True)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    about_unit = [line for line in output.splitlines() if UNIT.name in line]
    assert not about_unit, "\n".join(about_unit)


def test_unit_restarts_stops_and_confines_the_agent_as_the_cli_needs() -> None:
    from elasticfed.edge.run import EXIT_REFUSED

    edge = tomllib.loads((EDGE / "edge.toml").read_text())
    assert _unit_value("Service", "Restart") == "on-failure"
    prevented = set(_unit_value("Service", "RestartPreventExitStatus").split())
    assert {"2", str(EXIT_REFUSED)} <= prevented, "bad configuration (2) and refusals (4) must not restart"
    assert "5" not in prevented, "undelivered gradients (5) are sent after a restart"
    assert _unit_value("Service", "KillSignal") == "SIGTERM"
    assert _unit_value("Service", "KillMode") in ("mixed", "control-group")
    stop = _seconds(_unit_value("Service", "TimeoutStopSec"))
    assert stop >= edge["drain_s"] + 30, f"TimeoutStopSec {stop} s leaves no time to save after drain_s"
    # The agent runs unprivileged, from the venv, with this configuration file.
    assert _unit_value("Service", "User") not in ("", "root")
    argv = shlex.split(_unit_value("Service", "ExecStart"))
    assert argv[0] == "/opt/elasticfed/venv/bin/elasticfed" and argv[1] == "edge"
    assert argv[argv.index("--config") + 1] == "/etc/elasticfed/edge.toml"
    assert _unit_value("Service", "ConfigurationDirectory") == "elasticfed"
    assert _unit_value("Service", "StateDirectory") == "elasticfed"
    assert Path(edge["state_dir"]).is_relative_to("/var/lib/elasticfed")
    assert _unit_value("Service", "ReadWritePaths") == "/var/lib/elasticfed"
    assert _unit_value("Service", "NoNewPrivileges") == "yes"
    assert _unit_value("Service", "ProtectSystem") == "strict"
    for key in ("MemoryMax", "TasksMax", "Nice"):
        _unit_value("Service", key)
    assert _unit_value("Service", "EnvironmentFile") == "-/etc/elasticfed/edge.env"
    # The unit's flags come from edge.env; $VAR (not ${VAR}) splits them into words.
    assert argv[-1] == "$ELASTICFED_EDGE_FLAGS"


def _edge_env_flags() -> list[str]:
    values = {}
    for line in (EDGE / "edge.env").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = shlex.split(value)[0] if value.strip() else ""
    return shlex.split(values["ELASTICFED_EDGE_FLAGS"])


def test_edge_toml_is_a_valid_edge_configuration() -> None:
    result = _cli("edge", "--config", str(EDGE / "edge.toml"), "--print-config")
    assert result.returncode == 0, result.stderr
    printed = tomllib.loads(result.stdout)
    assert printed["state_dir"] == "/var/lib/elasticfed/edge"
    assert printed["metrics_bind"] == "0.0.0.0:9401"  # what prometheus.yml's edge job scrapes
    assert 0 < printed["thermal"]["resume_below_c"] < printed["thermal"]["pause_above_c"] < 99
    assert printed["security"]["device_secret_key"].startswith("/etc/elasticfed/keys/")
    assert not printed["security"]["insecure"]


def test_edge_env_flags_exist() -> None:
    lines = (EDGE / "edge.env").read_text().splitlines()
    examples = [
        shlex.split(m) for line in lines for m in re.findall(r'^#\s+ELASTICFED_EDGE_FLAGS="([^"]*)"', line)
    ]
    assert examples
    for flags in [_edge_env_flags(), *examples]:
        _check_flags(("edge",), flags)
        result = _cli("edge", "--config", str(EDGE / "edge.toml"), *flags, "--print-config")
        assert result.returncode == 0, result.stderr


def _base_python() -> str:
    """The interpreter this test's venv was made from: a venv made by it does not see this venv."""
    base = Path(sys.base_prefix) / "bin"
    for name in (f"python{sys.version_info.major}.{sys.version_info.minor}", "python3"):
        if (base / name).exists():
            return str(base / name)
    pytest.fail(f"no base interpreter in {base}")


def _system_python(root: Path) -> tuple[str, Path]:
    """A stand-in for JetPack's system Python: this machine's base interpreter, copied to
    root/bin, with its standard library linked and its own, empty site-packages, into which
    go torch and numpy (and what torch needs) from this environment. Returns the
    interpreter and its site-packages. A venv made by it sees that torch only with
    --system-site-packages, as on a device."""
    from packaging.requirements import Requirement

    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    base, prefix = Path(_base_python()).resolve(), Path(sys.base_prefix)
    stdlib = prefix / "lib" / version
    assert (stdlib / "os.py").exists(), f"no standard library at {stdlib}"
    (root / "bin").mkdir(parents=True)
    shutil.copy2(base, root / "bin" / version)
    for entry in (prefix / "lib").iterdir():  # libpython, if the interpreter uses a shared one
        if entry.name != version:
            (root / "lib" / entry.name).parent.mkdir(parents=True, exist_ok=True)
            (root / "lib" / entry.name).symlink_to(entry)
    (root / "lib" / version).mkdir(parents=True)
    for entry in stdlib.iterdir():
        if entry.name not in ("site-packages", "dist-packages"):
            (root / "lib" / version / entry.name).symlink_to(entry)
    python = str(root / "bin" / version)
    probe = subprocess.run(
        [python, "-I", "-c", "import site, sys; print(sys.prefix); print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
    )
    assert probe.returncode == 0, probe.stderr
    where, target = probe.stdout.split()
    assert Path(where) == root, f"the copied interpreter took {where} as its prefix, not {root}"
    target = Path(target)
    target.mkdir(parents=True)

    seen: set[str] = set()
    todo = ["torch", "numpy"]
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        name = dist.metadata["Name"].lower()
        if name in seen:
            continue
        seen.add(name)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}:
            source = Path(dist.locate_file(top))
            if not source.exists() or (target / top).exists():
                continue
            if name == "torch" and top.endswith(".dist-info"):
                # As NVIDIA numbers its JetPack wheels: a pre-release, which does not satisfy
                # pyproject's torch>=2.3. A pip that asked for torch would go looking for one.
                shutil.copytree(source, target / top)
                metadata = target / top / "METADATA"
                text = re.sub(r"(?m)^Version: .*$", f"Version: {JETPACK_TORCH}", metadata.read_text())
                metadata.write_text(text)
            else:
                (target / top).symlink_to(source)
    assert (target / "torch").exists()
    return python, target


def _wheelhouse(target: Path) -> Path:
    """Wheels of elasticfed's dependencies and build backend, never torch or numpy."""
    from packaging.requirements import Requirement

    requires = [Requirement(r) for r in importlib.metadata.requires("elasticfed") or []]
    wanted = [
        str(r)
        for r in requires
        if r.name not in ("torch", "numpy") and (r.marker is None or "extra" not in str(r.marker))
    ]
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--only-binary=:all:",
            "--dest",
            str(target),
            *build,
            *wanted,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"pip download (PyPI must be reachable):\n{result.stderr}"
    assert not list(target.glob("torch-*")), "the wheelhouse must not hold torch"
    return target


def _install(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ)
    for name in list(full):
        if name.startswith(("PIP_", "PYTHON")) or name == "VIRTUAL_ENV":
            del full[name]
    full.update(env)
    return subprocess.run(
        ["bash", str(EDGE / "install.sh")],
        capture_output=True,
        text=True,
        env=full,
        timeout=600,
        cwd=tmp_path,
    )


def test_install_script_refuses_other_machines_and_a_missing_torch(tmp_path: Path) -> None:
    base = _base_python()
    if os.uname().machine != "aarch64":
        result = _install(tmp_path, PYTHON=base, SKIP_SYSTEM="1")
        assert result.returncode != 0
        assert "aarch64" in result.stderr and "ALLOW_NON_JETSON" in result.stderr
    if subprocess.run([base, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip(f"{base} has torch: cannot check the message for a device without it")
    result = _install(tmp_path, PYTHON=base, SKIP_SYSTEM="1", ALLOW_NON_JETSON="1", VENV=str(tmp_path / "v"))
    assert result.returncode == 3, result.stdout + result.stderr
    assert "cannot import torch" in result.stderr
    assert "install-pytorch-jetson-platform" in result.stderr  # where NVIDIA's wheels are
    assert not (tmp_path / "v").exists(), "nothing may be installed before the checks pass"


@pytest.mark.slow
def test_install_script_python_side_uses_the_system_torch_and_never_downloads_it(tmp_path: Path) -> None:
    """install.sh SKIP_SYSTEM=1 into a temporary venv, as on a Jetson whose torch is NVIDIA's.

    The "system" Python is a copy of this machine's interpreter whose own site-packages holds
    torch, with the version NVIDIA gives its wheels: a pre-release, which pyproject's
    torch>=2.3 does not accept. pip runs with no index at all and a wheelhouse
    that holds every dependency except torch and numpy: had the script let pip look at
    elasticfed's torch requirement, the install would fail. Then torch in the venv must come
    from the system site-packages (the venv sees it only with --system-site-packages), and
    the CLI must run.
    """
    python, system = _system_python(tmp_path / "system-python")
    wheels = _wheelhouse(tmp_path / "wheels")
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for package in ("protocol", "common", "cloud", "edge"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    env = {
        "PYTHON": python,
        "VENV": str(venv),
        "ELASTICFED_SRC": str(source),
        "EXTRAS": "",
        "SKIP_SYSTEM": "1",
        "ALLOW_NON_JETSON": "1",
        "PIP_CONFIG_FILE": os.devnull,  # no index, find-links or constraints from this machine's config
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(wheels),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    result = _install(tmp_path, **env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"torch=={JETPACK_TORCH}" in result.stdout  # the constraint that pins it
    assert not re.search(r"(?im)^(collecting|downloading|processing\s.*)torch", result.stdout)

    check = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import torch, sys; print(torch.__file__); print(sys.prefix)"],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
    )
    assert check.returncode == 0, check.stderr
    torch_file, prefix = check.stdout.split()
    assert Path(prefix) == venv
    assert Path(torch_file).is_relative_to(system), f"torch came from {torch_file}"
    assert not list(venv.glob("lib/python*/site-packages/torch*")), "torch was installed into the venv"
    assert list(venv.glob("lib/python*/site-packages/elasticfed-*.dist-info"))
    assert list(venv.glob("lib/python*/site-packages/zmq")), "the other dependencies go into the venv"

    cli = subprocess.run(
        [str(venv / "bin" / "elasticfed"), "edge", "--help"],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
    )
    assert cli.returncode == 0, cli.stderr
    assert "--security-device-secret-key" in cli.stdout


# --- Dockerfiles --------------------------------------------------------------------------------


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, args = line.partition(" ")
        out.append((keyword.upper(), args.strip()))
    assert not pending, f"{path}: ends inside a continued line"
    return out


def _from_image(instructions: list[tuple[str, str]]) -> str:
    args: dict[str, str] = {}
    for keyword, rest in instructions:
        if keyword == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = value
        elif keyword == "FROM":
            return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], rest.split()[0])
        else:
            pytest.fail(f"{keyword} before FROM")
    pytest.fail("no FROM")


def _dockerfile_checks(path: Path) -> list[tuple[str, str]]:
    instructions = _instructions(path)
    known = {
        "FROM",
        "ARG",
        "ENV",
        "RUN",
        "COPY",
        "WORKDIR",
        "ENTRYPOINT",
        "CMD",
        "EXPOSE",
        "VOLUME",
        "STOPSIGNAL",
        "USER",
        "LABEL",
        "HEALTHCHECK",
        "SHELL",
    }
    assert {k for k, _ in instructions} <= known, f"{path}: unknown instruction"
    for keyword, rest in instructions:
        if keyword == "RUN":
            for command in re.split(r"&&|;|\|\|", rest):
                if re.search(r"\bpip3?\s+install\b|-m\s+pip\s+install\b", command):
                    words = command.split()
                    assert not any(re.fullmatch(r"['\"]?torch([<>=!~].*)?['\"]?", w) for w in words), (
                        f"{path}: pip install of torch would replace the base image's: {command.strip()}"
                    )
        if keyword == "COPY":
            *sources, _ = rest.split()
            for source in sources:
                if not source.startswith("--"):
                    assert (ROOT / source).exists(), f"{path}: COPY {source}: no such file"
                    ignore = (path.parent / (path.name + ".dockerignore")).read_text().split()
                    assert f"!{source}" in ignore or f"!{source}/" in ignore, (
                        f"{path}: COPY {source} but {path.name}.dockerignore leaves it out of the context"
                    )
    entry = [rest for keyword, rest in instructions if keyword == "ENTRYPOINT"]
    assert len(entry) == 1 and json.loads(entry[0]), f"{path}: one ENTRYPOINT, exec form (signals reach it)"
    return instructions


def test_edge_dockerfile_builds_on_l4t_pytorch_without_touching_torch() -> None:
    instructions = _dockerfile_checks(EDGE / "Dockerfile")
    assert re.fullmatch(r"(dustynv|nvcr\.io/nvidia)/l4t-pytorch:r36\.[\d.]+.*", _from_image(instructions))
    runs = " ".join(rest for keyword, rest in instructions if keyword == "RUN")
    assert "deploy/edge/install.sh" in runs and "SKIP_SYSTEM=1" in runs
    entry = json.loads(next(rest for keyword, rest in instructions if keyword == "ENTRYPOINT"))
    cmd = json.loads(next(rest for keyword, rest in instructions if keyword == "CMD"))
    assert entry == ["elasticfed", "edge"]
    assert cmd == ["--config", "/etc/elasticfed/edge.toml"]
    assert ("EXPOSE", "9401") in instructions


def test_cloud_dockerfile_builds_on_cuda_pytorch_and_pins_its_torch() -> None:
    instructions = _dockerfile_checks(CLOUD / "Dockerfile")
    assert re.fullmatch(r"pytorch/pytorch:2\.\d+\.\d+-cuda[\d.]+-cudnn\d+-runtime", _from_image(instructions))
    runs = " ".join(rest for keyword, rest in instructions if keyword == "RUN")
    assert '"torch==" + m.version("torch")' in runs and "--constraint /tmp/base-image.txt" in runs
    copies = [rest.split() for keyword, rest in instructions if keyword == "COPY"]
    assert ["deploy/cloud/launch.sh", "/usr/local/bin/elasticfed-launch"] in copies
    assert json.loads(next(rest for keyword, rest in instructions if keyword == "ENTRYPOINT")) == [
        "elasticfed-launch"
    ]


# --- Kubernetes ---------------------------------------------------------------------------------


@cache
def _manifests() -> tuple[dict[str, Any], ...]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append(doc)
    return tuple(docs)


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in _manifests() if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _job() -> dict[str, Any]:
    return _one("Job")


def _worker() -> dict[str, Any]:
    containers = _job()["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _init_container() -> dict[str, Any]:
    (init,) = _job()["spec"]["template"]["spec"]["initContainers"]
    return init


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _mount(container: dict[str, Any], volume: str) -> dict[str, Any]:
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume]
    return mount


def _volume(name: str) -> dict[str, Any]:
    (volume,) = [v for v in _job()["spec"]["template"]["spec"]["volumes"] if v["name"] == name]
    return volume


def _cloud_toml() -> str:
    return _one("ConfigMap", "elasticfed-config")["data"]["cloud.toml"]


def test_every_manifest_is_well_formed() -> None:
    kinds = [d["kind"] for d in _manifests()]
    assert {"Namespace", "Service", "Job", "ConfigMap", "PersistentVolumeClaim"} <= set(kinds)
    namespace = _one("Namespace")["metadata"]["name"]
    for doc in _manifests():
        assert doc.get("apiVersion") and doc.get("kind") and doc["metadata"].get("name"), doc
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == namespace, doc["metadata"]
    assert "Secret" not in kinds, "secrets are made from the key folder (sync-keys.sh), never committed"


def _pod_labels() -> dict[str, str]:
    return _job()["spec"]["template"]["metadata"]["labels"]


def _selects_rank0(service: dict[str, Any]) -> None:
    """The Service selects the worker pod of index 0: the label the Job controller sets on it."""
    selector = service["spec"]["selector"]
    assert selector.get("batch.kubernetes.io/job-completion-index") == "0"
    rest = {k: v for k, v in selector.items() if k != "batch.kubernetes.io/job-completion-index"}
    assert rest and rest.items() <= _pod_labels().items(), "the selector must match the worker pods' labels"


def _port(service: dict[str, Any], number: int) -> dict[str, Any]:
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == number]
    named = {p["name"]: p["containerPort"] for p in _worker()["ports"]}
    target = port.get("targetPort", number)
    assert named.get(target, target) == number, f"port {number} reaches container port {target}"
    return port


def test_gateway_service_exposes_7878_of_rank_0() -> None:
    gateway = _one("Service", "elasticfed-gateway")
    assert gateway["spec"]["type"] in ("LoadBalancer", "NodePort")
    assert _port(gateway, 7878)["protocol"] == "TCP"
    _selects_rank0(gateway)
    env = _env(_worker())
    assert env["GATEWAY_BIND"] == "tcp://*:7878"


def test_metrics_service_selects_rank_0_with_scrape_annotations() -> None:
    metrics = _one("Service", "elasticfed-metrics")
    _port(metrics, 9400)
    _selects_rank0(metrics)
    annotations = metrics["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "9400"
    assert _env(_worker())["METRICS_BIND"].endswith(":9400")


def test_rendezvous_service_is_headless_and_names_the_job_pods() -> None:
    job = _job()
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"], "every node runs at once: a rendezvous needs all"
    headless = _one("Service", pod["subdomain"])  # pod N is <job>-N.<subdomain>
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True  # pods meet before any is ready
    assert headless["spec"]["selector"].items() <= _pod_labels().items()
    env = _env(_worker())
    host, _, port = env["RDZV_ENDPOINT"].rpartition(":")
    assert host == f"{job['metadata']['name']}-0.{pod['subdomain']}"
    _port(headless, int(port))
    (index,) = [e for e in _worker()["env"] if e["name"] == "JOB_INDEX"]
    assert index["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    names = [e["name"] for e in _worker()["env"]]
    assert names.index("JOB_INDEX") < names.index("LOCAL_ADDR"), "$(JOB_INDEX) expands only if defined first"
    assert env["LOCAL_ADDR"] == f"{job['metadata']['name']}-$(JOB_INDEX).{pod['subdomain']}"
    assert env["NNODES"] == str(spec["completions"]), "a fixed size keeps pod 0 at rank 0"


def test_torchrun_numbers_nodes_in_the_order_of_their_addresses() -> None:
    """What puts rank 0 in the pod of index 0: c10d rendezvous sorts its participants, which
    compare by address first (LOCAL_ADDR). A torch that changed this would move the gateway."""
    import dataclasses
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    assert "enumerate(sorted(state.participants))" in inspect.getsource(dynamic_rendezvous)
    node = dynamic_rendezvous._NodeDesc
    assert [f.name for f in dataclasses.fields(node)][0] == "addr"
    pods = [node(f"elasticfed-{i}.elasticfed-workers", 1000 - i, 0) for i in (11, 2, 0, 1, 10)]
    assert sorted(pods)[0].addr == "elasticfed-0.elasticfed-workers"


def test_job_fails_at_once_on_a_configuration_error() -> None:
    spec = _job()["spec"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it
    (rule,) = [r for r in spec["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert rule["onExitCodes"]["containerName"] == _worker()["name"]
    assert rule["onExitCodes"]["operator"] == "In" and rule["onExitCodes"]["values"] == [2]
    assert spec["backoffLimit"] >= 1


def test_workers_request_gpus_and_run_torchrun_with_c10d_rendezvous(tmp_path: Path) -> None:
    worker = _worker()
    resources = worker["resources"]
    gpus = resources["limits"]["nvidia.com/gpu"]
    assert gpus >= 1 and resources["requests"].get("nvidia.com/gpu", gpus) == gpus
    env = _env(worker)
    assert env["NPROC_PER_NODE"] == str(gpus), "one worker per GPU"
    assert "command" not in worker and "args" not in worker  # the image's entrypoint: launch.sh

    config = tmp_path / "cloud.toml"
    config.write_text(_cloud_toml())
    launch_env = {**os.environ, **env, "CONFIG": str(config), "DRY_RUN": "1"}
    result = subprocess.run(
        ["bash", str(CLOUD / "launch.sh")], capture_output=True, text=True, env=launch_env, timeout=30
    )
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout)
    assert argv[0] == "torchrun"
    module = argv.index("-m")
    torchrun, program = argv[1:module], argv[module + 1 :]
    options = dict(a.split("=", 1) for a in torchrun)
    assert options["--rdzv-backend"] == "c10d"
    assert options["--rdzv-endpoint"] == env["RDZV_ENDPOINT"]
    assert options["--nnodes"] == env["NNODES"] and options["--nproc-per-node"] == env["NPROC_PER_NODE"]
    assert options["--rdzv-id"] and int(options["--max-restarts"]) >= 1
    assert program[:4] == ["elasticfed.cloud", "serve", "--mode", "hybrid"]
    # what torchrun would start, each rank: a valid `cloud serve` command line
    _check_flags(("cloud", "serve"), program[2:])
    check = _cli("cloud", "serve", *program[2:], "--print-config")
    assert check.returncode == 0, check.stderr
    printed = tomllib.loads(check.stdout)
    assert printed["mode"] == "hybrid" and printed["metrics_bind"] == env["METRICS_BIND"]


def test_python_dash_m_cloud_serve_is_cloud_serve() -> None:
    """torchrun runs `python -m elasticfed.cloud serve ...`: it must reach `cloud serve`, not `train`."""
    result = subprocess.run(
        [sys.executable, "-m", "elasticfed.cloud", "serve", "--mode", "hybrid", "--print-config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "[hybrid]" in result.stdout or "[gateway]" in result.stdout


def test_cloud_config_is_valid_and_points_at_the_mounted_volumes(tmp_path: Path) -> None:
    config = tmp_path / "cloud.toml"
    config.write_text(_cloud_toml())
    result = _cli("cloud", "serve", "--config", str(config), "--print-config")
    assert result.returncode == 0, result.stderr
    printed = tomllib.loads(result.stdout)
    worker = _worker()
    assert Path(_env(worker)["CONFIG"]).parent == Path(_mount(worker, "config")["mountPath"])
    checkpoints = Path(_mount(worker, "checkpoints")["mountPath"])
    assert Path(printed["train"]["checkpoint_dir"]).is_relative_to(checkpoints)
    # Hybrid mode: the job checkpoints the cloud model and the gateway's state together, to the
    # training checkpoint directory (shared storage) when one is given (cloud/hybrid_checkpoints.py).
    assert printed["mode"] == "hybrid" and printed["gateway"]["checkpoint_dir"] == ""
    claim = _volume("checkpoints")["persistentVolumeClaim"]["claimName"]
    pvc = _one("PersistentVolumeClaim", claim)
    assert "ReadWriteMany" in pvc["spec"]["accessModes"], "every node reads the training checkpoints"
    keys = _mount(worker, "keys")
    assert printed["security"]["keys_dir"] == keys["mountPath"] and keys["readOnly"] is True
    assert not printed["security"]["insecure"]


def test_key_secret_is_mounted_read_only_owner_only() -> None:
    secret = _volume("gateway-key")["secret"]
    assert secret["secretName"] == "elasticfed-gateway-key"
    assert secret["defaultMode"] == 0o400
    assert {i["path"] for i in secret["items"]} == {"gateway.key", "gateway.key_secret"}
    assert _mount(_init_container(), "gateway-key")["readOnly"] is True
    assert not [m for m in _worker()["volumeMounts"] if m["name"] == "gateway-key"], "only the init copies it"
    assert _mount(_worker(), "enrolled")["readOnly"] is True
    assert _volume("keys")["emptyDir"].get("medium") == "Memory", (
        "the secret key never touches the node's disk"
    )
    context = _worker()["securityContext"]
    assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"]


def test_probes_check_the_gateway_on_rank_0_only() -> None:
    worker = _worker()
    with socket.socket() as sock:  # a port nothing listens on (7878 may be taken on this machine)
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = worker[probe]["exec"]["command"]
        assert command[:2] == ["bash", "-c"] and "/dev/tcp/127.0.0.1/7878" in command[2]
        command = [*command[:2], command[2].replace("7878", str(closed))]
        for index, passes in (("0", False), ("1", True), ("12", True)):
            result = subprocess.run(
                command, env=dict(os.environ, JOB_INDEX=index), capture_output=True, timeout=10
            )
            assert (result.returncode == 0) == passes, (probe, index, result.stderr)
        with socket.socket() as server:  # and pod 0 passes once the gateway listens
            server.bind(("127.0.0.1", 0))
            server.listen()
            command = [*command[:2], command[2].replace(str(closed), str(server.getsockname()[1]))]
            result = subprocess.run(
                command, env=dict(os.environ, JOB_INDEX="0"), capture_output=True, timeout=10
            )
            assert result.returncode == 0, (probe, result.stderr)


def _kubelet_volume(root: Path, files: dict[str, bytes], mode: int, stamp: str) -> None:
    """Write `files` the way the kubelet's atomic writer fills a Secret or ConfigMap volume:
    a world-writable volume root, a timestamped 0755 folder with the files, `..data` linking
    to it, and one top-level link per file into `..data`. Called again: an update."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o777)
    data = root / f"..{stamp}"
    data.mkdir()
    data.chmod(0o755)
    for name, content in files.items():
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        (data / name).write_bytes(content)
        (data / name).chmod(mode)
    link = root / "..data_tmp"
    link.symlink_to(data.name)
    os.replace(link, root / "..data")  # the atomic swap
    for name in files:
        top = name.split("/")[0]
        if not (root / top).is_symlink():
            (root / top).symlink_to(Path("..data") / top)


def test_init_container_assembles_the_key_folder_the_gateway_accepts_and_revocation_is_live(
    tmp_path: Path,
) -> None:
    from elasticfed.cloud.admission import CurveAdmission
    from elasticfed.common.keys import EnrolledDevices, KeyFileError, KeyFolder, generate

    operator = tmp_path / "operator"  # the folder `elasticfed keys` manages, as in sync-keys.sh
    folder = KeyFolder(operator)
    folder.init()
    for name in ("cam-7", "cam-8"):
        generate(name, tmp_path / "devices")
        folder.enrol(name, tmp_path / "devices" / f"{name}.key")

    # The pod's volumes, under tmp_path instead of /: paths as mounted in the worker.
    pod = tmp_path / "pod"
    worker, init = _worker(), _init_container()
    mounted = {m["name"]: pod / m["mountPath"].lstrip("/") for m in worker["volumeMounts"]}
    gateway_key = pod / _mount(init, "gateway-key")["mountPath"].lstrip("/")
    assert pod / _mount(init, "keys")["mountPath"].lstrip("/") == mounted["keys"]
    secret = _volume("gateway-key")["secret"]
    _kubelet_volume(
        gateway_key,
        {i["path"]: (operator / i["key"]).read_bytes() for i in secret["items"]},
        secret["defaultMode"],
        "2026_01_01_00_00_00.1",
    )
    enrolled = {p.name: p.read_bytes() for p in (operator / "enrolled").glob("*.key")}
    _kubelet_volume(mounted["enrolled"], enrolled, 0o644, "2026_01_01_00_00_00.2")
    mounted["keys"].mkdir(parents=True)
    mounted["keys"].chmod(0o777)  # an emptyDir

    env = _env(init)
    env = {k: str(pod / v.lstrip("/")) for k, v in env.items()}
    result = subprocess.run(
        ["sh", "-c", init["command"][2]], env=dict(os.environ, **env), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr

    keys = mounted["keys"]
    assert sorted(p.name for p in keys.iterdir()) == sorted(p.name for p in operator.iterdir())
    assert stat.S_IMODE((keys / "gateway.key_secret").stat().st_mode) == 0o600
    CurveAdmission.from_folder(str(keys))  # what `cloud serve --security-keys-dir` loads
    listed = _cli("keys", "list", "--keys-dir", str(keys), "--json")
    assert listed.returncode == 0, listed.stderr
    assert {json.loads(line)["name"] for line in listed.stdout.splitlines()} == {"cam-7", "cam-8"}

    devices = EnrolledDevices(keys / "enrolled", refresh_s=0.0, miss_gap_s=0.0)
    assert devices.names() == {"cam-7", "cam-8"}
    # Revoke cam-8 (sync-keys.sh applies the ConfigMap without it; the kubelet swaps ..data).
    folder.revoke("cam-8")
    enrolled = {p.name: p.read_bytes() for p in (operator / "enrolled").glob("*.key")}
    _kubelet_volume(mounted["enrolled"], enrolled, 0o644, "2026_01_01_00_01_00.3")
    assert devices.refresh(force=True)
    assert devices.names() == {"cam-7"}

    # Why enrolled/ links to ..data and not to the volume: the kubelet makes the volume
    # world-writable, and the gateway refuses such a folder.
    with pytest.raises(KeyFileError, match="others may write here"):
        EnrolledDevices(mounted["enrolled"])


def test_sync_keys_sends_the_key_pair_and_only_enrolled_public_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    assert _cli("keys", "init", "--keys-dir", str(keys)).returncode == 0
    assert _cli("keys", "generate", "--name", "cam-7", "--out-dir", str(tmp_path)).returncode == 0
    assert (
        _cli("keys", "enrol", "--keys-dir", str(keys), "--public-key", str(tmp_path / "cam-7.key")).returncode
        == 0
    )
    (keys / "enrolled" / "notes.txt").write_text("not a key")
    log = tmp_path / "kubectl.log"
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(f'#!/bin/sh\necho "$*" >> {log}\ncase "$*" in *apply*) cat >/dev/null ;; esac\n')
    kubectl.chmod(0o755)
    result = subprocess.run(
        ["bash", str(CLOUD / "sync-keys.sh"), str(keys)],
        env=dict(os.environ, KUBECTL=str(kubectl)),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    (secret,) = [c for c in calls if "create secret generic elasticfed-gateway-key" in c]
    assert f"--from-file=gateway.key_secret={keys}/gateway.key_secret" in secret
    (configmap,) = [c for c in calls if "create configmap elasticfed-enrolled" in c]
    assert f"--from-file=cam-7.key={keys}/enrolled/cam-7.key" in configmap and "notes.txt" not in configmap
    applies = [c for c in calls if c.startswith("apply")]
    assert len(applies) == 2 and all("--server-side" in c for c in applies)
    assert all("-n elasticfed" in c for c in calls if "create" in c)


# --- Prometheus and Grafana ---------------------------------------------------------------------


def _scrape_jobs() -> dict[str, dict[str, Any]]:
    config = yaml.safe_load((CLOUD / "prometheus.yml").read_text())
    return {job["job_name"]: job for job in config["scrape_configs"]}


def test_prometheus_scrapes_the_gateway_on_9400_and_the_edges_on_9401() -> None:
    jobs = _scrape_jobs()
    gateway = jobs["elasticfed-gateway"]
    targets = [t for c in gateway["static_configs"] for t in c["targets"]]
    metrics = _one("Service", "elasticfed-metrics")["metadata"]
    assert targets == [f"{metrics['name']}.{metrics['namespace']}.svc:9400"]
    edge = jobs["elasticfed-edge"]
    (relabel,) = [r for r in edge["relabel_configs"] if r["target_label"] == "__address__"]
    assert relabel["replacement"].endswith(":9401")
    assert re.fullmatch(relabel["regex"], "jetson-01") and not re.fullmatch(
        relabel["regex"], "jetson-01:9401"
    )
    assert edge["file_sd_configs"][0]["files"]
    example = json.loads((CLOUD / "edges.example.json").read_text())
    assert all(t.endswith(":9401") for group in example for t in group["targets"])
    for job in jobs.values():
        assert job.get("metrics_path", "/metrics") == "/metrics"


def test_grafana_dashboard_queries_only_metrics_the_code_declares() -> None:
    dashboard = json.loads((CLOUD / "grafana-dashboard.json").read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 30
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    expressions = []
    for panel in panels:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"} and panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        expressions += [t["expr"] for t in panel["targets"]]
    used = {name for e in expressions for name in re.findall(r"\belasticfed_[a-z0-9_]+", e)}
    # Any other metric-looking name is a typo or a missing prefix. Allowed: Prometheus's own `up`,
    # and the process_* family, when the gateway's endpoint registers prometheus_client's collector.
    words = {w for e in expressions for w in re.findall(r"\b[a-z_][a-z0-9_]*(?=\s*[{\[])", e)}
    allowed = {"up"}
    if "ProcessCollector(registry=" in (ROOT / "common" / "metrics_http.py").read_text():
        allowed |= {"process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"}
    others = {w for w in words - used if not w.startswith(("by", "sum", "rate", "count"))}
    assert others <= allowed, others - allowed
    jobs = {j for e in expressions for j in re.findall(r'job="([^"]+)"', e)}
    assert jobs <= set(_scrape_jobs())
    for needed in (
        "elasticfed_gateway_connected_devices",
        "elasticfed_gateway_applied_steps_total",
        "elasticfed_gateway_rejected_total",
        "elasticfed_gateway_staleness_bucket",
        "elasticfed_gateway_round_seconds_bucket",
        "elasticfed_gateway_checkpoint_age_seconds",
        "elasticfed_edge_strong_syncs_total",
        "elasticfed_edge_weak_syncs_total",
        "elasticfed_edge_retransmissions_total",
    ):
        assert needed in used, f"no panel shows {needed}"
    assert any(
        re.match(r"histogram_quantile\(0\.95,.*\belasticfed_edge_sync_latency_seconds_bucket\b", e)
        for e in expressions
    ), "no panel shows the edges' p95 sync latency"
    missing = sorted(used - _metric_families())
    assert not missing, f"the dashboard queries metrics the code does not declare: {missing}"


# --- the guide ----------------------------------------------------------------------------------


def _guide_commands() -> list[list[str]]:
    """`elasticfed ...` command lines in deploy/README.md: code blocks and inline code."""
    text = (DEPLOY / "README.md").read_text()
    command = re.compile(r"(?:^|\s)(?:\S*/)?elasticfed\s+((?:demo|cloud|edge|keys|linksim)\b.*)")
    lines = []
    for block in re.findall(r"```(?:sh|bash|console)\n(.*?)```", text, re.S):
        lines += re.sub(r"\\\n\s*", " ", block).splitlines()
    lines += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    commands = []
    for line in lines:
        match = command.search(line.split(" #")[0])
        if match:
            commands.append(shlex.split(re.split(r"\s(?:\||&&|;|>)\s?", match.group(1))[0]))
    return commands


def test_guide_uses_only_flags_the_cli_has() -> None:
    commands = _guide_commands()
    assert len(commands) >= 8
    for words in commands:
        role = []
        for word in words:
            if word.startswith("-"):
                break
            role.append(word)
        _check_flags(tuple(role), words)
