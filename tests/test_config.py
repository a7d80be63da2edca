"""EngineConfig.resolve_max_model_len: the context limit the engine and the CUDA graphs share."""

from __future__ import annotations

import pytest

from prefixserve.core.config import EngineConfig
from prefixserve.core.errors import InvalidArgumentError


def test_max_model_len_defaults_to_the_models_positions() -> None:
    assert EngineConfig().resolve_max_model_len(4096) == 4096


def test_a_shorter_max_model_len_is_kept() -> None:
    assert EngineConfig(max_model_len=512).resolve_max_model_len(4096) == 512
    assert EngineConfig(max_model_len=4096).resolve_max_model_len(4096) == 4096


def test_more_than_the_models_positions_is_refused_not_capped() -> None:
    with pytest.raises(InvalidArgumentError, match="exceeds the model's") as info:
        EngineConfig(max_model_len=4097).resolve_max_model_len(4096)
    assert info.value.param == "max_model_len"


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("kv_offloading_size", 0, "kv_offloading_size"),
        ("kv_offloading_dtype", "int4", "kv_offloading_dtype"),
        ("kv_cache_dir_size", -1, "kv_cache_dir_size"),
        ("kv_shared_url", "http://x:1", "kv_shared_url"),
        ("kv_retention_budget", 1.5, "kv_retention_budget"),
        ("kv_retention_max_ttl_s", 0, "kv_retention_max_ttl_s"),
        ("kv_retention_max_sessions", 0, "kv_retention_max_sessions"),
    ],
)
def test_bad_kv_tier_options_are_typed_errors(field, value, match) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        EngineConfig(**{field: value})


def test_a_compressed_host_tier_needs_its_size() -> None:
    with pytest.raises(InvalidArgumentError, match="set kv_offloading_size"):
        EngineConfig(kv_offloading_dtype="int8")
    assert EngineConfig(kv_offloading_size=1, kv_offloading_dtype="fp8").has_kv_tiers


def test_activation_quantization_is_int8_or_none() -> None:
    assert EngineConfig().activation_quantization == "int8"
    assert EngineConfig(activation_quantization=None).activation_quantization is None
    with pytest.raises(InvalidArgumentError, match="activation_quantization"):
        EngineConfig(activation_quantization="fp8")
