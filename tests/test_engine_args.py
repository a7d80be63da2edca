"""engine_args: every engine option reaches EngineConfig, and the model is given once."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from prefixserve.core.config import EngineConfig
from prefixserve.entrypoints.engine_args import add_engine_args, engine_kwargs


def _parse(*argv: str, positional: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    if positional:
        parser.add_argument("model_tag", nargs="?", default=None)
    add_engine_args(parser)
    return parser.parse_args(list(argv))


def test_every_key_is_an_engine_config_field_and_the_defaults_build_one() -> None:
    kwargs = engine_kwargs(_parse())
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(kwargs) <= fields
    assert kwargs["enable_prefix_caching"] and kwargs["enable_jump_forward"]
    assert kwargs["model"] is None and kwargs["block_size"] == 16


def test_options_are_passed_through() -> None:
    kwargs = engine_kwargs(
        _parse("--model", "m", "--block-size", "8", "--no-enable-prefix-caching",
               "--max-model-len", "512", "--enforce-eager", "--scheduling-policy", "prefix")
    )  # fmt: skip
    assert kwargs["model"] == "m" and kwargs["block_size"] == 8
    assert kwargs["enable_prefix_caching"] is False and kwargs["enforce_eager"] is True
    assert kwargs["max_model_len"] == 512 and kwargs["scheduling_policy"] == "prefix"


def test_the_model_is_given_once_positionally_or_by_option() -> None:
    assert engine_kwargs(_parse("a", positional=True))["model"] == "a"
    assert engine_kwargs(_parse("a", "--model", "a", positional=True))["model"] == "a"
    with pytest.raises(SystemExit, match="give the model once"):
        engine_kwargs(_parse("a", "--model", "b", positional=True))


def test_kv_tier_flags_reach_the_engine_config() -> None:
    kwargs = engine_kwargs(
        _parse("--kv-offloading-size", "4", "--kv-offloading-dtype", "int8",
               "--kv-cache-dir", "/tmp/kv", "--kv-cache-dir-size", "2.5",
               "--kv-shared-url", "redis://127.0.0.1:6379", "--kv-retention-budget", "0.25",
               "--kv-retention-max-ttl", "600", "--no-kv-retention-learn-ttl",
               "--kv-retention-max-sessions", "8")
    )  # fmt: skip
    config = EngineConfig(**kwargs)
    assert config.kv_offloading_size == 4 and config.kv_offloading_dtype == "int8"
    assert config.kv_cache_dir == "/tmp/kv" and config.kv_cache_dir_size == 2.5
    assert config.kv_shared_url == "redis://127.0.0.1:6379" and config.has_kv_tiers
    assert config.kv_retention_budget == 0.25 and config.kv_retention_max_ttl_s == 600
    assert config.kv_retention_learn_ttl is False and config.kv_retention_max_sessions == 8


def test_activation_quantization_defaults_to_int8_and_none_keeps_float() -> None:
    assert EngineConfig(**engine_kwargs(_parse())).activation_quantization == "int8"
    off = engine_kwargs(_parse("--quantization", "int4", "--activation-quantization", "none"))
    assert off["activation_quantization"] is None and off["quantization"] == "int4"
    with pytest.raises(SystemExit):
        _parse("--activation-quantization", "int4")
