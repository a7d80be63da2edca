"""The bench checkpoint, the machine it runs on, and prefixserve driven request by request.

    python benchmarks/bench_model.py [--model-dir DIR] [--force]

The bench model is a Llama-shaped random-weight checkpoint (hidden 512, 8 layers, 8 query heads,
2 KV heads, intermediate 1536, float32, seeded) with prefixserve's built-in tokenizer, written once
with ``save_pretrained`` into ``benchmarks/results/bench-model`` and reused by every benchmark, so
that prefixserve and transformers load the same weights. Its text is meaningless; only speed and
token agreement are measured with it.

``run_engine`` drives ``LLMEngine`` directly (add_request / step) and records, per request, when it
was submitted, when its first token came back and when it finished.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from workloads import RESULTS_DIR

from prefixserve.core.config import EngineConfig
from prefixserve.core.sampling_params import SamplingParams
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.models.random_checkpoint import tokenizer_fields, write_random_checkpoint

DEFAULT_MODEL_DIR = RESULTS_DIR / "bench-model"
SHAPE = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 1536,
    "max_position_embeddings": 4096,
}
SEED = 1234


def build_checkpoint(folder: Path, seed: int = SEED) -> Path:
    """Write the bench checkpoint (safetensors, float32) and the built-in tokenizer into ``folder``
    (``prefixserve.models.random_checkpoint``'s recipe at ``initializer_range`` 0.05: greedy
    argmax margins wide enough for float32 agreement checks between two implementations)."""
    config = transformers.LlamaConfig(
        **SHAPE,
        **tokenizer_fields(),
        initializer_range=0.05,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    return write_random_checkpoint(config, folder, seed=seed)


def ensure_checkpoint(folder: Path | str = DEFAULT_MODEL_DIR, force: bool = False) -> Path:
    """The bench checkpoint folder, built on first use (or again with ``force``)."""
    folder = Path(folder)
    if (
        force
        or not (folder / "config.json").exists()
        or not (folder / "model.safetensors").exists()
    ):
        folder.mkdir(parents=True, exist_ok=True)
        build_checkpoint(folder)
    return folder


def count_parameters(folder: Path | str) -> int:
    """Parameters stored in the checkpoint (read from safetensors metadata, no weights loaded)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
            total += math.prod(f.get_slice(key).get_shape())
    return total


def load_hf_model(folder: Path | str) -> torch.nn.Module:
    """The transformers model of the checkpoint: float32, eval mode, sdpa attention."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval()


def make_engine(folder: Path | str, **options) -> LLMEngine:
    """A prefixserve engine on the checkpoint, CPU float32; ``options`` go to ``EngineConfig``."""
    return LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", **options))


def set_threads(threads: int) -> int:
    """Give torch (used by every system in this process) the same intra-op thread count."""
    torch.set_num_threads(threads)
    return torch.get_num_threads()


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo where there is one, else the architecture."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def machine() -> dict:
    """What the numbers were measured on."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m_at_start": load,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


@dataclass
class BenchRequest:
    """One request of a workload: a token-id prompt, a fixed output length, and when it ran.

    Times are ``time.perf_counter`` seconds; ``output`` holds the generated token ids.
    """

    request_id: str
    prompt: list[int]
    max_tokens: int
    group: str = ""
    submit_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    output: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def ttft(self) -> float:
        assert self.first_token_time is not None
        return self.first_token_time - self.submit_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for one-token outputs."""
        if self.finish_time is None or self.first_token_time is None or len(self.output) < 2:
            return None
        return (self.finish_time - self.first_token_time) / (len(self.output) - 1)


FollowUp = Callable[[BenchRequest], "BenchRequest | None"]


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy, EOS ignored: every request generates exactly ``max_tokens`` tokens."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_engine(
    engine: LLMEngine, requests: list[BenchRequest], follow_up: FollowUp | None = None
) -> tuple[list[BenchRequest], float]:
    """Submit ``requests`` at once, step until all (and their follow-ups) finish.

    ``follow_up(done)`` may return the next request of the same client (an agent's next turn); it
    is submitted the moment ``done`` finishes. Returns every request run, and the wall time.
    """
    live: dict[str, BenchRequest] = {}
    done: list[BenchRequest] = []
    start = time.perf_counter()

    def submit(req: BenchRequest) -> None:
        req.submit_time = time.perf_counter()
        engine.add_request(req.request_id, req.prompt, greedy(req.max_tokens))
        live[req.request_id] = req

    for req in requests:
        submit(req)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            req = live[out.request_id]
            if req.first_token_time is None and out.outputs[0].token_ids:
                req.first_token_time = now
            if out.finished:
                req.finish_time = now
                req.output = list(out.outputs[0].token_ids)
                req.num_cached_tokens = out.num_cached_tokens
                done.append(live.pop(out.request_id))
                nxt = follow_up(req) if follow_up is not None else None
                if nxt is not None:
                    submit(nxt)
    return done, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder exists")
    parser.add_argument("--quick", action="store_true", help="accepted for symmetry; same model")
    args = parser.parse_args(argv)
    folder = ensure_checkpoint(args.model_dir, force=args.force)
    config = json.loads((folder / "config.json").read_text())
    info = {
        "model_dir": str(folder),
        "parameters": count_parameters(folder),
        "shape": {k: config[k] for k in SHAPE},
        "vocab_size": config["vocab_size"],
        "dtype": "float32",
    }
    print(
        f"bench model: {info['parameters'] / 1e6:.1f}M parameters, vocab {info['vocab_size']}, "
        f"{config['num_hidden_layers']} layers x hidden {config['hidden_size']}, "
        f"{config['num_attention_heads']} heads / {config['num_key_value_heads']} KV heads, "
        f"intermediate {config['intermediate_size']}, float32 -> {folder}"
    )
    return info


if __name__ == "__main__":
    main()
