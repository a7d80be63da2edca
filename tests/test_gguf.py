"""GGUF files: block decoding, weights and tokenizer against transformers' own GGUF loader, the
kept-quantized schemes, and the errors a bad file gets. Files are written by the test itself
(``gguf_files``) from a random Llama-layout checkpoint (``mistral``: GQA 4, no rope scaling)."""

from __future__ import annotations

import pytest
import torch
import transformers
from checkpoints import greedy_logprob_error, load_hf_model, make_checkpoint
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from gguf_files import write_gguf
from quant_reference import LOGPROB_ATOL_INT8_ACTIVATIONS, rounded_activations

from prefixserve import LLM, SamplingParams
from prefixserve.core.errors import ModelLoadError, UnsupportedModelError
from prefixserve.models.builtin import builtin_tokenizer
from prefixserve.models.gguf_loader import GGUFCheckpoint, gguf_tokenizer
from prefixserve.models.linear import (
    LinearKernel,
    PackedBlock,
    PackedInt4,
    PackedInt8,
    PackedW4A8,
    PackedW8A8,
    Stacked,
)
from prefixserve.models.quantization import scheme_of

MIXED = {  # every kept scheme and an unfused F32 layer (o_proj)
    "attn_q": Q.Q4_0,
    "attn_k": Q.Q4_0,
    "attn_v": Q.Q4_0,
    "ffn_gate": Q.Q4_1,
    "ffn_up": Q.Q4_1,
    "ffn_down": Q.Q8_0,
}
BLOCKS = {  # GGUF's 5-bit types, and a fused qkv in two types (as llama-quantize's Q4_K_M has)
    "attn_q": Q.Q5_0,
    "attn_k": Q.Q5_0,
    "attn_v": Q.Q8_0,
    "attn_output": Q.Q5_1,
    "ffn_gate": Q.Q5_1,
    "ffn_up": Q.Q5_1,
    "ffn_down": Q.Q5_0,
}
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], list(range(40, 70))]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    folder = make_checkpoint("mistral", root / "ckpt")
    return {
        "f32": write_gguf(folder, root / "f32.gguf"),
        "mixed": write_gguf(folder, root / "mixed.gguf", MIXED),
        "blocks": write_gguf(folder, root / "blocks.gguf", BLOCKS),
    }


def _hf_gguf(path) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def _check_greedy(llm: LLM, hf: torch.nn.Module, atol: float) -> None:
    assert greedy_logprob_error(llm, hf, PROMPTS, PARAMS) < atol


QUANTIZED = (PackedInt4, PackedInt8, PackedW4A8, PackedW8A8, PackedBlock)


def _quantized_kernels(model: torch.nn.Module) -> list[LinearKernel]:
    return [m for m in model.modules() if isinstance(m, QUANTIZED)]


def test_float_gguf_equals_transformers_gguf_loader(files):
    llm = LLM(str(files["f32"]), num_kv_blocks=32)
    assert llm.llm_engine.model_name == str(files["f32"])
    _check_greedy(llm, _hf_gguf(files["f32"]), atol=1e-4)


def test_dequantized_gguf_equals_transformers_gguf_loader(files):
    llm = LLM(str(files["mixed"]), num_kv_blocks=32, gguf_dequantize=True)
    assert not _quantized_kernels(llm.llm_engine.runner.model)
    _check_greedy(llm, _hf_gguf(files["mixed"]), atol=1e-4)


def test_kept_types_map_to_their_schemes_with_the_files_values(files):
    ckpt = GGUFCheckpoint(files["mixed"])
    hf = dict(_hf_gguf(files["mixed"]).named_parameters())
    for name, _ in ckpt.weights():
        if name in ckpt.prequantized:  # Q4_0, Q4_1, Q8_0: the file's values exactly
            torch.testing.assert_close(ckpt.prequantized[name].dequantize(), hf[name], atol=0, rtol=0)  # fmt: skip
    kinds = {n.split(".")[-2]: scheme_of(w) for n, w in ckpt.prequantized.items()}
    assert kinds == {  # Q4_0 scale-only, its 18 bytes a block kept; Q4_1 with its mins
        "q_proj": "int4_sym", "k_proj": "int4_sym", "v_proj": "int4_sym",
        "gate_proj": "int4", "up_proj": "int4", "down_proj": "int8",
    }  # fmt: skip


