"""The package's layers point one way: a lower layer never imports a higher one.

Walks every module's imports (module level and inside functions; ``TYPE_CHECKING`` blocks
excluded: annotations only) with ``ast``, so the rule is checked without importing anything::

    entrypoints, scale_out, api          how users reach the engine
      engine                             the step loop, scheduler, preprocessor
        runner, sample, spec_decode      a batch -> tensors -> tokens
          models, attention, kv          the model, attention over the paged cache, blocks
            core                         the values every layer passes
              kernels                    Triton and C++ kernels on tensors: no engine types
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HIGHER = {
    "core": {"engine", "sample", "runner", "entrypoints", "api", "scale_out", "models",
             "attention"},
    "kv": {"engine", "sample", "runner", "entrypoints", "api", "scale_out", "models"},
    "sample": {"engine", "runner", "entrypoints", "api", "scale_out"},
    "runner": {"engine", "entrypoints", "api", "scale_out"},
    "models": {"engine", "sample", "runner", "entrypoints", "api", "scale_out", "kv"},
    "attention": {"engine", "sample", "runner", "entrypoints", "api", "scale_out", "models"},
    "engine": {"entrypoints", "api", "scale_out"},
    "spec_decode": {"engine", "runner", "entrypoints", "api", "scale_out"},
    "structured_outputs": {"engine", "sample", "runner", "entrypoints", "api", "scale_out"},
    "kernels": {"core", "kv", "engine", "sample", "runner", "entrypoints", "api", "scale_out",
                "models", "attention", "spec_decode", "structured_outputs"},
}  # fmt: skip


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(path: Path) -> list[str]:
    """The ``prefixserve.*`` modules ``path`` imports, outside ``TYPE_CHECKING`` blocks."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return [m for m in out if m.startswith("prefixserve.")]


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in HIGHER) else None


@pytest.mark.parametrize("layer", sorted(HIGHER))
def test_no_layer_imports_a_higher_one(layer):
    bad = []
    for path in sorted((ROOT / "prefixserve" / layer).rglob("*.py")):
        for module in imports_of(path):
            if layer_of(module) in HIGHER[layer]:
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, "\n".join(bad)


def test_the_walk_sees_imports():
    """The check above can fail: the scheduler's own imports are found and classified."""
    found = {layer_of(m) for m in imports_of(ROOT / "prefixserve" / "engine" / "scheduler.py")}
    assert {"core", "kv"} <= found


@pytest.mark.parametrize("shared", ["frontend", "parsing"])
def test_the_shared_api_halves_import_no_protocol(shared):
    """api/frontend and api/parsing serve every protocol, so they import none of them (a protocol
    front hands them what differs: its error shape, ``frontend.errors.ErrorShapes``)."""
    protocols = ("prefixserve.api.openai", "prefixserve.api.anthropic")
    bad = [f"{path.relative_to(ROOT)} imports {module}"
           for path in sorted((ROOT / "api" / shared).rglob("*.py"))
           for module in imports_of(path) if module.startswith(protocols)]  # fmt: skip
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(("protocol", "other"), [("anthropic", "openai"), ("openai", "anthropic")])
def test_no_protocol_imports_another(protocol, other):
    """Each protocol builds the shared ``GenerationRequest`` from its own schema, never another
    protocol's request object (Messages once went through a chat-completions request)."""
    bad = [f"{path.relative_to(ROOT)} imports {module}"
           for path in sorted((ROOT / "api" / protocol).rglob("*.py"))
           for module in imports_of(path) if module.startswith(f"prefixserve.api.{other}")]  # fmt: skip
    assert not bad, "\n".join(bad)
