"""Turns a ``SchedulerOutput`` into one forward pass over the flattened batch and returns logits.

Per step: perform the copy-on-write block copies and the segment copies (reused K/V moved to its
new positions, ``segment_copy``), lay the batch out (decodes first; sequences that share leading
blocks next to each other, so each prefix group's tokens are one slice), build ``input_ids`` and
the ``AttentionMetadata``, have the attention backend plan the step (the one step context every
layer reads: ``attention.backend``), run the model once (a decode step replays a capture made at
start-up, ``prefixserve.runner.decode_replay``: a CUDA graph, or a compiled step on CPU), and
compute logits only at the last token of every sequence that samples (a speculating sequence:
its last token and each of its draft tokens, which run right after it). It reads sequences and
never changes them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from prefixserve.attention.backend import AttentionStep
from prefixserve.attention.metadata import AttentionMetadata, SeqSpan, build_attention_metadata
from prefixserve.attention.selector import get_attention_backend
from prefixserve.core.config import DEFAULT_CPU_KV_CACHE_GB, EngineConfig
from prefixserve.core.errors import CacheCapacityError, InvalidArgumentError
from prefixserve.core.scheduler_output import ScheduledSeq, SchedulerOutput
from prefixserve.models.linear import PACKED_KERNELS, LinearKernel
from prefixserve.models.loader import load_model
from prefixserve.runner.decode_replay import create_decode_replay
from prefixserve.runner.segment_copy import copy_segments

logger = logging.getLogger(__name__)


class ModelRunnerOutput(NamedTuple):
    """``samplers``: the scheduled sequences that sample this step; ``samplers[i]`` owns
    ``num_sample_rows`` consecutive rows of ``logits`` (one, or 1 + its drafts), in order; where
    the step's time went; and for each scheduled sequence that asks
    for prompt logprobs, the logits of its chunk's rows that score prompt tokens (row ``j``:
    position ``num_computed_tokens + j``, predicting the next prompt token)."""

    samplers: list[ScheduledSeq]
    logits: torch.Tensor
    prepare_seconds: float
    forward_seconds: float
    prompt_logits: Sequence[tuple[ScheduledSeq, torch.Tensor]] = ()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(
            "device: CUDA was asked for but is not available", param="device"
        )
    return device


class ModelRunner:
    """Owns the model weights and the paged KV cache ``[layers, 2, blocks, block_size, kv_heads, dim]``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.attn_backend = get_attention_backend(
            config.attention_backend, self.device, config.batch_invariant
        )
        self.model, self.model_config, self.model_name = load_model(
            config.model,
            dtype=config.dtype,
            device=self.device,
            attn_backend=self.attn_backend,
            revision=config.revision,
            quantization=config.quantization,
            activation_quantization=config.activation_quantization,
            gguf_dequantize=config.gguf_dequantize,
        )
        self.dtype = self.model.model.norm.weight.dtype
        if config.batch_invariant:
            _check_batch_invariant(self.model)
        self.block_size = config.block_size
        # decode steps replay captures (None: off); their memory is left out of the KV budget
        self.decode_replay = create_decode_replay(config, self.model, self.attn_backend)
        self.num_blocks = self._num_kv_blocks()
        mc = self.model_config
        shape = (mc.num_hidden_layers, 2, self.num_blocks, self.block_size,
                 mc.num_key_value_heads, mc.head_dim)  # fmt: skip
        self.kv_caches = torch.zeros(shape, dtype=self.dtype, device=self.device)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            self.num_blocks,
            self.block_size,
            self.kv_caches.numel() * self.kv_caches.element_size() / 2**30,
        )
        if self.decode_replay is not None:
            try:
                self.decode_replay.capture(self.kv_caches)
            except Exception as e:  # a capture that fails leaves the eager path, never a crash
                logger.warning("decode steps run eagerly: capture failed (%s: %s)",
                               type(e).__name__, e)  # fmt: skip
                self.decode_replay = None

    def _bytes_per_block(self) -> int:
        mc = self.model_config
        elems = mc.num_hidden_layers * 2 * self.block_size * mc.num_key_value_heads * mc.head_dim
        return elems * torch.finfo(self.dtype).bits // 8

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.config.kv_cache_memory_gb is not None:
            budget = self.config.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            replay = self.decode_replay.profile() if self.decode_replay is not None else 0
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = 0.9 * free - replay
        else:
            budget = DEFAULT_CPU_KV_CACHE_GB * 2**30
        num_blocks = int(budget // self._bytes_per_block())
        if num_blocks < 2:
            raise CacheCapacityError(
                "the KV cache budget holds fewer than 2 blocks; raise kv_cache_memory_gb"
            )
        return num_blocks

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: block copies, then one forward over the batch (none if nothing runs)."""
        t0 = time.perf_counter()
        if not out.scheduled:
            return ModelRunnerOutput([], torch.empty(0, self.model_config.vocab_size), 0.0, 0.0)
        if out.block_copies:
            src, dst = zip(*out.block_copies)
            self.attn_backend.copy_blocks(
                self.kv_caches,
                torch.tensor(src, dtype=torch.int64, device=self.device),
                torch.tensor(dst, dtype=torch.int64, device=self.device),
            )
        if out.segment_copies:
            rope = self.model.model.rotary_emb
            copy_segments(self.kv_caches, out.segment_copies, rope.cos, rope.sin)
        tables = out.block_tables
        batch = sorted(out.scheduled, key=lambda s: (s.num_query_tokens != 1, tables[s.seq.seq_id]))
        # one span per piece (a sequence with reused segments may run several), drafts on the last
        spans, last = [], []
        for s in batch:
            pieces = s.query_pieces()
            for k, (start, n) in enumerate(pieces):
                n += len(s.draft_token_ids) if k == len(pieces) - 1 else 0
                spans.append(SeqSpan(tables[s.seq.seq_id], start, n))
            last.append(len(spans) - 1)
        input_ids = [t for s in batch for t in _query_token_ids(s)]
        positions, meta = build_attention_metadata(spans, self.block_size, self.device)
        qsl = meta.query_start_loc_cpu
        samplers = [s for s in batch if s.samples]
        sample_rows = [row for i, s in zip(last, batch)
                       for row in range(qsl[i + 1] - s.num_sample_rows, qsl[i + 1])]  # fmt: skip
        scored = [(s, qsl[i], n) for i, s in zip(last, batch) if (n := _num_prompt_rows(s)) > 0]
        keep = None
        if len(sample_rows) < len(input_ids) and not scored:
            # the last layer runs for the sampling rows only (prompt logprobs need every row)
            row_spans = [SeqSpan(table, start + n - s.num_sample_rows, s.num_sample_rows)
                         for i, s in zip(last, batch) if s.samples
                         for table, start, n in (spans[i],)]  # fmt: skip
            row_step = (
                self._plan(build_attention_metadata(row_spans, self.block_size, self.device)[1])
                if row_spans
                else None
            )
            keep = (torch.tensor(sample_rows, dtype=torch.int64, device=self.device), row_step)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        step = self._plan(meta)  # the step context every layer reads
        t1 = time.perf_counter()
        hidden = None
        if self.decode_replay is not None:  # a decode step replays its capture
            hidden = self.decode_replay.run(ids, positions, self.kv_caches, meta, step, keep)
        if hidden is None:
            hidden = self.model(ids, positions, self.kv_caches, step, keep)
        if keep is None and len(sample_rows) < len(input_ids):
            logits = self.model.compute_logits(hidden[sample_rows])
        else:
            logits = self.model.compute_logits(hidden)
        prompt_logits = [(s, self.model.compute_logits(hidden[first : first + n]))
                         for s, first, n in scored]  # fmt: skip
        return ModelRunnerOutput(samplers, logits, t1 - t0, time.perf_counter() - t1, prompt_logits)

    def _plan(self, meta: AttentionMetadata) -> AttentionStep:
        return self.attn_backend.plan(meta, self.kv_caches[0])


def _check_batch_invariant(model: torch.nn.Module) -> None:
    """``batch_invariant`` holds where every matrix runs a ``cpu_linear`` kernel (one reduction
    order for any row count); anything else (another dtype, no C++ toolchain) is refused."""
    odd = sorted({type(m).__name__ for m in model.modules()
                  if isinstance(m, LinearKernel) and not isinstance(m, PACKED_KERNELS)})  # fmt: skip
    if odd:
        raise InvalidArgumentError(
            f"batch_invariant needs the CPU kernels for every matrix (float32 on CPU); "
            f"this model has {', '.join(odd)} kernels",
            param="batch_invariant",
        )


def _query_token_ids(sched: ScheduledSeq) -> list[int]:
    """The tokens the step runs for ``sched``: its pieces' tokens, then its drafts."""
    tokens = sched.seq.token_ids
    return [t for start, n in sched.query_pieces() for t in tokens[start : start + n]] + (
        sched.draft_token_ids
    )


def _num_prompt_rows(sched: ScheduledSeq) -> int:
    """Rows of this step whose logits score a prompt token (``prompt_logprobs``): the chunk's
    tokens at positions p < num_prompt_tokens - 1, each predicting the token at p + 1."""
    if sched.request.num_prompt_logprobs is None:
        return 0
    start = sched.seq.num_computed_tokens
    return max(0, min(start + sched.num_new_tokens, sched.seq.num_prompt_tokens - 1) - start)
