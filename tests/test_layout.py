"""The repository layout never shadows an installed package, whatever the working directory.

``kernels/`` and ``api/`` sit at the top of the repository and are imported as
``prefixserve.kernels`` / ``prefixserve.api`` through the symlinks ``prefixserve/kernels`` and
``prefixserve/api``. Neither top-level folder has an ``__init__.py``: from the repository root
(where ``python -m`` and ``python -c`` put the current directory first on ``sys.path``) each is
at most a namespace portion, which any installed regular package of that name outranks. Hugging
Face's ``kernels`` (imported by transformers 5) and PyPI's ``api`` are the two that matter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str], env: dict[str, str] | None = None, timeout: float = 120):
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_top_level_folders_are_not_regular_packages():
    for name in ("kernels", "api"):
        assert (ROOT / name).is_dir()
        assert not (ROOT / name / "__init__.py").exists(), f"{name}/__init__.py would shadow"
        link = ROOT / "prefixserve" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve()


def test_hugging_face_kernels_and_transformers_import_from_the_repository_root():
    """What failed on a fresh clone: transformers imports ``kernels`` and found this folder."""
    proc = _run(
        ["-c", "import kernels, transformers.activations; print(kernels.__file__)"],
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    origin = proc.stdout.strip().splitlines()[-1]
    assert origin != "None", "Hugging Face's kernels is not installed (transformers requires it)"
    assert not Path(origin).resolve().is_relative_to(ROOT / "kernels"), origin


def test_installed_packages_named_like_the_folders_win(tmp_path):
    """Regular packages ``kernels`` and ``api`` later on ``sys.path`` than the repository root
    (PYTHONPATH comes after the current directory) are the ones imported."""
    for name in ("kernels", "api"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"WHO = 'installed {name}'\n")
    code = "import kernels, api, prefixserve.kernels.kv_store; print(kernels.WHO, '|', api.WHO)"
    proc = _run(["-c", code], env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "installed kernels | installed api"


def test_prefixserve_subpackages_import_from_anywhere(tmp_path):
    code = (
        "import prefixserve.kernels.interpreter, prefixserve.api.server;"
        "print(prefixserve.api.server.__name__)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "prefixserve.api.server"


def test_the_suite_collects_from_the_repository_root():
    """``python -m pytest`` (the README's test command) collects every test without an error."""
    proc = _run(["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"], timeout=600)
    tail = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    assert "error" not in proc.stdout.splitlines()[-1].lower(), tail