def test_kept_quantized_gguf_equals_transformers_gguf_loader(files):
    """Kept quantized, the kernels multiply float activations by the file's values:
    transformers' dequantized load of the same file is the reference as it is."""
    llm = LLM(str(files["mixed"]), num_kv_blocks=32, activation_quantization=None)
    layer = llm.llm_engine.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.kernel, PackedInt4)
    assert isinstance(layer.mlp.gate_up_proj.kernel, PackedInt4)
    assert isinstance(layer.mlp.down_proj.kernel, PackedInt8)
    assert not isinstance(layer.self_attn.o_proj.kernel, QUANTIZED)  # F32 in the file
    _check_greedy(llm, _hf_gguf(files["mixed"]), atol=1e-4)


def test_kept_quantized_gguf_on_int8_activations(files):
    """By default the file's int4 and int8 matrices run the integer kernels, on the file's
    values: transformers with those matrices' inputs rounded as the kernels round them."""
    llm = LLM(str(files["mixed"]), num_kv_blocks=32)
    layer = llm.llm_engine.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.kernel, PackedW4A8)
    assert layer.self_attn.qkv_proj.kernel.shifts is None  # Q4_0: scales only
    assert layer.mlp.gate_up_proj.kernel.shifts is not None  # Q4_1: its mins
    assert isinstance(layer.mlp.down_proj.kernel, PackedW8A8)
    hf = _hf_gguf(files["mixed"])
    rounded = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")  # not F32 o_proj
    for name, module in hf.named_modules():
        if name.rpartition(".")[2] in rounded:
            module.register_forward_pre_hook(lambda _, args: (rounded_activations(args[0]),))
    _check_greedy(llm, hf, atol=LOGPROB_ATOL_INT8_ACTIVATIONS)


def test_block_types_are_kept_with_the_files_values(files):
    ckpt = GGUFCheckpoint(files["blocks"])
    hf = dict(_hf_gguf(files["blocks"]).named_parameters())
    for name, _ in ckpt.weights():
        if name in ckpt.prequantized:
            torch.testing.assert_close(ckpt.prequantized[name].dequantize(), hf[name], atol=0, rtol=0)  # fmt: skip
    kinds = {n.split(".")[-2]: scheme_of(w) for n, w in ckpt.prequantized.items()}
    assert kinds == {
        "q_proj": "q5_0", "k_proj": "q5_0", "v_proj": "int8", "o_proj": "q5_1",
        "gate_proj": "q5_1", "up_proj": "q5_1", "down_proj": "q5_0",
    }  # fmt: skip


def test_kept_block_types_equal_transformers_gguf_loader(files):
    """On float activations the file's 5-bit types and a q/k/v fused from two types multiply
    by exactly the file's values: transformers' dequantized load is the reference."""
    llm = LLM(str(files["blocks"]), num_kv_blocks=32, activation_quantization=None)
    layer = llm.llm_engine.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.kernel, Stacked)
    parts = [type(k) for k in layer.self_attn.qkv_proj.kernel.parts]
    assert parts == [PackedBlock, PackedBlock, PackedInt8]
    _check_greedy(llm, _hf_gguf(files["blocks"]), atol=1e-4)


