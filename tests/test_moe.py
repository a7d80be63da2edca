"""Qwen3-MoE: the router and expert block against transformers' modules, which layers are sparse,
expert weight loading and its errors, and forked / preempted sampling on a MoE checkpoint.

Greedy tokens and logprobs against transformers, with prefix caching, chunking and preemption,
run in test_models.py, test_engine.py and test_forks.py (``qwen3_moe`` in their arch lists)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from checkpoints import greedy_logprob_error, load_hf_model, make_checkpoint
from quant_reference import (
    LOGPROB_ATOL_INT8_ACTIVATIONS,
    dequantized_reference,
    int8_activations,
)
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_moe

from prefixserve import LLM, SamplingParams
from prefixserve.attention.torch_backend import TorchAttentionBackend
from prefixserve.core.errors import ModelLoadError
from prefixserve.models import ModelConfig, load_model
from prefixserve.models import moe as moe_module
from prefixserve.models.llama import MLP, LlamaForCausalLM
from prefixserve.models.moe import SparseMoeBlock, map_expert_name, select_experts

CPU = torch.device("cpu")


def _hf_config(**kw) -> transformers.Qwen3MoeConfig:
    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=3,
        max_position_embeddings=64,
    )
    return transformers.Qwen3MoeConfig(**{**base, **kw})


def _config_dict(hf: transformers.Qwen3MoeConfig) -> dict:
    """What ``save_pretrained`` writes as config.json for a Qwen3MoeForCausalLM."""
    return {**json.loads(hf.to_json_string()), "architectures": ["Qwen3MoeForCausalLM"]}


@pytest.mark.parametrize("renormalize", [False, True])
def test_select_experts_matches_transformers_router(renormalize):
    hf_config = _hf_config(norm_topk_prob=renormalize)
    router = hf_moe.Qwen3MoeTopKRouter(hf_config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    x = torch.randn(20, hf_config.hidden_size, generator=gen)
    logits, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(logits, hf_config.num_experts_per_tok, renormalize)
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights, hf_weights)
    sums = weights.sum(-1)
    if renormalize:
        torch.testing.assert_close(sums, torch.ones_like(sums))
    else:
        assert (sums < 1).all()


@pytest.mark.parametrize(
    ("renormalize", "use_triton"), [(False, False), (True, False), (True, True)]
)
def test_sparse_block_matches_transformers_block(renormalize, use_triton):
    """The torch path and the fused-MoE kernel (interpreted on CPU) against transformers."""
    hf_config = _hf_config(norm_topk_prob=renormalize)
    hf_block = hf_moe.Qwen3MoeSparseMoeBlock(hf_config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf_block.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    moe = ModelConfig.from_hf_dict(_config_dict(hf_config)).moe
    block = SparseMoeBlock(moe, hf_config.hidden_size, use_triton=use_triton)
    block.load_state_dict(hf_block.state_dict())  # the stacked layout is transformers' own
    x = torch.randn(1, 33, hf_config.hidden_size, generator=gen)
    with torch.no_grad():
        expected = hf_block(x)[0]
    tol = 1e-5 if use_triton else 1e-6
    torch.testing.assert_close(block(x[0]), expected, atol=tol, rtol=tol)
    assert block(x[0, :0]).shape == (0, hf_config.hidden_size)  # no rows (a step keeping none)


def test_the_torch_path_runs_as_one_op_in_eager_and_compiled_steps():
    """``prefixserve::grouped_moe(x, block)`` is the block's grouped path, named by its registry
    id (eager and compiled steps call the same op); its fake gives the shape for a graph, and a
    block that is gone leaves the registry."""
    hf_config = _hf_config(norm_topk_prob=True)
    moe = ModelConfig.from_hf_dict(_config_dict(hf_config)).moe
    block = SparseMoeBlock(moe, hf_config.hidden_size, use_triton=False)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    x = torch.randn(9, hf_config.hidden_size, generator=gen)
    with torch.no_grad():
        assert torch.equal(torch.ops.prefixserve.grouped_moe(x, block.block_id), block.grouped(x))
        assert torch.equal(block(x), block.grouped(x))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert torch.ops.prefixserve.grouped_moe(torch.empty(4, 7), block.block_id).shape == (4, 7)
    block_id = block.block_id
    del block
    assert block_id not in moe_module._BLOCKS


@pytest.mark.parametrize(
    ("step", "mlp_only"), [(1, []), (2, []), (1, [0, 3]), (3, [2]), (2, [1, 3])]
)
def test_sparse_layers_are_the_ones_transformers_builds(step, mlp_only):
    hf_config = _hf_config(decoder_sparse_step=step, mlp_only_layers=mlp_only)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    hf_sparse = [
        i
        for i, layer in enumerate(hf.model.layers)
        if isinstance(layer.mlp, hf_moe.Qwen3MoeSparseMoeBlock)
    ]
    config = ModelConfig.from_hf_dict(_config_dict(hf_config))
    assert config.moe is not None and list(config.moe.layers) == hf_sparse
    with torch.device("meta"):
        model = LlamaForCausalLM(config, TorchAttentionBackend())
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [SparseMoeBlock if i in hf_sparse else MLP for i in range(4)]


def test_moe_config_reads_both_expert_count_keys_and_rejects_bad_fields():
    d = _config_dict(_hf_config())
    d.pop("num_local_experts", None)
    hub = ModelConfig.from_hf_dict({**d, "num_experts": 8})  # how Hub checkpoints spell it
    written = ModelConfig.from_hf_dict({**d, "num_local_experts": 8})  # transformers v5
    assert hub == written and hub.moe.num_experts == 8 and hub.qk_norm
    assert ModelConfig.from_hf_dict({**d, "num_experts": 0}).moe is None  # all layers dense
    with pytest.raises(ModelLoadError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict({**d, "num_experts": 2})  # top 3 of 2
    with pytest.raises(ModelLoadError, match="decoder_sparse_step"):
        ModelConfig.from_hf_dict({**d, "num_experts": 8, "decoder_sparse_step": 0})


def test_map_expert_name():
    base = "model.layers.3.mlp.experts"
    assert map_expert_name(f"{base}.5.gate_proj.weight") == (f"{base}.gate_up_proj", (5, 0))
    assert map_expert_name(f"{base}.5.up_proj.weight") == (f"{base}.gate_up_proj", (5, 1))
    assert map_expert_name(f"{base}.12.down_proj.weight") == (f"{base}.down_proj", (12, 0))
    for other in (
        "model.layers.3.mlp.gate_proj.weight",  # a dense layer's MLP
        "model.layers.3.mlp.gate.weight",  # the router
        f"{base}.gate_up_proj",  # already stacked
    ):
        assert map_expert_name(other) is None


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), seed=2)


def _load(folder):
    return load_model(str(folder), device=CPU, attn_backend=TorchAttentionBackend())[0]


def _rewrite(src, dst, edit) -> None:
    """Copy checkpoint ``src`` into ``dst`` with its tensors passed through ``edit``."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(edit(load_file(src / "model.safetensors")), dst / "model.safetensors")


