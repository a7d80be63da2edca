"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, Qwen3-MoE) in one model, driven by
``ModelConfig``; Qwen3-MoE's sparse layers swap the MLP for ``moe.SparseMoeBlock``.

The model runs one forward over a flattened batch (see ``prefixserve.attention.backend``): every
tensor below is indexed by token, ``T`` tokens of all scheduled sequences concatenated, and only
attention knows where one sequence ends. Parameters are created uninitialized; ``load_weights``
fills every one of them (it raises if any is left over). q/k/v and gate/up are fused into one
matmul each; their Hugging Face names are mapped onto slices of the fused weights.

Every weight matrix is a ``linear.Linear`` whose kernel is chosen at load (``finalize``): on CPU
the block-layout kernels of ``prefixserve.kernels.cpu_linear``, float or quantized. The
vocabulary matrix ``embed_tokens`` gives the token embeddings (``rows``) and, when tied, is the
lm_head.

Only the tokens that sample need the last layer's output. Given ``keep`` (those rows), the last
layer computes K/V for every token, since later tokens attend to them, and attention, ``o_proj``
and the MLP for the kept rows alone: on a prefill of N tokens that skips nearly 1 / num_layers of
the work, with the same values for the rows that sample.

A CPU decode step is a few small matmuls per layer, so every other op is overhead: rope's cos/sin
are gathered once per forward and q and k are rotated in one call (the same bits as the formula
it replaces, ``tests/test_decode_fast_path``); each norm adds the residual first, in one C++ op
on CPU (``RMSNorm``). The model never asks how it runs: an eager step and a compiled one
(``prefixserve.runner.compiled_step``) run this same code over the same step context.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.attention.backend import AttentionBackend, AttentionStep
from prefixserve.core.errors import ModelLoadError
from prefixserve.kernels import cpu_norm
from prefixserve.models.config import ModelConfig
from prefixserve.models.linear import Linear, cpu_kernels_apply, finalize_linears
from prefixserve.models.moe import (
    SparseMoeBlock,
    expert_shard_view,
    expert_shards,
    map_expert_name,
)

logger = logging.getLogger(__name__)

# The rows of the flattened batch whose last-layer output is needed, and the attention step that
# runs them as one query token each (None when there are no rows); see ``forward``.
Keep = tuple[torch.Tensor, "AttentionStep | None"]
# Each token's rope cos and sin, (T, 1, head_dim) each (see ``RotaryEmbedding``).
Rope = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    """RMS normalization over the last dim, computed in float32 and cast back (as transformers);
    given ``residual``, the residual add first: ``(norm(x + residual), x + residual)``.

    Float32 weights on CPU take the C++ kernel (``cpu_kernel``, chosen at load by
    ``LlamaForCausalLM.finalize``; ``prefixserve.kernels.cpu_norm``): one op for the add and the
    norm, eager and compiled alike, so both give the same bits. Elsewhere float32 is one
    ``torch.rms_norm`` (the transformers formula's bits).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.cpu_kernel = False

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.cpu_kernel:
            if residual is None:
                return cpu_norm.rms_norm(x, self.weight, self.eps)
            return cpu_norm.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 == self.weight.dtype:  # one fused op, bit-equal (tested)
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` (float32) and the cos/sin scale for the rope type."""
    dim, base, rs = config.head_dim, config.rope_theta, config.rope_scaling
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (base**exponents)
    if rs is None:
        return inv_freq, 1.0
    kind = rs["rope_type"]
    if kind == "linear":
        return inv_freq / rs["factor"], 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, rs), 1.0
    assert kind == "yarn", kind
    return _yarn_inv_freq(dim, base, config.max_position_embeddings, rs)


