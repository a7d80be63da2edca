"""``ModelConfig``: the part of a Hugging Face ``config.json`` the Llama-family model needs.

Both layouts transformers has written are read: v4 (``rope_theta`` + ``rope_scaling``,
``torch_dtype``) and v5 (``rope_parameters`` holding ``rope_theta`` and the scaling, ``dtype``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from prefixserve.core.errors import ModelLoadError, UnsupportedModelError

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)
# Keys each rope type needs beyond ``rope_type`` (``original_max_position_embeddings`` is filled
# from ``max_position_embeddings`` when absent, as transformers does).
_ROPE_REQUIRED_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one Llama-family checkpoint.

    Invariants: ``num_attention_heads % num_key_value_heads == 0``; ``rope_scaling`` is None for
    plain rope, else a dict whose ``rope_type`` is one of linear / llama3 / yarn and which holds
    that type's keys; ``max_position_embeddings`` is already capped at a sliding window, so any
    context it admits is attended in full.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before rope
    hidden_act: str = "silu"
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    dtype: torch.dtype | None = None  # the checkpoint's dtype, None when config.json omits it
    moe: MoEConfig | None = None  # Qwen3-MoE: which layers route to experts, and how

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse a ``config.json`` dict; raise ``UnsupportedModelError`` / ``ModelLoadError``."""
        archs = d.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported; prefixserve runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; only 'silu' is")
        try:
            hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
            kv_heads = int(d.get("num_key_value_heads") or heads)
            max_pos = int(d["max_position_embeddings"])
            rope_theta, rope_scaling = _parse_rope(d, max_pos)
            qwen2 = arch == "Qwen2ForCausalLM"
            bias = bool(d.get("attention_bias", False))
            eos = d.get("eos_token_id")
            cfg = cls(
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=_cap_at_sliding_window(d, arch, max_pos),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=qwen2 or bias,
                o_proj_bias=bias and not qwen2,
                mlp_bias=bool(d.get("mlp_bias", False)),
                qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
                hidden_act=act,
                eos_token_ids=[] if eos is None else [int(e) for e in _as_list(eos)],
                bos_token_id=d.get("bos_token_id"),
                dtype=_DTYPES.get(str(d.get("dtype") or d.get("torch_dtype"))),
                moe=_parse_moe(d) if arch == "Qwen3MoeForCausalLM" else None,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"config.json is missing or has a malformed field: {e!r}") from e
        if heads % kv_heads:
            raise ModelLoadError(
                f"num_attention_heads {heads} is not a multiple of {kv_heads} kv heads"
            )
        return cfg


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP of Qwen3-MoE: ``num_experts`` SwiGLU experts of width ``intermediate_size``.

    Each token's router logits go through a float32 softmax; the ``top_k`` largest probabilities
    pick its experts and weigh their outputs, renormalised to sum to 1 when ``norm_topk_prob``.
    There is no shared expert. Invariants: ``1 <= top_k <= num_experts``; ``layers`` holds the
    indices of the decoder layers whose MLP is this block (sorted); every other layer keeps the
    dense MLP of ``ModelConfig.intermediate_size``.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    layers: tuple[int, ...]


def _parse_moe(d: dict[str, Any]) -> MoEConfig | None:
    """Qwen3-MoE's expert fields, with transformers' defaults; layer ``i`` is sparse unless it is
    in ``mlp_only_layers``, when ``(i + 1) % decoder_sparse_step == 0`` (as transformers decides).
    The expert count is ``num_experts`` (Hub checkpoints) or ``num_local_experts`` (what
    transformers v5 writes). None when the model has no experts at all."""
    num_experts = int(d.get("num_experts", d.get("num_local_experts", 128)))
    top_k = int(d.get("num_experts_per_tok", 8))
    step, dense = int(d.get("decoder_sparse_step", 1)), set(d.get("mlp_only_layers") or [])
    if num_experts <= 0:
        return None
    if not 1 <= top_k <= num_experts:
        raise ModelLoadError(f"num_experts_per_tok {top_k} is not in 1..num_experts {num_experts}")
    if step < 1:
        raise ModelLoadError(f"decoder_sparse_step must be at least 1, got {step}")
    layers = tuple(
        i for i in range(int(d["num_hidden_layers"])) if i not in dense and (i + 1) % step == 0
    )
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=int(d.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        layers=layers,
    )


def _as_list(x: Any) -> list[Any]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _parse_rope(d: dict[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None]:
    """Return ``(rope_theta, rope_scaling)`` from either config layout."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default":
        return theta, None
    if rope_type not in _ROPE_REQUIRED_KEYS:
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported; use one of "
            f"default, {', '.join(_ROPE_REQUIRED_KEYS)}"
        )
    params.setdefault("original_max_position_embeddings", max_pos)
    missing = [k for k in _ROPE_REQUIRED_KEYS[rope_type] if params.get(k) is None]
    if missing:
        raise ModelLoadError(f"rope scaling {rope_type!r} in config.json lacks {missing}")
    return theta, {"rope_type": rope_type, **params}


def _cap_at_sliding_window(d: dict[str, Any], arch: str, max_pos: int) -> int:
    """Contexts up to the sliding window are attended in full, so cap the context there."""
    window = d.get("sliding_window")
    used = arch == "MistralForCausalLM" or bool(d.get("use_sliding_window", False))
    if used and window is not None and int(window) < max_pos:
        logger.warning(
            "model uses a sliding window of %d tokens; capping its context at that length", window
        )
        return int(window)
    return max_pos
