"""The scale-out modules and the CLI import without circles: statically (every import, lazy ones
inside functions included) and in a fresh interpreter, in both orders."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "prefixserve"
CHECKED = sorted(
    ["prefixserve.entrypoints.cli", "prefixserve.entrypoints.engine_args"]
    + [f"prefixserve.scale_out.{p.stem}" for p in (PACKAGE / "scale_out").glob("*.py")
       if p.stem != "__init__"]
)  # fmt: skip


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The prefixserve modules ``path`` imports anywhere in its body (a package's ``from pkg
    import name`` counts as the submodule when there is one)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("prefixserve"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prefixserve"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path) & modules.keys() - {name} for name, path in modules.items()}


def _cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start, or None."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in graph.get(node, ()):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_the_cycle_finder_finds_a_circle_through_a_lazy_import(tmp_path: Path) -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle_through(graph, "a") == ["a", "b", "c", "a"]
    assert _cycle_through(graph, "d") is None
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from prefixserve.entrypoints.cli import engine_kwargs\n")
    assert _imports(probe) == {"prefixserve.entrypoints.cli", "prefixserve.entrypoints.cli.engine_kwargs"}


@pytest.mark.parametrize("module", CHECKED)
def test_no_import_circle_through(module: str) -> None:
    assert _cycle_through(_graph(), module) is None


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_the_modules_import_in_a_fresh_interpreter_in_either_order(order: str) -> None:
    modules = CHECKED if order == "forward" else CHECKED[::-1]
    script = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    done = subprocess.run([sys.executable, "-c", script, *modules], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