def _llama3_inv_freq(inv_freq: torch.Tensor, rs: dict) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, interpolate in between."""
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, base: float, max_pos: int, rs: dict) -> tuple[torch.Tensor, float]:
    """YaRN: blend interpolated and extrapolated frequencies over a linear ramp of dims."""
    old_len = rs["original_max_position_embeddings"]
    factor = rs.get("factor") or max_pos / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = rs.get("attention_factor")
    if attn_factor is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attn_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(rs.get("beta_fast") or 32), correction_dim(rs.get("beta_slow") or 1)
    if rs.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attn_factor)


class RotaryEmbedding(nn.Module):
    """Neox-style rope with cos/sin precomputed for every position (``[max_pos, head_dim]``).

    The cache is computed in float32 on the CPU, exactly as transformers computes its per-step
    cos/sin, then cast to the default dtype and device the model is built under. It is stored
    in the form ``apply_rope`` reads: ``cos`` is ``[c, c]`` and ``sin`` is ``[-s, s]`` over the
    two halves of a head.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq, scale = rope_inv_freq(config)
        positions = torch.arange(config.max_position_embeddings, device="cpu").float()
        freqs = positions[:, None] * inv_freq[None, :]  # (P, hd/2)
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        dtype, device = torch.get_default_dtype(), torch.empty(0).device
        self.register_buffer("cos", torch.cat((cos, cos), -1).to(device, dtype), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), -1).to(device, dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> Rope:
        """Each token's cos and sin, ``(T, 1, hd)`` each: gathered once per forward, read by
        every layer (``apply_rope``)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate ``x`` (T, heads, hd) by each token's position (``rope`` from ``RotaryEmbedding``).

    With ``x = [x1, x2]`` (halves of a head) this is ``[x1 c - x2 s, x2 c + x1 s]``, written as
    ``x * [c, c] + [x2, x1] * [-s, s]``: four ops instead of eight, and the same bits (negating
    ``s`` is exact, and each half adds the same two products).
    """
    cos, sin = rope
    return (x * cos).add_(x.roll(x.shape[-1] // 2, dims=-1) * sin)


class Attention(nn.Module):
    """Self-attention of layer ``layer_idx`` over the paged cache. ``step`` is the step context
    the attention backend planned (``prefixserve.attention.backend``), eager or compiled."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 layer_idx: int):  # fmt: skip
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = (
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.rotary_emb = rotary  # one module shared by every layer
        self.backend = backend

    def forward(
        self,
        rope: Rope,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        step: AttentionStep,
        keep: Keep | None = None,
    ) -> torch.Tensor:  # (T, hidden), or (len(rows), hidden) with keep
        t = x.shape[0]
        if keep is None and not self.qk_norm:
            # q and k lie side by side in the fused output: one rotation for both heads' kinds
            qkv = self.qkv_proj(x)  # (T, q_size + 2 kv_size)
            qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)  # (T, nh+nkv, hd)
            q, k = apply_rope(qk, rope).split([self.num_heads, self.num_kv_heads], dim=1)
            v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
            out = self.backend.forward(q, k, v, kv_cache, step, self.scale)
            return self.o_proj(out.reshape(t, self.q_size))
        rows = None if keep is None else keep[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if rows is not None:  # every token's K/V, but queries only for the kept rows
            q = q[rows]
        q = q.view(-1, self.num_heads, self.head_dim)  # (T or rows, nh, hd)
        k = k.view(t, self.num_kv_heads, self.head_dim)  # (T, nkv, hd)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q_rope = rope if rows is None else (rope[0][rows], rope[1][rows])
        q, k = apply_rope(q, q_rope), apply_rope(k, rope)
        if keep is not None:
            rows, rows_step = keep
            self.backend.store_kv(k, v, kv_cache, step.slot_mapping)
            if rows_step is None:  # no row is kept: the K/V were all this layer had to do
                return x.new_empty(0, x.shape[1])
            k, v, step = k[rows], v[rows], rows_step
        out = self.backend.forward(q, k, v, kv_cache, step, self.scale)  # (n, nh, hd)
        return self.o_proj(out.reshape(q.shape[0], self.q_size))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, config.mlp_bias
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 layer_idx: int):  # fmt: skip
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, rotary, backend, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: MLP | SparseMoeBlock
        if config.moe is not None and layer_idx in config.moe.layers:  # Qwen3-MoE sparse layer
            self.mlp = SparseMoeBlock(config.moe, config.hidden_size, backend.name == "triton")
        else:
            self.mlp = MLP(config)

    def forward(
        self,
        rope: Rope,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        step: AttentionStep,
        keep: Keep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, residual)`` -> the next layer's ``(h, residual)``, whose sum is this layer's
        output (the residual stream): each norm adds the residual first (one op on CPU). The
        first layer gets ``residual`` None."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm(h, residual)
        attn = self.self_attn(rope, x, kv_cache, step, keep)
        if keep is not None:
            residual = residual[keep[0]]
        x, residual = self.post_attention_layernorm(attn, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(config)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.rotary_emb, backend, i)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# Hugging Face parameter name suffix -> (our fused parameter suffix, shard index).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """Causal LM over a paged KV cache; one batched forward for the whole flattened batch."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, attn_backend)
        self.lm_head: Linear | None = None  # tied: ``model.embed_tokens`` serves
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def vocab_head(self) -> Linear:
        """The matrix that turns final hidden states into logits."""
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, nkv, hd]
        step: AttentionStep,
        keep: Keep | None = None,
    ) -> torch.Tensor:  # [T, hidden] (or [len(rows), hidden] with keep), after the final norm
        """Every token's K/V is written in every layer. ``step`` is the attention backend's plan
        of the step (``AttentionBackend.plan``), the one step context every layer reads. Without
        ``keep`` the result holds every token's final hidden state; with ``keep = (rows,
        rows_step)`` only those rows' (the tokens that sample), and the last layer runs its
        queries, attention, ``o_proj`` and MLP for those rows alone, since no other token's
        last-layer output is ever read. ``rows_step`` is the plan of the kept rows as a batch of
        one query token each (None when ``rows`` is empty)."""
        h, residual = self.model.embed_tokens.rows(input_ids), None  # (T, hidden)
        rope = self.model.rotary_emb(positions)  # the same cos/sin for every layer
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            h, residual = layer(rope, h, residual, kv_caches[i], step, keep if i == last else None)
        return self.model.norm(h, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab]`` float32."""
        return self.vocab_head(hidden_states).float()

    def finalize(
        self, quantization: str | None, prequantized=None, activations: str | None = None
    ) -> dict[str, str]:
        """Choose every linear's kernel once the weights are loaded (``linear.finalize_linears``):
        quantized by ``quantization`` or as ``prequantized`` gives them, multiplied on int8
        activations where ``activations`` is "int8"; returns {module: scheme} of the quantized
        ones. The float weights the kernels replace are dropped. Norms take the C++ kernel
        where the linears take ``cpu_linear``'s."""
        done = finalize_linears(
            self, quantization, prequantized, self.source_weight_names, activations
        )
        for name, module in self.named_modules():
            if isinstance(module, RMSNorm):
                module.cpu_kernel = cpu_kernels_apply(module.weight.device, module.weight.dtype)
            if isinstance(module, SparseMoeBlock) and (
                scheme := module.finalize(quantization, activations)
            ):
                done[f"{name}.experts"] = scheme
        return done

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face named tensors into the model (any dtype/device; cast on copy).

        Names are HF's (``model.layers.0.self_attn.q_proj.weight``), or already fused
        (``...qkv_proj.weight``); Qwen3-MoE experts one at a time (``...mlp.experts.3.up_proj
        .weight``, a shard ``(expert, half)`` of the stacked ``...mlp.experts.gate_up_proj``) or
        already stacked. Raises ``ModelLoadError`` on an unknown name, a shape mismatch,
        or any parameter (or fused shard) that no tensor filled. Rotary ``inv_freq`` buffers are
        ignored, and so is ``lm_head.weight`` when the embeddings are tied.
        """
        params = dict(self.named_parameters())
        expected = {(name, None) for name in params}
        loaded: set[tuple[str, int | tuple[int, int] | None]] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            target, shard = self._map_name(name)
            if target == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if target not in params:
                raise ModelLoadError(f"checkpoint holds weight {name!r}, which this model lacks")
            dest = self._shard_view(params[target], target, shard)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add((target, shard))
        for target in {t for t, shard in loaded if shard is not None}:
            if all((target, s) in loaded for s in self._shards(params[target], target)):
                loaded.add((target, None))
        missing = sorted(n for n, _ in expected - loaded)
        if missing:
            raise ModelLoadError(
                f"checkpoint lacks weights: {missing[:8]}{' ...' * (len(missing) > 8)}"
            )
        logger.debug("loaded %d parameters", len(params))

    @staticmethod
    def source_weight_names(module: str) -> list[str]:
        """The Hugging Face weight names a linear module stacks, in row order (one if unfused):
        ``...self_attn.qkv_proj`` -> ``[...self_attn.q_proj.weight, ...k_proj..., ...v_proj...]``."""
        prefix, _, leaf = module.rpartition(".")
        shards = sorted((shard, hf) for hf, (fused, shard) in _FUSED.items() if fused == leaf)
        return [f"{prefix}.{hf}.weight" for _, hf in shards] or [f"{module}.weight"]

    @staticmethod
    def _map_name(name: str) -> tuple[str, int | tuple[int, int] | None]:
        """HF name -> (our parameter name, shard index within a fused weight, ``(expert, half)``
        within stacked experts, or None)."""
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return name, None
        expert = map_expert_name(name)  # Qwen3-MoE: one expert's projection
        if expert is not None:
            return expert
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _FUSED:
            fused, shard = _FUSED[parts[-2]]
            return ".".join([*parts[:-2], fused, parts[-1]]), shard
        return name, None

    @staticmethod
    def _shards(param: torch.Tensor, name: str) -> list[int | tuple[int, int]] | range:
        """Every shard that fills the fused or stacked parameter ``name``."""
        if name.endswith(("gate_up_proj", "down_proj")):  # stacked experts (no ``.weight``)
            return expert_shards(param, name)
        return range(3 if "qkv_proj" in name else 2)

    def _shard_view(
        self, param: torch.Tensor, name: str, shard: int | tuple[int, int] | None
    ) -> torch.Tensor:
        if shard is None:
            return param
        if isinstance(shard, tuple):
            return expert_shard_view(param, name, shard)
        if "qkv_proj" in name:
            attn = self.model.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        return param.split(sizes, dim=0)[shard]
