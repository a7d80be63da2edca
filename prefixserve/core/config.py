"""Engine configuration: one validated dataclass built from ``LLM(...)`` / CLI options."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from prefixserve.core.errors import InvalidArgumentError, require
from prefixserve.spec_decode.config import SpeculativeConfig

_DTYPES = ("auto", "float32", "float16", "bfloat16")
_BACKENDS = ("auto", "cpu", "torch", "triton")
_POLICIES = ("fcfs", "prefix")
_QUANTIZATIONS = (None, "int8", "int4", "int4_sym")
_ACTIVATION_QUANTIZATIONS = ("int8", None)
DEFAULT_CPU_KV_CACHE_GB = 1.0
DEFAULT_KV_CACHE_DIR_GB = 16.0
_KV_OFFLOADING_DTYPES = ("auto", "int8", "fp8")
ENFORCE_EAGER_ENV = "PREFIXSERVE_ENFORCE_EAGER"
DEFAULT_SEGMENT_RECOMPUTE_RATIO = 0.5  # docs/segment-reuse.md: the measured trade-off


def _enforce_eager_default() -> bool:
    """``enforce_eager``'s default: ``PREFIXSERVE_ENFORCE_EAGER=1`` (the test suite sets it:
    compiling each of its hundreds of short-lived engines would cost more than it runs)."""
    return os.environ.get(ENFORCE_EAGER_ENV, "0") == "1"


@dataclass
class EngineConfig:
    """Options of the engine. ``model=None`` selects the built-in ``prefixserve/tiny-random``.

    KV budget: ``num_kv_blocks`` when given, else ``kv_cache_memory_gb`` (default: 1 GiB on CPU,
    90% of free memory after loading the model on CUDA). ``max_model_len`` defaults to the model's
    ``max_position_embeddings``. ``max_num_batched_tokens`` is the per-step token budget that
    prefill chunks and decode tokens share. ``max_stop_strings`` (also the cap on
    ``stop_token_ids``) and ``max_stop_string_chars`` bound a request's stops, which every step
    checks on the engine thread (``prefixserve.engine.preprocessor``). ``enable_jump_forward``:
    under a grammar, append the text it forces (JSON keys, a forced tool call's name) without sampling it token by token.
    ``kv_events_endpoint`` (e.g. ``tcp://*:5557``): publish the prefix cache's changes there
    (vLLM's KV-event format, ZMQ PUB), with a replay socket at ``kv_events_replay_endpoint``.
    ``enforce_eager``: run every step eagerly; otherwise decode steps replay a capture made at
    start-up (``prefixserve.runner.decode_replay``): CUDA graphs with the Triton backend on CUDA, a
    ``torch.compile``d step on CPU (float32), with Inductor's cache in ``compile_cache_dir``
    (default ``~/.cache/prefixserve/inductor``, unless ``TORCHINDUCTOR_CACHE_DIR`` is set).
    Default off, or on where ``PREFIXSERVE_ENFORCE_EAGER=1``. ``batch_invariant``: one
    reduction order for every batch shape (CPU, float32, the cpu backend): a request's tokens
    and logprobs are bit-identical alone or in any batch, under any chunking of its prompt,
    compiled or not.
    ``quantization`` (int8 / int4 / int4_sym): weight-only quantization of the decoder's linear layers
    (``prefixserve.models.quantization``). ``activation_quantization``: how the CPU kernels multiply
    quantized weights (``--quantization`` or a GGUF file's): ``"int8"`` (default) quantizes
    each activation row to int8 in blocks of 32 and sums each block in integers
    (``kernels/cpu_qlinear.cpp``); None keeps activations in float32 and multiplies by exactly
    the dequantized weights (``kernels/cpu_linear.cpp``). ``gguf_dequantize``: load a GGUF file's quantized
    tensors as float instead of keeping them quantized (``prefixserve.models.gguf_loader``).
    ``speculative_config`` (vLLM's dict, or a ``SpeculativeConfig``; default None: off): draft
    tokens from the request's own text, verified in the same step (``prefixserve.spec_decode``).

    Tiers under the KV pool (``prefixserve.kv.tiers``, docs/kv-tiers.md), all off by default:
    ``kv_offloading_size`` (GiB, vLLM's name): host memory for evicted blocks, kept as they are
    or compressed (``kv_offloading_dtype`` "int8" / "fp8"); ``kv_cache_dir`` (+ its cap
    ``kv_cache_dir_size`` GiB): a disk tier that survives restarts; ``kv_shared_url``
    (``redis://HOST:PORT``): a Valkey/Redis tier shared by replicas. ``kv_tier_secret``: the key
    that authenticates disk and shared blocks (``prefixserve.kv.tiers.secret``: without one a
    disk tier keeps its own, a shared tier alone uses one per process; never printed).
    ``kv_tier_tenant_share``: the share of a local tier's bytes one tenant's retained blocks
    keep priority in (``prefixserve.kv.tiers.lru_index``). Retention
    (``SamplingParams.kv_retention``): at most ``kv_retention_budget`` of the pool's blocks are
    protected at once, shared max-min fairly between tenants; each tenant keeps at most
    ``kv_retention_max_sessions`` retained prefixes (its oldest end first); TTLs are capped at
    ``kv_retention_max_ttl_s``; a retention without a TTL (a pause on a tool call) gets
    ``kv_retention_default_ttl_s``, or with
    ``kv_retention_learn_ttl`` a TTL learned from the gaps seen between turns.

    ``segment_reuse``: past a prompt's cached prefix, reuse the K/V of segments (documents,
    paragraphs) computed in other prompts wherever they sit (``prefixserve.kv.segments``),
    recomputing the first ``segment_recompute_ratio`` of each reused segment's tokens in its new
    context. Approximate by design: a request that reuses nothing, or opts out
    (``SamplingParams.segment_reuse=False``), is exact. Off by default.
    """

    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    block_size: int = 16
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enable_jump_forward: bool = True
    scheduling_policy: str = "fcfs"
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    attention_backend: str = "auto"
    revision: str | None = None
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    enforce_eager: bool = field(default_factory=_enforce_eager_default)
    compile_cache_dir: str | None = None
    batch_invariant: bool = False
    quantization: str | None = None
    activation_quantization: str | None = "int8"
    gguf_dequantize: bool = False
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None
    kv_offloading_size: float | None = None
    kv_offloading_dtype: str = "auto"
    kv_cache_dir: str | None = None
    kv_cache_dir_size: float = DEFAULT_KV_CACHE_DIR_GB
    kv_shared_url: str | None = None
    kv_tier_secret: str | None = field(default=None, repr=False)
    kv_tier_tenant_share: float = 0.5
    kv_retention_budget: float = 0.5
    kv_retention_default_ttl_s: float = 300.0
    kv_retention_max_ttl_s: float = 3600.0
    kv_retention_learn_ttl: bool = True
    kv_retention_max_sessions: int = 1024
    segment_reuse: bool = False
    segment_recompute_ratio: float = DEFAULT_SEGMENT_RECOMPUTE_RATIO

    @property
    def has_kv_tiers(self) -> bool:
        return bool(self.kv_offloading_size or self.kv_cache_dir or self.kv_shared_url)

    def __post_init__(self) -> None:
        self._check_kv_tiers()
        self._check_segments()
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        require(
            self.speculative_config is None
            or isinstance(self.speculative_config, SpeculativeConfig),
            "speculative_config",
            f"must be a dict or None, got {type(self.speculative_config).__name__}",
        )
        bs = self.block_size
        require(
            isinstance(bs, int) and bs >= 1 and bs & (bs - 1) == 0,
            "block_size",
            f"must be a power of two, got {bs!r}",
        )
        require(
            self.max_model_len is None
            or (isinstance(self.max_model_len, int) and self.max_model_len >= 1),
            "max_model_len",
            f"must be a positive integer or None, got {self.max_model_len!r}",
        )
        require(
            self.num_kv_blocks is None
            or (isinstance(self.num_kv_blocks, int) and self.num_kv_blocks >= 2),
            "num_kv_blocks",
            f"must be an integer >= 2 or None, got {self.num_kv_blocks!r}",
        )
        require(
            self.kv_cache_memory_gb is None or self.kv_cache_memory_gb > 0,
            "kv_cache_memory_gb",
            f"must be > 0, got {self.kv_cache_memory_gb!r}",
        )
        require(
            isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1,
            "max_num_seqs",
            f"must be an integer >= 1, got {self.max_num_seqs!r}",
        )
        require(
            isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            f"must be an integer >= 1, got {self.max_num_batched_tokens!r}",
        )
        for name in ("max_stop_strings", "max_stop_string_chars"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, name,
                    f"must be an integer >= 1, got {value!r}")  # fmt: skip
        require(
            self.scheduling_policy in _POLICIES,
            "scheduling_policy",
            f"must be one of {_POLICIES}, got {self.scheduling_policy!r}",
        )
        require(
            isinstance(self.enforce_eager, bool),
            "enforce_eager",
            f"must be True or False, got {self.enforce_eager!r}",
        )
        require(
            isinstance(self.batch_invariant, bool),
            "batch_invariant",
            f"must be True or False, got {self.batch_invariant!r}",
        )
        require(
            self.quantization in _QUANTIZATIONS,
            "quantization",
            f"must be one of {_QUANTIZATIONS}, got {self.quantization!r}",
        )
        require(
            self.activation_quantization in _ACTIVATION_QUANTIZATIONS,
            "activation_quantization",
            f"must be 'int8' or None, got {self.activation_quantization!r}",
        )
        require(self.dtype in _DTYPES, "dtype", f"must be one of {_DTYPES}, got {self.dtype!r}")
        require(
            self.attention_backend in _BACKENDS,
            "attention_backend",
            f"must be one of {_BACKENDS}, got {self.attention_backend!r}",
        )
        require(
            isinstance(self.device, str)
            and (self.device in ("auto", "cpu") or self.device.startswith("cuda")),
            "device",
            f"must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}",
        )

    def _check_kv_tiers(self) -> None:
        require(
            self.kv_offloading_size is None
            or (isinstance(self.kv_offloading_size, (int, float)) and self.kv_offloading_size > 0),
            "kv_offloading_size",
            f"must be > 0 GiB or None, got {self.kv_offloading_size!r}",
        )
        require(
            self.kv_offloading_dtype in _KV_OFFLOADING_DTYPES,
            "kv_offloading_dtype",
            f"must be one of {_KV_OFFLOADING_DTYPES}, got {self.kv_offloading_dtype!r}",
        )
        require(
            self.kv_offloading_dtype == "auto" or self.kv_offloading_size is not None,
            "kv_offloading_dtype",
            "compresses the host tier: set kv_offloading_size too",
        )
        require(
            self.kv_cache_dir is None or (isinstance(self.kv_cache_dir, str) and self.kv_cache_dir),
            "kv_cache_dir",
            f"must be a folder path or None, got {self.kv_cache_dir!r}",
        )
        require(
            isinstance(self.kv_cache_dir_size, (int, float)) and self.kv_cache_dir_size > 0,
            "kv_cache_dir_size",
            f"must be > 0 GiB, got {self.kv_cache_dir_size!r}",
        )
        require(
            self.kv_shared_url is None
            or (
                isinstance(self.kv_shared_url, str)
                and self.kv_shared_url.startswith(("redis://", "rediss://", "valkey://", "unix://"))
            ),
            "kv_shared_url",
            f"must be a redis://HOST:PORT URL or None, got {self.kv_shared_url!r}",
        )
        require(
            self.kv_tier_secret is None
            or (isinstance(self.kv_tier_secret, str) and self.kv_tier_secret.strip() != ""),
            "kv_tier_secret",
            "must be a non-empty string or None",
        )
        require(
            isinstance(self.kv_tier_tenant_share, (int, float))
            and 0.0 < self.kv_tier_tenant_share <= 1.0,
            "kv_tier_tenant_share",
            f"must be a share of a tier in (0, 1], got {self.kv_tier_tenant_share!r}",
        )
        require(
            isinstance(self.kv_retention_budget, (int, float))
            and 0.0 <= self.kv_retention_budget <= 1.0,
            "kv_retention_budget",
            f"must be a share of the pool in [0, 1], got {self.kv_retention_budget!r}",
        )
        for name in ("kv_retention_default_ttl_s", "kv_retention_max_ttl_s"):
            value = getattr(self, name)
            require(
                isinstance(value, (int, float)) and value > 0, name, f"must be > 0, got {value!r}"
            )
        require(
            isinstance(self.kv_retention_max_sessions, int)
            and not isinstance(self.kv_retention_max_sessions, bool)
            and self.kv_retention_max_sessions >= 1,
            "kv_retention_max_sessions",
            f"must be an integer >= 1, got {self.kv_retention_max_sessions!r}",
        )
        require(
            isinstance(self.kv_retention_learn_ttl, bool),
            "kv_retention_learn_ttl",
            f"must be True or False, got {self.kv_retention_learn_ttl!r}",
        )

    def _check_segments(self) -> None:
        require(isinstance(self.segment_reuse, bool), "segment_reuse",
                f"must be True or False, got {self.segment_reuse!r}")  # fmt: skip
        ratio = self.segment_recompute_ratio
        require(
            isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0.0 <= ratio <= 1.0,
            "segment_recompute_ratio",
            f"must be a share of each reused segment in [0, 1], got {ratio!r}",
        )

    def resolve_max_model_len(self, max_position_embeddings: int) -> int:
        """The engine's context limit (prompt plus output) for a model with that many positions:
        ``max_model_len``, or all of them when unset. Beyond them is refused. The one rule the
        engine and the CUDA graphs (their block-table width and kernel split counts) share."""
        if self.max_model_len is None:
            return max_position_embeddings
        if self.max_model_len > max_position_embeddings:
            raise InvalidArgumentError(
                f"max_model_len: {self.max_model_len} exceeds the model's "
                f"max_position_embeddings ({max_position_embeddings})",
                param="max_model_len",
            )
        return self.max_model_len
