"""CUDA graphs for decode steps: the model's forward captured once per batch size, then replayed
(the GPU side of ``decode_replay.DecodeReplay``).

A decode step of a small model is bound by kernel launches (Qwen3-0.6B: 28 layers of about 15
launches each), not by the GPU. At start-up ``capture`` records the whole forward, attention
included, for a set of batch sizes over static input buffers; a pure-decode step copies its
inputs into those buffers and replays the graph of the next captured size up::

    static buffers (B = largest captured size, W = ceil(max_model_len / block_size) blocks;
    ``build_attention_metadata`` of B decodes at position max_model_len - 1, each graph's
    metadata its first rows: ``AttentionMetadata.first_decodes``)
      input_ids [B], positions [B]   rows n .. bs-1 (padding): stale, still valid ids/positions
      slot_mapping [B]               padding -1: writes no K/V
      seq_lens [B]                   padding 0: reads no K/V (its attention output is 0)
      block_tables [B, W]            row i < n: its table in the first columns; the columns
                                     after are stale and never read (seq_len_i <= its width x bs)
      hidden [B, hidden_size]        the graph's output; rows < n belong to the step

Which steps replay (``run`` returns None for the others, which the caller runs eagerly): those
``DecodeReplay.replays`` admits (decodes alone, every row sampling, at most B of them) whose block
tables are at most W wide and whose attention plan takes no cascade. Prefill and mixed steps run
eagerly.

Host-side ints are fixed per graph: the metadata a graph captured says ``max_seq_len =
max_model_len`` (the engine's, ``EngineConfig.resolve_max_model_len``), so the decode kernel's
split count and tile size are ones valid for any context (a shorter one leaves some splits
empty), and every grid depends on the batch size alone.

Cascade. The graphs capture the plain decode kernel (their metadata has no prefix groups); a
decode step whose plan takes cascade (``TritonAttentionBackend.plan``) runs eagerly. Cascade pays
where a group's shared prefix is long, where a step's time is HBM reads of K/V rather than
launches, so a graph would save little there; capturing per group layout would multiply graphs.

Memory. The graphs share one pool, captured largest first, so they hold about what the largest
batch's eager forward allocates at its peak. ``profile`` measures that (a forward over a
one-block scratch cache: nothing is read or written there) before the KV pool is sized, and the
model runner leaves it out of the KV budget.

Graphs exist on CUDA only. Elsewhere ``capture`` records the static-buffer forward itself, so
tests check the padding on CPU with the interpreted kernels.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, cast

import torch

from prefixserve.attention.metadata import AttentionMetadata, SeqSpan, build_attention_metadata
from prefixserve.runner.decode_replay import DecodeReplay

if TYPE_CHECKING:
    from prefixserve.attention.backend import AttentionBackend, AttentionStep
    from prefixserve.attention.triton_backend import TritonAttentionBackend
    from prefixserve.core.config import EngineConfig
    from prefixserve.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512
# ``profile``'s peak is raised by this factor plus these bytes a graph (allocator rounding,
# the graphs' own kernel-node storage).
PROFILE_MARGIN = 1.25
BYTES_PER_GRAPH = 2**20


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to ``max_num_seqs`` (at most 512), and that cap."""
    cap = min(max_num_seqs, MAX_CAPTURE_SIZE)
    return sorted({s for s in (1, 2, 4, *range(8, cap + 1, 8)) if s <= cap} | {cap})


