"""Compiled decode steps on CPU: the CPU side of ``decode_replay.DecodeReplay``.

An eager CPU decode step dispatches a few hundred small ops (norms, rope, activations, residual
adds, reshapes) around its matmuls; on a small model that overhead is a third of the step.
``torch.compile`` (Inductor's C++/OpenMP backend) fuses everything between the matmuls into a
few generated kernels per layer. The matmuls stay the ``cpu_linear`` kernels; attention with its
K/V write, and a Qwen3-MoE block's routing, stay opaque ops (``attention.in_graph``), so the graph
carries no paged metadata and never changes from step to step.

Steps: decodes, and speculative verify steps (a sequence's last token and its drafts: at most
``1 + num_speculative_tokens`` tokens a sequence), every row sampling. Buckets: two graphs, one
for a single row and one for 2 .. ``largest`` rows with the token dimension symbolic
(``torch._dynamo.mark_dynamic``): on CPU nothing has to be captured at a
fixed address, the C++ kernels take any row count, and one symbolic graph replaces the per-size
captures CUDA needs (each a compile of the whole model: about half a minute for SmolLM2 on two
cores). No step pads and nothing recompiles at run time: ``capture`` compiles both at start-up
(their seconds go to the log and ``EngineStats``), and Inductor's cache on disk
(``TORCHINDUCTOR_CACHE_DIR``, by default ``~/.cache/prefixserve/inductor``) makes a restart
reuse the generated code.

Guards: Dynamo checks only the input tensors' shapes before each call
(``keep_tensor_guards_unsafe``); the model is not changed after capture. Dynamo keys its cache
on the code object, so each runner compiles a function of its own (``_own_code``): a second engine
in the process never finds the first one's graphs. Replayed steps compute
what eager steps compute, with Inductor's fused float32 reductions (norms) in place of ATen's:
equal greedy tokens, logprobs within float32 summation order (``tests/test_compiled_step``).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from prefixserve.attention.in_graph import IN_GRAPH, StepContext, bind
from prefixserve.attention.metadata import AttentionMetadata, SeqSpan, build_attention_metadata
from prefixserve.models.moe import SparseMoeBlock
from prefixserve.runner.decode_replay import DecodeReplay

if TYPE_CHECKING:
    from prefixserve.attention.backend import AttentionBackend
    from prefixserve.core.config import EngineConfig
    from prefixserve.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path("~/.cache/prefixserve/inductor")
_OPTIONS = {"size_asserts": False, "alignment_asserts": False}
_runner_ids = itertools.count()


def _decode_forward(model: LlamaForCausalLM) -> Callable[..., torch.Tensor]:
    def forward(input_ids, positions, kv_caches):
        return model(input_ids, positions, kv_caches, IN_GRAPH)

    return _own_code(forward)


def _own_code(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a code object of its own (Dynamo's cache is per code object)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_runner_ids)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class CompiledStepRunner(DecodeReplay):
    """Runs decode steps of 1 .. ``largest`` rows through two compiled graphs (module docstring).

    Invariant: the graphs read the model's weights and, through the bound ``StepContext``, the
    engine's KV cache; a replayed step writes exactly the K/V an eager step writes.
    """

    kind = "compiled"

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        largest: int,
        block_size: int,
        max_query_len: int = 1,
    ) -> None:
        super().__init__([1, largest] if largest > 1 else [1])
        self.max_query_len = max_query_len
        self.backend, self.block_size = backend, block_size
        self.moe = {i: layer.mlp for i, layer in enumerate(model.model.layers)
                    if isinstance(layer.mlp, SparseMoeBlock)}  # fmt: skip
        options = {**_OPTIONS, "guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe}
        self._graph = torch.compile(
            _decode_forward(model), dynamic=False, fullgraph=True, options=options
        )

    @classmethod
    def create(
        cls, config: EngineConfig, model: LlamaForCausalLM, backend: AttentionBackend
    ) -> CompiledStepRunner | None:
        """The runner for a float32 model; other dtypes decode eagerly."""
        if next(model.parameters()).dtype != torch.float32:
            logger.info("compiled decode steps need float32 weights; decode steps run eagerly")
            return None
        cache = config.compile_cache_dir or str(DEFAULT_CACHE_DIR.expanduser())
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)  # Inductor reads it from there
        spec = config.speculative_config
        max_query_len = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        largest = min(config.max_num_seqs * max_query_len, config.max_num_batched_tokens)
        return cls(model, backend, largest, config.block_size, max_query_len)

    @torch.inference_mode()
    def capture(self, kv_caches: torch.Tensor) -> None:
        """Compile both graphs with a step that reads and writes nothing of the cache (its
        slots are -1; it reads block 0, whatever it holds, and its output is dropped)."""
        for rows in self.sizes:
            start = time.perf_counter()
            span = SeqSpan([0], 0, 1)
            positions, md = build_attention_metadata([span] * rows, self.block_size, "cpu")
            md.slot_mapping.fill_(-1)
            ids = torch.zeros(rows, dtype=torch.int64)
            if rows > 1:  # the multi-row graph: a symbolic batch dimension
                for t in (ids, positions):
                    torch._dynamo.mark_dynamic(t, 0, min=2, max=self.largest)
            self.replay(ids, positions, kv_caches, md)
            label = "1" if rows == 1 else f"2-{rows}"
            self.capture_seconds[label] = time.perf_counter() - start
            logger.info("compiled the decode step for %s rows in %.1f s", label,
                        self.capture_seconds[label])  # fmt: skip

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
               md: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        with bind(StepContext(kv_caches, md, self.backend, input_ids.shape[0], self.moe)):
            return self._graph(input_ids, positions, kv_caches)
