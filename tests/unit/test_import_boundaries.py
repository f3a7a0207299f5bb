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


def module_files(package: str) -> dict[str, Path]:
    """Each module of ``package``, subpackages included, by dotted name (a package by its
    ``__init__``)."""
    files = {}
    for path in (ROOT / package.replace(".", "/")).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def modules_of(package: str) -> list[str]:
    return sorted(m for m, path in module_files(package).items()
                  if path.stem not in ("__init__", "__main__"))


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
    loaded = loaded_after(["router.app", "router.http.api", "router.fleet.dispatch"])
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


@pytest.mark.parametrize("path", sorted((ROOT / "router").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT / "router")))
def test_router_source_imports(path: Path) -> None:
    bad = imported_names(path) & {"mlx", "mlx_lm", "worker"}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


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


def imports_of(path: Path) -> set[str]:
    """Every dotted name a source file imports, anywhere in the file (deferred and
    ``TYPE_CHECKING`` imports included: a loop closed behind one is still a loop).
    ``from a import b`` names ``a`` and ``a.b``: ``b`` may be a module."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def import_graph(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` → the modules of ``package`` it imports."""
    files = module_files(package)
    return {m: {n for n in imports_of(path) if n in files} - {m} for m, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each set of nodes that reach one another through the graph's edges."""

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in graph.get(todo.pop(), set()) - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reached = {m: reach(m) for m in graph}
    found = {frozenset({m} | {o for o in reached[m] if m in reached[o]})
             for m in graph if m in reached[m]}
    return sorted(sorted(c) for c in found)


def import_circles(package: str) -> list[list[str]]:
    """Each set of ``package``'s modules that reach one another through their imports."""
    return circles(import_graph(package))


ROUTER_ROLES = ("http", "chat", "fleet", "ops")


def role_of(module: str) -> str:
    """``router.fleet.dispatch`` → ``fleet``; a module at the top (app, job) is its own."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or parts[-1] in ROUTER_ROLES else module


@pytest.mark.parametrize("package", ["worker", "common", "router",
                                     *(f"router.{role}" for role in ROUTER_ROLES)])
def test_no_import_circles(package: str) -> None:
    assert import_circles(package) == [], f"{package}/ modules that import each other"


def test_chat_and_fleet_never_import_each_other() -> None:
    """They meet in the chat-completions handler (router/http/api.py), nowhere else."""
    crossings = sorted((m, n) for m, imported in import_graph("router").items() for n in imported
                       if {role_of(m), role_of(n)} == {"chat", "fleet"})
    assert crossings == [], "router/chat and router/fleet import each other"


def test_router_roles_import_one_way() -> None:
    """Read by role, the imports form no circle either (today http → chat, fleet, ops and
    ops → fleet): a role can be read knowing only the roles below it."""
    by_role: dict[str, set[str]] = {}
    for m, imported in import_graph("router").items():
        by_role.setdefault(role_of(m), set()).update(role_of(n) for n in imported)
    assert circles({r: deps - {r} for r, deps in by_role.items()}) == []