class CUDAGraphRunner(DecodeReplay):
    """Replays captured decode forwards (the module docstring draws the static buffers).

    Invariants: a replayed step's rows < n equal the eager forward's up to the decode kernel's
    split count (a different float32 summation order); padded rows write and read no K/V; the
    graphs read ``kv_caches`` at the address they captured, so the cache is never reallocated.
    """

    kind = "cuda_graphs"

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: TritonAttentionBackend,
        sizes: list[int],
        max_model_len: int,
        block_size: int,
    ) -> None:
        super().__init__(sizes)
        self.model, self.backend = model, backend
        self.max_model_len, self.block_size = max_model_len, block_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        largest, width = sizes[-1], -(-max_model_len // block_size)
        row = SeqSpan([0] * width, max_model_len - 1, 1)  # a decode at the last position
        with torch.inference_mode():
            self.positions, self.metadata = build_attention_metadata(
                [row] * largest, block_size, self.device, plan_groups=False
            )
            self.metadata.slot_mapping.fill_(-1)  # padding rows write no K/V ...
            self.metadata.seq_lens.zero_()  # ... and read none
            self.input_ids = torch.zeros(largest, dtype=torch.int64, device=self.device)
            hidden_size = model.config.hidden_size
            self.hidden = torch.zeros(largest, hidden_size, dtype=self.dtype, device=self.device)
        self.graphs: dict[int, Callable[[], None]] = {}

    @classmethod
    def create(
        cls, config: EngineConfig, model: LlamaForCausalLM, backend: AttentionBackend
    ) -> CUDAGraphRunner | None:
        """The runner for ``config`` on CUDA, or None with the torch backend (which plans each
        step from host copies)."""
        if backend.name != "triton":
            logger.info("CUDA graphs need attention_backend='triton'; decode steps run eagerly")
            return None
        max_model_len = config.resolve_max_model_len(model.config.max_position_embeddings)
        sizes = capture_sizes(config.max_num_seqs)
        triton = cast("TritonAttentionBackend", backend)
        return cls(model, triton, sizes, max_model_len, config.block_size)

    def _forward(self, bs: int, kv_caches: torch.Tensor) -> None:
        """The decode forward of ``bs`` rows over the static buffers, into ``hidden``."""
        md = self.metadata.first_decodes(bs)  # max_seq_len = max_model_len: fixed splits, tiles
        step = self.backend.plan(md, kv_caches[0])
        self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], kv_caches, step)

    @torch.inference_mode()
    def profile(self) -> int:
        """Bytes to leave out of the KV budget for the graphs (call before the KV pool exists)."""
        mc = self.model.config
        shape = (mc.num_hidden_layers, 2, 1, self.block_size, mc.num_key_value_heads, mc.head_dim)
        scratch = torch.zeros(shape, dtype=self.dtype, device=self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self._forward(self.sizes[-1], scratch)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del scratch
        torch.cuda.empty_cache()
        return int(peak * PROFILE_MARGIN) + BYTES_PER_GRAPH * len(self.sizes)

    @torch.inference_mode()
    def capture(self, kv_caches: torch.Tensor) -> None:
        """One graph per batch size over ``kv_caches`` (the engine's whole cache), largest first
        so that every smaller graph fits in the memory pool the largest left."""
        start = time.perf_counter()
        on_cuda = self.device.type == "cuda"
        free_before = torch.cuda.mem_get_info(self.device)[0] if on_cuda else 0
        pool = None
        for bs in reversed(self.sizes):
            bucket_start = time.perf_counter()
            self._forward(bs, kv_caches)  # warm-up: kernels compile outside the capture
            if not on_cuda:
                self.graphs[bs] = partial(self._forward, bs, kv_caches)
                continue
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(bs, kv_caches)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph.replay
            self.capture_seconds[str(bs)] = time.perf_counter() - bucket_start
        if on_cuda:
            torch.cuda.synchronize(self.device)
            used = free_before - torch.cuda.mem_get_info(self.device)[0]
            logger.info(
                "CUDA graphs: %d decode batch sizes (1 .. %d) captured in %.1f s, %.0f MiB",
                len(self.sizes),
                self.sizes[-1],
                time.perf_counter() - start,
                used / 2**20,
            )

    def fits(self, md: AttentionMetadata, step: AttentionStep) -> bool:
        """The block tables fit the captured ones, and the step's plan takes no cascade."""
        return (
            md.block_tables.shape[1] <= self.metadata.block_tables.shape[1]
            and md.backend_plan.cascade is None
        )

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
               md: AttentionMetadata, step: AttentionStep) -> torch.Tensor:  # fmt: skip
        """The final hidden states from a graph (a view of ``hidden``, valid until the next
        step)."""
        n = md.num_seqs
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        static = self.metadata
        static.slot_mapping[:n].copy_(md.slot_mapping)
        static.slot_mapping[n:bs].fill_(-1)
        static.seq_lens[:n].copy_(md.seq_lens)
        static.seq_lens[n:bs].zero_()
        static.block_tables[:n, : md.block_tables.shape[1]].copy_(md.block_tables)
        self.graphs[bs]()
        return self.hidden[:n]
