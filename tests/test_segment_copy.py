"""Moving reused K/V to new positions (``prefixserve.runner.segment_copy``): keys computed at
position p and moved to p' equal the same pre-rope keys rotated at p' directly, within 1e-5, in
every layer, for each rope type the models have (default, linear, llama3, yarn); values move
unchanged; and in a real model's first layer (whose keys depend on the token alone) a document's
keys computed at one place and moved equal those computed at the other."""

from __future__ import annotations

import pytest
import torch
from checkpoints import make_checkpoint

from prefixserve import LLM, SamplingParams
from prefixserve.kv.hashing import extend_block_hashes
from prefixserve.kv.segments import SegmentCopy
from prefixserve.models.config import ModelConfig
from prefixserve.models.llama import RotaryEmbedding, apply_rope
from prefixserve.runner.segment_copy import copy_segments

ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
}  # fmt: skip


def config_with(rope: dict | None, head_dim: int = 32) -> ModelConfig:
    d = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": head_dim, "intermediate_size": 64,
         "num_hidden_layers": 3, "vocab_size": 100, "max_position_embeddings": 4096,
         "rope_theta": 10000.0}  # fmt: skip
    if rope is not None:
        d["rope_scaling"] = rope
    return ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize("rope", list(ROPES))
def test_moved_keys_equal_keys_rotated_at_the_new_positions(rope):
    config = config_with(ROPES[rope])
    table = RotaryEmbedding(config)
    layers, heads, dim, bs, blocks = 3, 2, config.head_dim, 4, 64
    kv = torch.zeros(layers, 2, blocks, bs, heads, dim)
    flat = kv.view(layers, 2, blocks * bs, heads, dim)
    torch.manual_seed(0)
    pre = torch.randn(layers, 20, heads, dim)  # the keys before rope, one per token and layer
    values = torch.randn(layers, 20, heads, dim)
    src_pos, dst_pos = torch.arange(1500, 1520), torch.arange(37, 57)  # moved 1463 back
    src, dst = list(range(8, 28)), list(range(100, 120))
    for layer in range(layers):
        flat[layer, 0, src] = apply_rope(pre[layer], table(src_pos))
        flat[layer, 1, src] = values[layer]
    copy_segments(kv, [SegmentCopy(src, dst, 1500, 37)], table.cos, table.sin)
    for layer in range(layers):
        direct = apply_rope(pre[layer], table(dst_pos))
        assert torch.allclose(flat[layer, 0, dst], direct, atol=1e-5, rtol=0)
        assert torch.equal(flat[layer, 1, dst], values[layer])
    for layer in range(layers):  # the sources are left as they were
        assert torch.equal(flat[layer, 1, src], values[layer])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_real_models_first_layer_keys_move_exactly(tmp_path, arch):
    """Layer 0's keys depend on each token alone, so a document's keys computed after 40 other
    tokens and moved 29 places on equal those computed after 11 (every later layer also reads
    the context, so only the first can be compared this way)."""
    folder = make_checkpoint(arch, tmp_path / arch, seed=1)
    llm = LLM(str(folder), block_size=4, num_kv_blocks=64, max_model_len=256)
    engine = llm.llm_engine
    doc = list(range(20, 44))
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def doc_slots(prompt: list[int]) -> tuple[list[int], int]:
        llm.generate([prompt], params, use_tqdm=False)
        start = prompt.index(doc[0])
        block_hashes: list[int] = []
        extend_block_hashes(prompt, 4, (), block_hashes)
        pool = engine.scheduler.kv.pool
        slots = [pool.hashed_block(block_hashes[p // 4]).block_id * 4 + p % 4
                 for p in range(start, start + 20)]  # fmt: skip
        return slots, start

    far, far_start = doc_slots([5] * 40 + doc)
    near, near_start = doc_slots([6] * 11 + doc + [7])
    kv = engine.runner.kv_caches
    flat = kv.view(kv.shape[0], 2, -1, *kv.shape[-2:])
    expected = flat[0, 0, near].clone()
    rope = engine.runner.model.model.rotary_emb
    scratch = list(range(50 * 4, 50 * 4 + 20))  # blocks no prompt used
    copy_segments(kv, [SegmentCopy(far, scratch, far_start, near_start)], rope.cos, rope.sin)
    assert torch.allclose(flat[0, 0, scratch], expected, atol=1e-5, rtol=0)
    assert not torch.allclose(flat[0, 0, far], expected, atol=1e-3)  # they did need moving
