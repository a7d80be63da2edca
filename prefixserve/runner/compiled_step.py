"""Compiled decode steps on CPU: the CPU side of ``decode_replay.DecodeReplay``.

An eager CPU decode step dispatches a few hundred small ops (norms, rope, activations, reshapes)
around its matmuls; on a small model that overhead is a third of the step. ``torch.compile``
(Inductor's C++ backend with its C++ wrapper, ``cpp_wrapper``) turns the whole forward into one
generated C++ function: everything between the matmuls fuses into a few generated kernels per
layer, and the C++ ops (``prefixserve_cpu``: the linears, the fused residual-add + RMSNorm, paged
attention with its K/V write) are called from that function through the dispatcher, without
returning to Python. A Qwen3-MoE sparse block's routing stays a Python op
(``prefixserve::grouped_moe``).

The step's paged metadata enters the graph as tensors: the attention backend's plan of a decode
step (``attention.cpu_backend.PagedStep``: ``slot_mapping``, ``block_tables``, ``token_seq``,
``token_len``) is the graph's input beside the token ids, positions and the KV cache, so
attention in the graph is the C++ op an eager step calls, over the same step context::

    step = CpuAttentionBackend.plan(metadata)        (the model runner, before the model runs)
    graph(input_ids [T], positions [T], kv_caches, slot_mapping [T], block_tables [S, W],
          token_seq [T], token_len [T])  ->  final hidden states [T, hidden]

Steps: decodes, and speculative verify steps (a sequence's last token and its drafts: at most
``1 + num_speculative_tokens`` tokens a sequence), every row sampling. Buckets: two graphs, one
for a single row (the block tables' width W symbolic) and one for 2 .. ``largest`` rows (T, S
and W symbolic, ``torch._dynamo.mark_dynamic``): on CPU nothing has to be captured at a fixed
address and the C++ kernels take any sizes, so no step pads. ``capture`` compiles both at
start-up (their seconds go to the log and ``EngineStats``), with each symbolic size traced at a
value of its own (so duck sizing never ties two of them; the block tables' sizes unbacked, so
they may be 1), and Inductor's cache on disk
(``TORCHINDUCTOR_CACHE_DIR``, by default ``~/.cache/prefixserve/inductor``) makes a restart reuse
the generated code.

Guards: none (``skip_all_guards_unsafe``). The runner picks the graph by row count, the model is
not changed after capture, and every input keeps its dtype and layout, so no guard could fail;
Dynamo's check of every weight's metadata before each call (0.65 ms of a 6.6 ms SmolLM2 step)
is gone. Dynamo keys its cache on the code object, so each graph is a function of its own
(``_own_code``): a second engine in the process never finds the first one's graphs. A replayed
step computes exactly what an eager step computes (the same ops on the same step context; the
graph's own kernels are elementwise, rope and activations): equal tokens and logprobs
(``tests/test_compiled_step``).
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

from prefixserve.attention.cpu_backend import CpuAttentionBackend, PagedStep
from prefixserve.attention.metadata import AttentionMetadata
from prefixserve.runner.decode_replay import DecodeReplay

if TYPE_CHECKING:
    from prefixserve.attention.backend import AttentionBackend, AttentionStep
    from prefixserve.core.config import EngineConfig
    from prefixserve.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path("~/.cache/prefixserve/inductor")
_OPTIONS = {
    "cpp_wrapper": True,
    "size_asserts": False,
    "alignment_asserts": False,
    "guard_filter_fn": torch.compiler.skip_all_guards_unsafe,
}
_runner_ids = itertools.count()


def _decode_forward(model: LlamaForCausalLM) -> Callable[..., torch.Tensor]:
    def forward(input_ids, positions, kv_caches, slot_mapping, block_tables, token_seq, token_len):
        step = PagedStep(slot_mapping, block_tables, token_seq, token_len)
        # the forward without its inference_mode decorator: the graph is traced outside it
        return model.forward.__wrapped__(model, input_ids, positions, kv_caches, step)

    return _own_code(forward)


def _own_code(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a code object of its own (Dynamo's cache is per code object)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_runner_ids)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class CompiledStepRunner(DecodeReplay):
    """Runs decode steps of 1 .. ``largest`` rows through two compiled graphs (module docstring).

    Invariant: the graphs read the model's weights, the engine's KV cache and the step's
    ``PagedStep``; a replayed step writes exactly the K/V an eager step writes.
    """

    kind = "compiled"

    def __init__(self, model: LlamaForCausalLM, largest: int, max_query_len: int = 1) -> None:
        super().__init__([1, largest] if largest > 1 else [1])
        self.max_query_len = max_query_len
        # a copy each: torch.compile pops guard_filter_fn out of the options it is given
        self._graphs = {
            rows: torch.compile(
                _decode_forward(model), dynamic=False, fullgraph=True, options=dict(_OPTIONS)
            )
            for rows in self.sizes
        }

    @classmethod
    def create(
        cls, config: EngineConfig, model: LlamaForCausalLM, backend: AttentionBackend
    ) -> CompiledStepRunner | None:
        """The runner for a float32 model on the C++ CPU backend; other models decode eagerly."""
        if next(model.parameters()).dtype != torch.float32:
            logger.info("compiled decode steps need float32 weights; decode steps run eagerly")
            return None
        if not isinstance(backend, CpuAttentionBackend):
            logger.info("compiled decode steps need the cpu attention backend; they run eagerly")
            return None
        cache = config.compile_cache_dir or str(DEFAULT_CACHE_DIR.expanduser())
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)  # Inductor reads it from there
        spec = config.speculative_config
        max_query_len = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        largest = min(config.max_num_seqs * max_query_len, config.max_num_batched_tokens)
        return cls(model, largest, max_query_len)

    def capture(self, kv_caches: torch.Tensor) -> None:
        """Compile both graphs with a step that writes nothing of the cache (its slots are -1;
        it reads block 0, whatever it holds, and its output is dropped). The multi-row graph is
        traced at T = ``largest`` tokens of S = T + 1 sequences over W = T + 2 blocks, three
        distinct sizes, each symbolic; S and W unbacked (no guard that they exceed 1: a verify
        step may hold one sequence, a table one block)."""
        for rows in self.sizes:
            start = time.perf_counter()
            with torch.inference_mode():  # made as the model runner makes a step's inputs
                ids, positions, step = self._capture_inputs(rows)
            torch._dynamo.decorators.mark_unbacked(step.block_tables, 1)  # W: 1 too
            if rows > 1:  # the multi-row graph: T and S symbolic too
                for t in (ids, positions, step.slot_mapping, step.token_seq, step.token_len):
                    torch._dynamo.mark_dynamic(t, 0, min=2, max=self.largest)
                torch._dynamo.decorators.mark_unbacked(step.block_tables, 0)  # S: 1 too
            # traced outside inference mode: in it, AOTAutograd cannot trace the op's write into
            # a view of the cache (it sets the view's version counter); no tensor needs grad
            with torch.inference_mode(False), torch.no_grad():
                self._graphs[rows](ids, positions, kv_caches, *step)
            label = "1" if rows == 1 else f"2-{rows}"
            self.capture_seconds[label] = time.perf_counter() - start
            logger.info("compiled the decode step for %s rows in %.1f s", label,
                        self.capture_seconds[label])  # fmt: skip

    def _capture_inputs(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, PagedStep]:
        seqs, width = (1, 2) if rows == 1 else (rows + 1, rows + 2)
        tables = torch.zeros(seqs, width, dtype=torch.int32)  # every block: 0
        step = PagedStep(
            torch.full((rows,), -1, dtype=torch.int64),  # nothing written
            tables,
            torch.zeros(rows, dtype=torch.int32),
            torch.ones(rows, dtype=torch.int32),
        )
        return torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64), step

    def fits(self, md: AttentionMetadata, step: AttentionStep) -> bool:
        """The step runs the C++ kernel (its plan is a ``PagedStep``)."""
        return isinstance(step, PagedStep)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
               md: AttentionMetadata, step: AttentionStep) -> torch.Tensor:  # fmt: skip
        """Run under the model runner's inference mode (no guard checks it): the generated code
        then dispatches every op without the autograd keys, 0.4-0.6 ms of a SmolLM2 step."""
        graph = self._graphs[1 if input_ids.shape[0] == 1 else self.largest]
        return graph(input_ids, positions, kv_caches, *step)
