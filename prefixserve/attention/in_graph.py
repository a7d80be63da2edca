"""Attention (and MoE routing) as opaque ops inside a compiled decode step.

A compiled decode step (``prefixserve.runner.compiled_step``) is one ``torch.compile``d graph per
batch-size bucket. Attention and the K/V write depend on per-step paged metadata (block tables,
context lengths) that would change the graph every step, so inside the graph they are one custom
op, ``prefixserve::step_attention(q, k, v, layer, scale)``, whose body is the eager backend's
``forward`` over the step's real metadata: the same computation, the same bits as an eager step.
A Qwen3-MoE sparse block groups tokens by expert with host-side counts, which no graph can hold:
it is ``prefixserve::step_moe(x, layer)``, the block's eager forward.

The step reaches the ops through ``StepContext``, bound (a ``ContextVar``) by the compiled runner
around each call: the KV cache, the metadata of the step's ``num_rows`` real rows, the backend,
the model's sparse blocks. The model passes ``IN_GRAPH`` where it would pass
``AttentionMetadata``; ``Attention`` and ``DecoderLayer`` then call the ops. Rows past
``num_rows`` (a bucket's padding) get zeros and write no K/V.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from prefixserve.attention.backend import AttentionBackend
from prefixserve.attention.metadata import AttentionMetadata


class InGraph:
    """The marker a compiled forward passes as its attention metadata (see the module docstring)."""

    def __repr__(self) -> str:
        return "IN_GRAPH"


IN_GRAPH = InGraph()


@dataclass(frozen=True)
class StepContext:
    """What ``step_attention`` needs of the step being run."""

    kv_caches: torch.Tensor  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata  # of the step's real rows, the first ``num_rows``
    backend: AttentionBackend
    num_rows: int
    moe: Mapping[int, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)


_STEP: ContextVar[StepContext | None] = ContextVar("prefixserve_step", default=None)


@contextmanager
def bind(context: StepContext) -> Iterator[None]:
    """Make ``context`` the step ``step_attention`` serves while the block runs."""
    token = _STEP.set(context)
    try:
        yield
    finally:
        _STEP.reset(token)


def _bound() -> StepContext:
    step = _STEP.get()
    if step is None:
        raise RuntimeError("a prefixserve step op ran outside a bound step")
    return step


@torch.library.custom_op("prefixserve::step_attention", mutates_args=())
def step_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float
) -> torch.Tensor:
    """The bound step's attention for layer ``layer`` (K/V written first), zeros past its rows."""
    step = _bound()
    n, cache = step.num_rows, step.kv_caches[layer]
    if n == query.shape[0]:
        return step.backend.forward(query, key, value, cache, step.metadata, scale)
    out = query.new_zeros(query.shape)
    out[:n] = step.backend.forward(query[:n], key[:n], value[:n], cache, step.metadata, scale)
    return out


@step_attention.register_fake
def _(query, key, value, layer, scale):
    return torch.empty_like(query)


@torch.library.custom_op("prefixserve::step_moe", mutates_args=())
def step_moe(x: torch.Tensor, layer: int) -> torch.Tensor:
    """The bound model's sparse MoE block ``layer`` on ``x``, run eagerly."""
    return _bound().moe[layer](x)


@step_moe.register_fake
def _(x, layer):
    return torch.empty_like(x)


@torch.library.custom_op("prefixserve::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``torch.rms_norm`` as the eager step runs it: inside a compiled step the norms keep ATen's
    reduction order (Inductor's own would round differently), so a compiled step gives the
    eager step's bits."""
    return torch.rms_norm(x, weight.shape, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)