def test_stacked_expert_checkpoint_loads_the_same(moe_folder, tmp_path):
    """A checkpoint holding ``experts.gate_up_proj [E, 2I, H]`` (transformers' in-memory layout)
    loads into the same parameters as the per-expert one."""

    def stack(tensors):
        out = {}
        for layer in (0, 2):
            p = f"model.layers.{layer}.mlp.experts"
            experts = range(8)
            gate = [tensors.pop(f"{p}.{e}.gate_proj.weight") for e in experts]
            up = [tensors.pop(f"{p}.{e}.up_proj.weight") for e in experts]
            down = [tensors.pop(f"{p}.{e}.down_proj.weight") for e in experts]
            out[f"{p}.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(gate, up)])
            out[f"{p}.down_proj"] = torch.stack(down)
        return {**tensors, **out}

    _rewrite(moe_folder, tmp_path / "stacked", stack)
    per_expert, stacked = _load(moe_folder).state_dict(), _load(tmp_path / "stacked").state_dict()
    assert per_expert.keys() == stacked.keys()
    for name, a in per_expert.items():
        assert torch.equal(a, stacked[name]), name


@pytest.mark.parametrize(
    ("drop", "add", "error"),
    [
        ("model.layers.2.mlp.experts.7.up_proj.weight", None, "lacks weights"),
        ("model.layers.0.mlp.gate.weight", None, "lacks weights"),
        (None, "model.layers.0.mlp.experts.8.gate_proj.weight", "expert 8"),
    ],
    ids=["missing-expert-shard", "missing-router", "expert-past-E"],
)
def test_bad_expert_checkpoints_raise(moe_folder, tmp_path, drop, add, error):
    def edit(tensors):
        tensors.pop(drop, None)
        if add is not None:
            tensors[add] = torch.zeros(32, 64)
        return tensors

    _rewrite(moe_folder, tmp_path / "bad", edit)
    with pytest.raises(ModelLoadError, match=error):
        _load(tmp_path / "bad")


def test_forked_and_preempted_sampling_on_moe(moe_folder):
    """n>1 seeded samples are the same with a roomy cache and one so tight that sequences are
    preempted (recomputed through the experts); the first sample is the n=1 request's."""
    prompts = [list(range(i, i + 20)) for i in range(0, 60, 10)]
    params = SamplingParams(n=3, max_tokens=12, temperature=0.9, seed=5, ignore_eos=True)
    roomy = LLM(str(moe_folder), num_kv_blocks=256, block_size=8)
    ref = roomy.generate(prompts, params, use_tqdm=False)
    tight = LLM(str(moe_folder), num_kv_blocks=24, block_size=8)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.stats().num_preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in outs] == [
        [c.token_ids for c in o.outputs] for o in ref
    ]
    assert len({tuple(c.token_ids) for c in ref[0].outputs}) > 1  # the samples differ
    single = roomy.generate(
        prompts[:1], SamplingParams(n=1, max_tokens=12, temperature=0.9, seed=5), use_tqdm=False
    )
    assert single[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert tight.cache_stats()["used_blocks"] == 0


@pytest.mark.parametrize("activations", ["int8", None])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_experts_equal_transformers_on_their_dequantized_weights(
    moe_folder, method, activations
):
    """``--quantization`` reaches the experts (one kernel per expert matrix, on int8 or float
    activations) and the model still matches transformers run on the same dequantized weights
    (and the same rounded activations: ``quant_reference``)."""
    llm = LLM(str(moe_folder), num_kv_blocks=64, quantization=method,
              activation_quantization=activations)  # fmt: skip
    block = llm.llm_engine.runner.model.model.layers[0].mlp
    assert block.experts.gate_up_proj is None and len(block.experts.kernels_gate_up) == 8
    kernel = f"PackedW{method[-1]}A8" if activations else f"PackedInt{method[-1]}"
    assert type(block.experts.kernels_down[0]).__name__ == kernel
    hf = dequantized_reference(load_hf_model(moe_folder), method)
    if activations:
        hf = int8_activations(hf)
    prompts = [list(range(5, 30)), [7, 1, 99, 42]]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
    worst = greedy_logprob_error(llm, hf, prompts, params)
    assert worst < (1e-4 if activations is None else LOGPROB_ATOL_INT8_ACTIVATIONS), worst
