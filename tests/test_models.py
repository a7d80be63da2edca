"""The Llama-family model against transformers, the loader's paths and errors, the built-in model."""

from __future__ import annotations

import dataclasses
import json

import huggingface_hub.constants
import pytest
import torch
from attn_utils import BlockAllocator, build_attn_metadata, forward, new_kv_caches, run_step
from checkpoints import ARCHS, hf_logits, load_hf_model, make_checkpoint

from prefixserve.attention.metadata import SeqSpan, build_attention_metadata
from prefixserve.attention.torch_backend import TorchAttentionBackend
from prefixserve.core.errors import ModelLoadError, UnsupportedModelError
from prefixserve.models import (
    BUILTIN_MODEL_NAME,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    builtin_model_config,
    builtin_tokenizer,
    load_model,
    load_tokenizer,
)
from prefixserve.models.builtin import builtin_weights

BS = 16
ATOL = 1e-4
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (folder, transformers model, our model, config)."""
    out = {}
    for arch in ARCHS:
        folder = make_checkpoint(arch, tmp_path_factory.mktemp(arch))
        model, config, _ = load_model(str(folder), device=CPU, attn_backend=TorchAttentionBackend())
        out[arch] = (folder, load_hf_model(folder), model, config)
    return out


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_prefill_matches_transformers(checkpoints, arch):
    _, hf, model, config = checkpoints[arch]
    prompts = [_prompt(n, n, config.vocab_size) for n in (1, 15, 16, 17, 33)]
    alloc, kv = BlockAllocator(32), new_kv_caches(config, 32, BS)
    tables = [alloc.grow([], len(p), BS) for p in prompts]
    outs = run_step(model, kv, [(p, 0, len(p)) for p in prompts], tables, BS)
    for p, out in zip(prompts, outs):
        torch.testing.assert_close(out, hf_logits(hf, p), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_then_decode_matches_transformers(checkpoints, arch):
    _, hf, model, config = checkpoints[arch]
    ids = _prompt(37, 1, config.vocab_size)
    alloc, kv = BlockAllocator(16), new_kv_caches(config, 16, BS)
    table = alloc.grow([], 45, BS)
    first = run_step(model, kv, [(ids, 0, 20)], [table], BS)[0]
    second = run_step(model, kv, [(ids, 20, 17)], [table], BS)[0]
    torch.testing.assert_close(torch.cat([first, second]), hf_logits(hf, ids), atol=ATOL, rtol=0)
    for _ in range(4):
        ids.append(int(second[-1].argmax()))
        second = run_step(model, kv, [(ids, len(ids) - 1, 1)], [table], BS)[0]
        torch.testing.assert_close(second[0], hf_logits(hf, ids)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_matches_separate_runs(checkpoints, arch):
    """Decodes first, then prefill chunks (one fresh, one continuing a cached prefix)."""
    _, hf, model, config = checkpoints[arch]
    seqs = [_prompt(n, 100 + n, config.vocab_size) for n in (18, 6, 9, 26)]
    cached = [17, 5, 0, 16]
    alloc, kv = BlockAllocator(32), new_kv_caches(config, 32, BS)
    tables = [alloc.grow([], len(s), BS) for s in seqs]
    warm = [i for i, c in enumerate(cached) if c]
    run_step(model, kv, [(seqs[i], 0, cached[i]) for i in warm], [tables[i] for i in warm], BS)
    batch = [(s, c, len(s) - c) for s, c in zip(seqs, cached)]
    outs = run_step(model, kv, batch, tables, BS)
    for s, c, out in zip(seqs, cached, outs):
        torch.testing.assert_close(out, hf_logits(hf, s)[c:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_last_layer_runs_only_for_sampling_rows(checkpoints, arch):
    """With ``keep``, the sampling rows get the hidden states of the full forward and the cache
    gets the same K/V; with no sampling row, the forward only writes K/V."""
    _, _, model, config = checkpoints[arch]
    backend = model.model.layers[0].self_attn.backend
    seqs = [_prompt(n, 200 + n, config.vocab_size) for n in (18, 6, 30, 40)]
    cached, new = [17, 5, 0, 10], [1, 1, 30, 20]  # two decodes, a whole prompt, a middle chunk
    sampling = [0, 1, 2]  # the middle chunk (tokens 10..29 of 40) samples nothing
    alloc, kv = BlockAllocator(32), new_kv_caches(config, 32, BS)
    tables = [alloc.grow([], len(s), BS) for s in seqs]
    warm = [i for i, c in enumerate(cached) if c]
    run_step(model, kv, [(seqs[i], 0, cached[i]) for i in warm], [tables[i] for i in warm], BS)
    positions, md = build_attn_metadata(list(zip(cached, new)), tables, BS)
    ids = torch.tensor([t for s, c, n in zip(seqs, cached, new) for t in s[c : c + n]])
    full_kv = kv.clone()
    full = forward(model, ids, positions, full_kv, md)
    rows = md.query_start_loc[1:][sampling].long() - 1
    for keep_seqs, keep_rows in ((sampling, rows), ([], rows[:0])):
        pruned_kv = kv.clone()
        row_spans = [SeqSpan(tables[i], cached[i] + new[i] - 1, 1) for i in keep_seqs]
        md_rows = build_attention_metadata(row_spans, BS, "cpu")[1] if row_spans else None
        rows_step = backend.plan(md_rows, kv[0]) if md_rows is not None else None
        step_md = dataclasses.replace(md, backend_plan=None)
        pruned = forward(model, ids, positions, pruned_kv, step_md, (keep_rows, rows_step))
        torch.testing.assert_close(pruned, full[keep_rows], atol=1e-5, rtol=0)
        torch.testing.assert_close(pruned_kv, full_kv, atol=1e-5, rtol=0)


def test_sharded_checkpoint_loads(checkpoints, tmp_path):
    folder = make_checkpoint("llama", tmp_path, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 1
    sharded, _, _ = load_model(str(folder), device=CPU, attn_backend=TorchAttentionBackend())
    whole = checkpoints["llama"][2]
    whole_state = whole.state_dict()
    for name, a in sharded.state_dict().items():
        assert torch.equal(a, whole_state[name]), name


def test_config_reads_transformers_4_and_5_layouts():
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 64,
    }
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    v4 = ModelConfig.from_hf_dict(
        {
            **base,
            "rope_theta": 5e5,
            "rope_scaling": {"type": "llama3", **scaling},
            "torch_dtype": "bfloat16",
            "eos_token_id": 3,
        }
    )
    v5 = ModelConfig.from_hf_dict(
        {
            **base,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling},
            "dtype": "bfloat16",
            "eos_token_id": [3],
        }
    )
    assert v4 == v5
    assert v4.rope_theta == 5e5 and v4.rope_scaling["rope_type"] == "llama3"
    assert v4.dtype == torch.bfloat16 and v4.eos_token_ids == [3]
    assert v4.num_key_value_heads == 2 and v4.head_dim == 4
    with pytest.raises(UnsupportedModelError, match="longrope"):
        ModelConfig.from_hf_dict({**base, "rope_scaling": {"rope_type": "longrope"}})
    with pytest.raises(UnsupportedModelError, match="silu"):
        ModelConfig.from_hf_dict({**base, "hidden_act": "gelu"})


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError) as e:
        load_model(str(tmp_path), device=CPU, attn_backend=TorchAttentionBackend())
    assert all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)


def test_pickle_only_folder_is_refused(checkpoints, tmp_path):
    (tmp_path / "config.json").write_text((checkpoints["llama"][0] / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(tmp_path), device=CPU, attn_backend=TorchAttentionBackend())


def test_missing_and_unexpected_weights_are_errors(checkpoints):
    model = checkpoints["qwen3"][2]
    weights = dict(model.named_parameters())
    del weights["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(ModelLoadError, match="k_norm"):
        model.load_weights(weights.items())
    with pytest.raises(ModelLoadError, match="extra"):
        model.load_weights([("model.extra.weight", torch.zeros(1))])


def test_unknown_hub_id_offline_names_the_model(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    name = "prefixserve-tests/does-not-exist"
    with pytest.raises(ModelLoadError, match=name) as e:
        load_model(name, device=CPU, attn_backend=TorchAttentionBackend())
    assert "neither a local folder nor downloadable" in str(e.value)


def test_checkpoint_tokenizer_loads_with_chat_template(checkpoints):
    tok = load_tokenizer(str(checkpoints["qwen2"][0]))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == builtin_tokenizer().apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False
    )


def test_builtin_model_is_deterministic():
    a, b = builtin_weights(), builtin_weights()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model, config, name = load_model(None, device=CPU, attn_backend=TorchAttentionBackend())
    assert name == BUILTIN_MODEL_NAME and config == builtin_model_config()
    ids = list(range(40))
    kv = new_kv_caches(config, 4, BS)
    logits = run_step(model, kv, [(ids, 0, 40)], [[0, 1, 2]], BS)[0]
    assert torch.isfinite(logits).all() and logits.std() > 1.0


def test_builtin_tokenizer_round_trips_and_chats():
    tok, config = builtin_tokenizer(), builtin_model_config()
    assert len(tok) == config.vocab_size
    assert tok.convert_ids_to_tokens(config.eos_token_ids) == ["<|end_of_text|>", "<|im_end|>"]
    assert tok.bos_token_id == config.bos_token_id
    text = "Hello, world! héllo 日本語 <tool_call>{}</tool_call>\n\ttabs"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and len(ids) < len(text.encode())
    assert tok.decode(ids, skip_special_tokens=True) == text
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 6*7?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calc", "arguments": {"x": 1}}}
            ],
        },
        {"role": "tool", "content": "42"},
    ]
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    chat = tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert chat.startswith("<|begin_of_text|><|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "calc"' in chat
    assert '<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call><|im_end|>\n' in chat
    assert chat.endswith("<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