def test_kept_block_types_on_int8_activations(files):
    """By default the block types run ``cpu_klinear``'s integer kernel on the file's values:
    transformers with every quantized matrix's input rounded as the kernels round it."""
    llm = LLM(str(files["blocks"]), num_kv_blocks=32)
    layer = llm.llm_engine.runner.model.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj.kernel, PackedBlock)
    assert layer.mlp.gate_up_proj.kernel.int8
    hf = _hf_gguf(files["blocks"])
    rounded = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name, module in hf.named_modules():
        if name.rpartition(".")[2] in rounded:
            module.register_forward_pre_hook(lambda _, args: (rounded_activations(args[0]),))
    _check_greedy(llm, hf, atol=LOGPROB_ATOL_INT8_ACTIVATIONS)


def test_quantization_flag_overrides_the_files_types(files):
    llm = LLM(str(files["mixed"]), num_kv_blocks=16, quantization="int8")
    layer = llm.llm_engine.runner.model.model.layers[0]
    assert all(
        isinstance(m.kernel, PackedW8A8)
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj)
    )


def test_tokenizer_and_chat_template_come_from_the_file(files):
    tok, ref = gguf_tokenizer(files["f32"]), builtin_tokenizer()
    text = "hello world, the system <|im_end|> data ünï"
    assert tok(text).input_ids == ref(text).input_ids
    assert tok.chat_template == ref.chat_template
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(
        chat, tokenize=False
    )


def test_bad_files_get_typed_errors(files, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "missing.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        GGUFCheckpoint(junk)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(files["f32"].read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        GGUFCheckpoint(cut)
    folder = make_checkpoint("mistral", tmp_path / "ckpt")
    other = write_gguf(folder, tmp_path / "gpt2.gguf", architecture="gpt2")
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2'"):
        GGUFCheckpoint(other)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_gguf_equals_the_checkpoint_it_was_written_from(tmp_path, arch):
    """Qwen files keep HF's q/k row order; biases (qwen2) and q/k norms (qwen3) load by name.
    The reference is transformers on the safetensors checkpoint (its GGUF loader ignores
    qwen3's head_dim)."""
    folder = make_checkpoint(arch, tmp_path / arch)
    path = write_gguf(folder, tmp_path / f"{arch}.gguf", MIXED)
    llm = LLM(str(path), num_kv_blocks=32, gguf_dequantize=True)
    assert llm.llm_engine.runner.model_config.architecture.lower().startswith(arch)
    hf = load_hf_model(folder)
    with torch.no_grad():  # the reference holds the file's (dequantized) linear weights
        for layer in hf.model.layers:
            for block, name in (("self_attn", "q_proj"), ("self_attn", "k_proj"),
                                ("self_attn", "v_proj"), ("mlp", "gate_proj"),
                                ("mlp", "up_proj"), ("mlp", "down_proj")):  # fmt: skip
                w = getattr(getattr(layer, block), name).weight
                kind = MIXED[{"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
                              "gate_proj": "ffn_gate", "up_proj": "ffn_up",
                              "down_proj": "ffn_down"}[name]]  # fmt: skip
                w.copy_(torch.from_numpy(dequantize(quantize(w.numpy(), kind), kind)))
    _check_greedy(llm, hf, atol=1e-4)
    kept = LLM(str(path), num_kv_blocks=16).llm_engine.runner.model.model.layers[0]
    assert isinstance(kept.self_attn.qkv_proj.kernel, PackedW4A8)


def test_serve_a_gguf_file_over_http(tmp_path):
    """``prefixserve serve model.gguf --quantization int8``: chat answers with the file's chat
    template, and the model is listed under the file's path."""
    import httpx
    from servers import server_process

    folder = make_checkpoint("mistral", tmp_path / "ckpt", max_position_embeddings=1024)
    path = write_gguf(folder, tmp_path / "served.gguf", MIXED)
    with server_process(str(path), "--quantization", "int8") as (_, base):
        models = httpx.get(f"{base}/v1/models").json()["data"]
        assert [m["id"] for m in models] == [str(path)]
        body = {"model": str(path), "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": "hello"}]}  # fmt: skip
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
