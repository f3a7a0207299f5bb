"""Import boundaries from STYLE.md: the router never loads MLX; ``common`` stays light.

Dynamic checks run the imports in a fresh interpreter (``sys.executable -c``) so this test
process never imports anything heavy; static checks read the sources with ``ast`` so a
lazy import inside a function is caught too.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("mlx", "mlx_lm")
NOT_IN_COMMON = ("mlx", "mlx_lm", "aiohttp", "zmq", "torch", "router", "worker")


def loaded_after(imports: list[str]) -> set[str]:
    """Top-level package names in sys.modules after importing ``imports`` afresh."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {imports!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, f"importing {imports} failed:\n{proc.stderr}"
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def modules_of(package: str) -> list[str]:
    return sorted(f"{package}.{p.stem}" for p in (ROOT / package).glob("*.py")
                  if p.stem not in ("__init__", "__main__"))


def imported_names(path: Path) -> set[str]:
    """Every top-level package a source file imports, anywhere in the file."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


# -- dynamic -------------------------------------------------------------------------


def test_router_app_never_loads_mlx() -> None:
    loaded = loaded_after(["router.app", "router.api", "router.dispatch"])
    assert not loaded & set(HEAVY), f"router imports {sorted(loaded & set(HEAVY))}"
    assert "worker" not in loaded


def test_every_router_module_never_loads_mlx() -> None:
    loaded = loaded_after(modules_of("router") + ["router.__main__"])
    assert not loaded & set(HEAVY), f"router imports {sorted(loaded & set(HEAVY))}"


def test_common_imports_nothing_heavy() -> None:
    loaded = loaded_after(modules_of("common"))
    assert not loaded & set(NOT_IN_COMMON), f"common imports {sorted(loaded & set(NOT_IN_COMMON))}"


def test_only_protocol_loads_msgpack() -> None:
    others = [m for m in modules_of("common") if m != "common.protocol"]
    assert "msgpack" not in loaded_after(others)


# -- static --------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted((ROOT / "router").glob("*.py")), ids=lambda p: p.name)
def test_router_source_imports(path: Path) -> None:
    bad = imported_names(path) & {"mlx", "mlx_lm", "worker"}
    assert not bad, f"router/{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", sorted((ROOT / "worker").glob("*.py")), ids=lambda p: p.name)
def test_worker_source_never_imports_router(path: Path) -> None:
    assert "router" not in imported_names(path), f"worker/{path.name} imports router"


@pytest.mark.parametrize("path", sorted((ROOT / "common").glob("*.py")), ids=lambda p: p.name)
def test_common_source_imports(path: Path) -> None:
    names = imported_names(path)
    bad = names & set(NOT_IN_COMMON)
    assert not bad, f"common/{path.name} imports {sorted(bad)}"
    if path.name != "protocol.py":
        assert "msgpack" not in names, f"common/{path.name} imports msgpack"


def sibling_imports(path: Path, package: str) -> set[str]:
    """The modules of ``package`` a source file imports, anywhere in the file (deferred and
    ``TYPE_CHECKING`` imports included: a loop closed behind one is still a loop)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] == package:
                names.update(parts[1:2] or [alias.name for alias in node.names])
        elif isinstance(node, ast.Import):
            names.update(a.name.split(".")[1] for a in node.names if a.name.startswith(f"{package}."))
    return names - {path.stem}


def import_circles(package: str) -> list[list[str]]:
    """Each set of ``package``'s modules that reach one another through their imports."""
    graph = {p.stem: sibling_imports(p, package) for p in (ROOT / package).glob("*.py")}

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in graph.get(todo.pop(), set()) - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reached = {m: reach(m) for m in graph}
    circles = {frozenset({m} | {o for o in reached[m] if m in reached[o]})
               for m in graph if m in reached[m]}
    return sorted(sorted(c) for c in circles)


@pytest.mark.parametrize("package", ["worker", "common", "router"])
def test_no_import_circles(package: str) -> None:
    assert import_circles(package) == [], f"{package}/ modules that import each other"
