"""EngineConfig.resolve_max_model_len: the context limit the engine and the CUDA graphs share."""

from __future__ import annotations

import pytest

from prefixserve.config import EngineConfig
from prefixserve.errors import InvalidArgumentError


def test_max_model_len_defaults_to_the_models_positions() -> None:
    assert EngineConfig().resolve_max_model_len(4096) == 4096


def test_a_shorter_max_model_len_is_kept() -> None:
    assert EngineConfig(max_model_len=512).resolve_max_model_len(4096) == 512
    assert EngineConfig(max_model_len=4096).resolve_max_model_len(4096) == 4096


def test_more_than_the_models_positions_is_refused_not_capped() -> None:
    with pytest.raises(InvalidArgumentError, match="exceeds the model's") as info:
        EngineConfig(max_model_len=4097).resolve_max_model_len(4096)
    assert info.value.param == "max_model_len"
