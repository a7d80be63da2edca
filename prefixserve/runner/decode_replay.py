"""Decode steps replayed from a capture made at start-up: the one abstraction behind CUDA graphs
(``cuda_graphs.CUDAGraphRunner``) and compiled CPU steps (``compiled_step.CompiledStepRunner``).

A decode step of a small model is bound by per-op overhead (launches on GPUs, dispatch on CPUs),
not by its arithmetic. At start-up a runner captures the model's whole decode forward for its
batch-size buckets (``sizes``; CUDA: one graph per size, CPU: see ``compiled_step``); a step that
``replays`` runs the capture and returns the final hidden states, any other runs eagerly.

What replays, on every device: a step where every sequence runs at most ``max_query_len``
tokens (1: decodes alone; the compiled CPU step also takes speculative verify steps, a
sequence's last token and its drafts) and every row samples (the model's ``keep`` is None), at
most ``largest`` rows in all. Each runner adds its own conditions. ``--enforce-eager`` (``EngineConfig.enforce_eager``) turns replay off; a capture
that fails turns it off with one log line, and every step then runs eagerly.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from prefixserve.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from prefixserve.attention.backend import AttentionBackend, AttentionStep
    from prefixserve.core.config import EngineConfig
    from prefixserve.models.llama import Keep, LlamaForCausalLM

logger = logging.getLogger(__name__)


class DecodeReplay(ABC):
    """Captures decode forwards at start-up, replays them per step. ``capture_seconds`` maps each
    bucket (a label: a size, or a range of sizes) to the seconds its capture took."""

    kind: str = "abstract"
    max_query_len: int = 1

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.capture_seconds: dict[str, float] = {}
        self.replayed_steps = 0

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def replays(self, md: AttentionMetadata, keep: Keep | None) -> bool:
        """The steps every runner replays: at most ``max_query_len`` tokens a sequence, every
        row sampling, at most ``largest`` rows."""
        rows = sum(md.query_lens_cpu)
        return keep is None and md.max_query_len <= self.max_query_len and 0 < rows <= self.largest

    def fits(self, md: AttentionMetadata, step: AttentionStep) -> bool:
        """The runner's own conditions on a step that ``replays`` (none here)."""
        return True

    @abstractmethod
    def capture(self, kv_caches: torch.Tensor) -> None:
        """Capture every bucket over ``kv_caches`` (the engine's whole cache, never reallocated)."""

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: torch.Tensor,
        md: AttentionMetadata,
        step: AttentionStep,
        keep: Keep | None,
    ) -> torch.Tensor | None:
        """The step's final hidden states ``[n, hidden]``, or None when the step does not replay
        (the caller then runs the forward eagerly). ``step`` is the backend's plan of ``md``."""
        if not (self.replays(md, keep) and self.fits(md, step)):
            return None
        hidden = self.replay(input_ids, positions, kv_caches, md, step)
        self.replayed_steps += 1
        return hidden

    @abstractmethod
    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
               md: AttentionMetadata, step: AttentionStep) -> torch.Tensor:  # fmt: skip
        """Run a step that replays from the capture: its final hidden states."""

    def profile(self) -> int:
        """Bytes of device memory the captures need, left out of the KV budget (0: none)."""
        return 0

    def stats(self) -> dict:
        return {
            "kind": self.kind,
            "sizes": list(self.sizes),
            "capture_seconds": dict(self.capture_seconds),
            "replayed_steps": self.replayed_steps,
        }


def create_decode_replay(
    config: EngineConfig, model: LlamaForCausalLM, backend: AttentionBackend
) -> DecodeReplay | None:
    """The runner for ``config``'s device, or None where replay is off: ``enforce_eager``, CUDA
    with the torch backend (it plans each step from host copies), another device."""
    if config.enforce_eager:
        return None
    device = next(model.parameters()).device
    if device.type == "cuda":
        from prefixserve.runner.cuda_graphs import CUDAGraphRunner

        return CUDAGraphRunner.create(config, model, backend)
    if device.type == "cpu":
        from prefixserve.runner.compiled_step import CompiledStepRunner

        return CompiledStepRunner.create(config, model, backend)
    return None
