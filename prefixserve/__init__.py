"""prefixserve: an LLM serving engine built for traffic whose requests share long prefixes."""

from prefixserve.inputs import TextPrompt, TokensPrompt
from prefixserve.kv.retention import KVRetention
from prefixserve.outputs import CompletionOutput, RequestOutput
from prefixserve.sampling_params import BeamSearchParams, SamplingParams
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
        from prefixserve.llm import LLM

        return LLM
    if name == "LLMEngine":
        from prefixserve.engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'prefixserve' has no attribute {name!r}")
