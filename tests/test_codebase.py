"""The codebase itself: ruff-clean, Python 3.10 compatible, layered as DESIGN.md draws it."""

from __future__ import annotations

import ast
import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["cloud", "edge", "protocol", "common"]


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; it comes with the 'test' extra (pip install -e '.[test]')")
    return found


def test_ruff_clean() -> None:
    result = subprocess.run([_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_vermin_says_python_310_is_enough() -> None:
    """JetPack 6 ships Python 3.10: nothing in the product may need 3.11."""
    result = subprocess.run(
        [
            _tool("vermin"),
            "--target=3.10-",
            "--violations",
            "--no-tips",
            "--eval-annotations",
            *PACKAGES,
            "benchmarks",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _python310() -> str | None:
    candidates = [shutil.which("python3.10"), *sorted(glob.glob("/root/.pyenv/versions/3.10*/bin/python3"))]
    for candidate in candidates:
        if (
            candidate
            and subprocess.run(
                [candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 10)"], capture_output=True
            ).returncode
            == 0
        ):
            return candidate
    return None


def test_a_real_python_310_compiles_everything() -> None:
    python = _python310()
    if python is None:
        pytest.skip("no Python 3.10 interpreter on this machine; vermin's static check still ran")
    result = subprocess.run(
        [python, "-m", "compileall", "-q", "-x", r"\.venv", *PACKAGES, "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _top(module: str) -> str:
    """The package an import names: elasticfed.cloud.gateway -> cloud (the installed name); a bare
    `cloud` stays `cloud` (and is refused by test_imports_name_the_installed_package)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "elasticfed" and len(parts) > 1 else parts[0]


def _imports(package: str) -> set[tuple[str, str]]:
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {(str(path.relative_to(ROOT)), _top(alias.name)) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add((str(path.relative_to(ROOT)), _top(node.module)))
    return found


def _bare_imports(folder: Path) -> list[tuple[str, str]]:
    bad = []
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            bad += [(str(path.relative_to(ROOT)), n) for n in names if n.split(".")[0] in PACKAGES]
    return bad


def test_imports_name_the_installed_package() -> None:
    """What is installed is elasticfed.cloud, elasticfed.edge, ...: a bare `import cloud` works only
    from a checkout's root, and there as a second copy of every module it reaches."""
    bad = [b for folder in (*PACKAGES, "tests", "benchmarks") for b in _bare_imports(ROOT / folder)]
    assert not bad, bad[:5]


def test_the_installed_package_is_elasticfed_and_nothing_generic() -> None:
    """After `pip install`, from any directory: elasticfed.* imports, and no top-level `common`,
    `protocol`, `cloud` or `edge` comes from this project (they would collide with other packages)."""
    probe = (
        "import importlib.util, json\n"
        "import elasticfed.cloud.gateway, elasticfed.edge.agent, elasticfed.protocol, elasticfed.common.cli\n"
        f"print(json.dumps({{n: importlib.util.find_spec(n) is not None for n in {PACKAGES!r}}}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd="/", env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {n: False for n in PACKAGES}


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("protocol", {"cloud", "edge", "common"}),
        ("common", {"cloud", "edge"}),
        ("cloud", {"edge"}),
        ("edge", {"cloud"}),
    ],
)
def test_layering(package: str, forbidden: set[str]) -> None:
    """protocol knows only bytes and messages; cloud and edge never import each other."""
    bad = sorted((path, name) for path, name in _imports(package) if name in forbidden)
    assert not bad, bad


# Where ZeroMQ may be used: the transport boundary, and the key and CURVE set-up and the link
# simulator (a tool that proxies between real sockets).  Protocol logic (the edge session, the
# gateway) talks to a `Link` and never sees a socket or a zmq error.
ZMQ_ALLOWED = {
    "common/transport/zeromq.py",
    "common/keys.py",
    "cloud/admission.py",
    "common/tools/linksim.py",
}


def test_zeromq_stays_behind_the_transport_boundary() -> None:
    users = {path for package in PACKAGES for path, name in _imports(package) if name == "zmq"}
    assert users <= ZMQ_ALLOWED, sorted(users - ZMQ_ALLOWED)
    assert "common/transport/zeromq.py" in users  # the check reads imports at all


def _module_graph() -> dict[str, set[str]]:
    """Each product module -> the product modules it imports (type-checking and function-local
    imports included: a circle through them is still a circle a reader must hold in mind)."""
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(("elasticfed", *path.relative_to(ROOT).with_suffix("").parts))
            modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module in modules:
                    deps.add(node.module)
                deps |= {
                    f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules
                }
        graph[name] = deps - {name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_the_product_modules() -> None:
    """A module that needs another's object back (a checkpoint writer calling its owner) takes a
    value instead: cloud/durability.py's GatewayState, edge/persistence.py's Loaded."""
    graph = _module_graph()
    assert len(graph) > 50
    assert "elasticfed.edge.session" in graph["elasticfed.edge.run"] | graph["elasticfed.edge.agent"]
    assert _circles(graph) == []


def test_no_pickle_in_product_code() -> None:
    bad = sorted(
        (p, n) for pkg in PACKAGES for p, n in _imports(pkg) if n in ("pickle", "cloudpickle", "dill")
    )
    assert not bad, bad


def test_no_pickle_based_loading_in_product_code() -> None:
    """No `torch.load`/`torch.save` (pickle inside), nor anything that reads like them, in product code."""
    bad = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute) and node.attr in ("load", "save"):
                    chain = ast.unparse(node)
                    if chain.endswith(("torch.load", "torch.save")):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {chain}")
    assert not bad, bad
