"""prefixserve: an LLM serving engine built for traffic whose requests share long prefixes."""

from prefixserve.core.inputs import TextPrompt, TokensPrompt
from prefixserve.core.outputs import CompletionOutput, RequestOutput
from prefixserve.core.sampling_params import BeamSearchParams, SamplingParams
from prefixserve.kv.retention import KVRetention
from prefixserve.structured_outputs.params import StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "KVRetention",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
]


def __getattr__(name: str):
    # The engine pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from prefixserve.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from prefixserve.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'prefixserve' has no attribute {name!r}")
