"""Qwen3-MoE's sparse MLP: a top-k router over ``E`` SwiGLU experts, no shared expert.

Every token ``t`` of the flattened batch gets ``top_k`` (expert, weight) pairs from its router
logits (``select_experts``); its output is ``sum_j weight_j * expert_{e_j}(x_t)``. The experts'
weights are stacked per layer at load, ``gate_up_proj [E, 2I, H]`` (gate rows first, then up) and
``down_proj [E, H, I]``, the layout transformers v5 keeps in memory; Hugging Face checkpoints hold
them one expert at a time (``mlp.experts.{e}.gate_proj.weight``), mapped here onto slices.

Two implementations compute the same sum, picked per model by the attention backend:
- ``grouped_experts`` (the torch and cpu backends): the ``T * top_k`` (token, expert) pairs
  sorted by expert, then one gate/up and one down matmul per active expert over its contiguous
  run of tokens. Its loop runs on the host, so it reads the per-expert counts back. Once loaded
  (``SparseMoeBlock.finalize``) every expert's two matrices get their own linear kernels
  (``prefixserve.models.linear``), quantized like the other layers under ``--quantization``.
  The block runs as one opaque op, ``prefixserve::grouped_moe(x, block)``, eager and compiled
  alike: no graph can hold a host-side loop, so a compiled step calls the op (``block`` names
  the ``SparseMoeBlock`` in a registry of live blocks, ``_BLOCKS``).
- ``prefixserve.kernels.fused_moe`` (Triton backend: GPUs, or the interpreter on CPU): the same
  grouped GEMMs in two launches whose shapes depend on ``T`` alone, so CUDA graphs capture them.
  It reads the stacked float weights, so experts stay unquantized on this path (logged).
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.core.errors import ModelLoadError
from prefixserve.models.config import MoEConfig
from prefixserve.models.linear import Linear, LinearKernel, make_kernel
from prefixserve.models.quantization import GROUP_SIZE, quantize

logger = logging.getLogger(__name__)

# one expert's matrix: a float [N, K] tensor (a slice of the stacked weights) or its kernel
ExpertMatrix = torch.Tensor | LinearKernel


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, E]`` logits -> (``topk_weights [T, top_k]`` in the logits' dtype, ``topk_ids``
    ``[T, top_k]`` int64), as transformers routes: a float32 softmax over all experts, the
    ``top_k`` largest probabilities (``torch.topk``, as transformers picks them), divided by their sum when
    ``renormalize``, cast back to the logits' dtype."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights.to(router_logits.dtype), topk_ids


def _matmul(w: ExpertMatrix, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w) if isinstance(w, torch.Tensor) else w(x, None)


def grouped_experts(
    x: torch.Tensor,  # [T, H]
    gate_up_proj: Sequence[ExpertMatrix],  # E of [2I, H]: stacked [E, 2I, H] or kernels
    down_proj: Sequence[ExpertMatrix],  # E of [H, I]
    topk_weights: torch.Tensor,  # [T, top_k]
    topk_ids: torch.Tensor,  # [T, top_k]
) -> torch.Tensor:  # [T, H]
    """``sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` for ``e = topk_ids[t, j]``.

    The (token, slot) pairs are sorted by expert (stably, so by token within one expert); each
    token's contributions are then added in ascending expert order, the order transformers adds
    them in, so float32 results agree with it to the last bits the matmuls leave.
    """
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort(stable=True)  # [T * top_k] pair indices, grouped by expert
    tokens = order // top_k
    counts = torch.bincount(flat_ids, minlength=len(gate_up_proj)).tolist()
    xs = x[tokens]  # [T * top_k, H]
    out = torch.empty_like(xs)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        gate, up = _matmul(gate_up_proj[expert], xs[start:end]).chunk(2, dim=-1)  # (count, I)
        out[start:end] = _matmul(down_proj[expert], F.silu(gate) * up)
        start = end
    out *= topk_weights.flatten()[order, None]
    return torch.zeros_like(x).index_add_(0, tokens, out)


class Experts(nn.Module):
    """The stacked expert weights of one layer, left uninitialized until weights are loaded;
    after ``to_kernels`` each expert's matrices are kernels instead (``kernels_gate_up`` and
    ``kernels_down``) and the stacked float weights are gone."""

    def __init__(self, moe: MoEConfig, hidden_size: int) -> None:
        super().__init__()
        e, i = moe.num_experts, moe.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, hidden_size, i), requires_grad=False)
        self.kernels_gate_up: nn.ModuleList | None = None
        self.kernels_down: nn.ModuleList | None = None

    def matrices(self) -> tuple[Sequence[ExpertMatrix], Sequence[ExpertMatrix]]:
        if self.kernels_gate_up is None:
            return self.gate_up_proj, self.down_proj
        return self.kernels_gate_up, self.kernels_down

    def to_kernels(self, method: str | None, activations: str | None = None) -> str | None:
        """One kernel per expert matrix, quantized by ``method`` where the width allows and
        multiplied on ``activations`` (see ``linear.finalize_linears``); returns the scheme used,
        if any."""
        dtype = self.gate_up_proj.dtype
        stacks = (self.gate_up_proj, self.down_proj)
        if method is not None and any(w.shape[2] % GROUP_SIZE for w in stacks):
            logger.warning("MoE experts: widths not multiples of %d; left unquantized", GROUP_SIZE)
            method = None
        kernels = [
            nn.ModuleList(
                make_kernel(w[e] if method is None else quantize(w[e], method), dtype, activations)
                for e in range(w.shape[0])
            )
            for w in stacks
        ]
        self.kernels_gate_up, self.kernels_down = kernels
        self.gate_up_proj = self.down_proj = None
        return method


_BLOCKS: weakref.WeakValueDictionary[int, SparseMoeBlock] = weakref.WeakValueDictionary()
_block_ids = itertools.count()


@torch.library.custom_op("prefixserve::grouped_moe", mutates_args=())
def grouped_moe(x: torch.Tensor, block: int) -> torch.Tensor:
    """Sparse block ``block``'s grouped experts on ``x`` [T, hidden] (``SparseMoeBlock``)."""
    return _BLOCKS[block].grouped(x)


@grouped_moe.register_fake
def _(x, block):
    return torch.empty_like(x)


class SparseMoeBlock(nn.Module):
    """Router (``gate``: ``[E, H]``, a token's router logits are ``x @ gate^T``; a ``Linear``,
    never quantized) and ``experts``; the MLP of a Qwen3-MoE sparse layer.

    ``use_triton`` picks ``fused_moe`` over ``grouped_experts``; the model sets it where its
    attention backend is Triton, so a CUDA-graphed decode step never syncs with the host.
    """

    def __init__(self, moe: MoEConfig, hidden_size: int, use_triton: bool) -> None:
        super().__init__()
        self.gate = Linear(hidden_size, moe.num_experts, bias=False)
        self.top_k, self.renormalize = moe.top_k, moe.norm_topk_prob
        self.experts = Experts(moe, hidden_size)
        self.use_triton = use_triton
        self.block_id = next(_block_ids)
        _BLOCKS[self.block_id] = self

    def finalize(self, method: str | None, activations: str | None = None) -> str | None:
        """After loading: the experts' kernels (the torch path), quantized by ``method`` and
        multiplied on ``activations``; the Triton path keeps the stacked float weights. Returns
        the experts' scheme, if any."""
        if self.use_triton:
            if method is not None:
                logger.warning("MoE experts stay unquantized on the Triton backend (fused_moe)")
            return None
        return self.experts.to_kernels(method, activations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        if self.use_triton:
            from prefixserve.kernels.fused_moe import fused_moe

            topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.renormalize)
            return fused_moe(x, *self.experts.matrices(), topk_weights, topk_ids)
        return torch.ops.prefixserve.grouped_moe(x, self.block_id)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """The torch path: route, then ``grouped_experts`` (host-side counts)."""
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        return grouped_experts(x, *self.experts.matrices(), topk_weights, topk_ids)


# Hugging Face per-expert projection -> (stacked parameter, half of it: 0 gate / 1 up / 0 down).
_EXPERT_PROJ = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


def map_expert_name(name: str) -> tuple[str, tuple[int, int]] | None:
    """``...mlp.experts.{e}.{gate,up,down}_proj.weight`` -> (``...mlp.experts.{gate_up,down}_proj``,
    ``(e, half)``); None for any other name (stacked names already match the parameters)."""
    parts = name.split(".")
    if (
        len(parts) < 4
        or parts[-1] != "weight"
        or parts[-2] not in _EXPERT_PROJ
        or parts[-4] != "experts"
        or not parts[-3].isdigit()
    ):
        return None
    stacked, half = _EXPERT_PROJ[parts[-2]]
    return ".".join([*parts[:-3], stacked]), (int(parts[-3]), half)


def expert_shards(param: torch.Tensor, name: str) -> list[tuple[int, int]]:
    """Every ``(e, half)`` shard a checkpoint must fill for the stacked parameter ``name``."""
    halves = 2 if name.endswith("gate_up_proj") else 1
    return [(e, h) for e in range(param.shape[0]) for h in range(halves)]


def expert_shard_view(param: torch.Tensor, name: str, shard: tuple[int, int]) -> torch.Tensor:
    """The slice of the stacked ``param`` that shard ``(e, half)`` fills (a view; copy into it).
    Raises ``ModelLoadError`` for an expert id the model does not have."""
    expert, half = shard
    if expert >= param.shape[0]:
        raise ModelLoadError(
            f"checkpoint holds expert {expert} of {name!r}, which has {param.shape[0]}"
        )
    if name.endswith("gate_up_proj"):
        return param[expert].chunk(2, dim=0)[half]
    return param[expert]
