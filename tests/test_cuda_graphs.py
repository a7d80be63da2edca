"""CUDA graphs for decode steps (``prefixserve.runner.cuda_graphs``).

On CPU there are no graphs: ``CUDAGraphRunner.capture`` records the static-buffer forward itself,
so the padding logic (slot -1 and seq_len 0 for padded rows, block tables in a fixed-width
buffer, split counts fixed by ``max_model_len``) is checked here against the eager forward with
the interpreted Triton kernels. The engine-level tests need a GPU (marked ``gpu``).
"""

from __future__ import annotations

import pytest
import torch
from attn_utils import BlockAllocator, forward
from checkpoints import make_checkpoint

pytest.importorskip("triton")

from prefixserve import LLM, SamplingParams
from prefixserve.attention.metadata import SeqSpan, build_attention_metadata
from prefixserve.attention.triton_backend import TritonAttentionBackend
from prefixserve.models.loader import load_model
from prefixserve.runner.cuda_graphs import CUDAGraphRunner, capture_sizes

BLOCK = 8


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[-3:] == [240, 248, 256] and len(capture_sizes(256)) == 35
    assert capture_sizes(4096)[-1] == 512


class Engineless:
    """A tiny qwen3 (or qwen3_moe) on the Triton backend with its paged cache, driven step by step."""

    def __init__(self, folder) -> None:
        self.backend = TritonAttentionBackend("cpu")
        self.model, mc, _ = load_model(
            str(folder), dtype="float32", device=torch.device("cpu"), attn_backend=self.backend
        )
        shape = (mc.num_hidden_layers, 2, 96, BLOCK, mc.num_key_value_heads, mc.head_dim)
        self.kv = torch.zeros(shape)
        self.alloc = BlockAllocator(96, seed=1)
        gen = torch.Generator().manual_seed(0)
        self.vocab = mc.vocab_size
        self.ids = lambda n: torch.randint(0, self.vocab, (n,), generator=gen)

    def step(self, spans: list[SeqSpan], kv: torch.Tensor) -> torch.Tensor:
        positions, md = build_attention_metadata(spans, BLOCK, "cpu")
        return forward(self.model, self.ids(len(positions)), positions, kv, md)

    def prefill(self, lens: list[int], shared: list[int] | None = None) -> list[list[int]]:
        """Prompts of ``lens`` tokens written to the cache; the first ``len(shared)`` blocks of
        each table are ``shared`` (already written), when given."""
        tables, spans = [], []
        for n in lens:
            head = list(shared or [])
            tables.append(self.alloc.grow(head, n + 1, BLOCK))  # room for one decode
            spans.append(SeqSpan(tables[-1], len(head) * BLOCK, n - len(head) * BLOCK))
        self.step(spans, self.kv)
        return tables


@pytest.fixture(params=["qwen3", "qwen3_moe"])  # qwen3_moe: the fused-MoE kernel in the graph
def engineless(request, tmp_path):
    return Engineless(make_checkpoint(request.param, tmp_path / request.param))


def test_first_decodes_views_the_leading_decode_rows():
    spans = [SeqSpan([3, 4], 9, 1), SeqSpan([5], 2, 1), SeqSpan([6, 7], 4, 5)]
    _, md = build_attention_metadata(spans, BLOCK, "cpu")
    head = md.first_decodes(2)
    assert head.num_seqs == head.num_decodes == head.num_decode_tokens == 2
    assert head.seq_lens_cpu == [10, 3] and head.max_seq_len == 10 and head.max_query_len == 1
    assert head.query_lens_cpu == [1, 1] and head.prefix_groups == []
    assert head.slot_mapping.data_ptr() == md.slot_mapping.data_ptr()  # views, not copies
    assert torch.equal(head.block_tables, md.block_tables[:2])
    assert head.query_start_loc.tolist() == [0, 1, 2]
    with pytest.raises(AssertionError):
        md.first_decodes(3)  # the third row is a prefill chunk


@torch.inference_mode()
def test_static_metadata_comes_from_the_builder_at_max_model_len(engineless):
    runner = CUDAGraphRunner(
        engineless.model, engineless.backend, [1, 2, 4], max_model_len=100, block_size=BLOCK
    )
    md = runner.metadata
    assert md.seq_lens_cpu == [100] * 4 and md.max_seq_len == 100 and md.num_decodes == 4
    assert md.block_tables.shape == (4, 13)  # ceil(100 / 8) blocks: any table fits
    assert (md.slot_mapping == -1).all()  # padding rows write nothing ...
    assert (md.seq_lens == 0).all()  # ... and read nothing
    assert runner.positions.tolist() == [99] * 4  # valid positions for padding rows
    assert runner.metadata.first_decodes(2).max_seq_len == 100  # the split count any context takes


@torch.inference_mode()
def test_padded_replay_matches_eager(engineless):
    e = engineless
    lens = [10, 17, 24, 3, 40]
    tables = e.prefill(lens)
    runner = CUDAGraphRunner(e.model, e.backend, [1, 2, 4, 8], max_model_len=256, block_size=BLOCK)
    before = e.kv.clone()
    runner.capture(e.kv)  # warm-up and "capture" write nothing: every slot is -1
    assert torch.equal(e.kv, before)
    for n in (5, 3, 1):  # padded to 8 and 4 (rows 3, 4 held real slots); exact at 1
        spans = [SeqSpan(t, m, 1) for t, m in zip(tables[:n], lens)]
        positions, md = build_attention_metadata(spans, BLOCK, "cpu")
        ids = e.ids(n)
        eager_kv = e.kv.clone()
        eager = forward(e.model, ids, positions, eager_kv, md)
        _, md = build_attention_metadata(spans, BLOCK, "cpu")  # a fresh plan, as each step's
        before = e.kv.clone()
        replayed = runner.run(ids, positions, e.kv, md, e.backend.plan(md, e.kv[0]), None)
        assert replayed is not None and replayed.shape == eager.shape
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(e.kv, eager_kv, rtol=1e-5, atol=1e-5)
        written = torch.zeros(e.kv.shape[2] * BLOCK, dtype=torch.bool)
        written[md.slot_mapping] = True
        written = written.view(-1, BLOCK)  # (blocks, block_size): padded rows wrote nowhere
        assert torch.equal(e.kv[:, :, ~written], before[:, :, ~written])


@torch.inference_mode()
def test_steps_that_do_not_replay(engineless):
    """Mixed prefill steps, pruned last layers (``keep``), batches above the largest size and
    steps whose plan takes cascade run eagerly (``run`` returns None)."""
    e = engineless
    shared = e.alloc.grow([], 64, BLOCK)
    e.step([SeqSpan(shared + [e.alloc.free.pop()], 0, 70)], e.kv)
    tables = e.prefill([70, 75, 66], shared=shared)
    runner = CUDAGraphRunner(e.model, e.backend, [1, 2], max_model_len=256, block_size=BLOCK)
    runner.capture(e.kv)
    decodes = [SeqSpan(t, n, 1) for t, n in zip(tables, [70, 75, 66])]
    ids, kv = e.ids(3), e.kv.clone()

    def run(spans, keep=None):
        positions, md = build_attention_metadata(spans, BLOCK, "cpu")
        return runner.run(ids[: len(positions)], positions, kv, md, e.backend.plan(md, kv[0]), keep)

    assert run(decodes[:2], keep=(torch.tensor([0]), None)) is None
    assert run(decodes) is None  # 3 > the largest captured size
    mixed = [decodes[0], SeqSpan(tables[1], 70, 2)]
    assert run(mixed) is None
    _, md = build_attention_metadata(decodes[:2], BLOCK, "cpu")
    assert md.prefix_groups  # the two decodes share 8 blocks
    assert run(decodes[:2]) is not None  # cascade_pays declines at this size: the graph runs
    e.backend.cascade = True
    try:
        assert run(decodes[:2]) is None
    finally:
        e.backend.cascade = None


# ---- on a GPU: the engine with graphs against the engine without ---------------------------------


def _llm(folder, enforce_eager: bool, **kw) -> LLM:
    kw = {"block_size": 16, "num_kv_blocks": 256, "max_num_seqs": 16, **kw}
    return LLM(str(folder), attention_backend="triton", dtype="float32",
               enforce_eager=enforce_eager, **kw)  # fmt: skip


def _replays(llm: LLM, monkeypatch) -> list[int]:
    """Records the batch size of every decode step the engine replays from a graph."""
    graphs = llm.llm_engine.runner.decode_replay
    assert graphs is not None
    seen: list[int] = []
    real = graphs.run

    def spy(*args):
        hidden = real(*args)
        if hidden is not None:
            seen.append(hidden.shape[0])
        return hidden

    monkeypatch.setattr(graphs, "run", spy)
    return seen


def _prompts(n: int, seed: int, shared: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(0, 500, (shared,), generator=gen).tolist()
    return [head + torch.randint(0, 500, (5 + 7 * i % 40,), generator=gen).tolist()
            for i in range(n)]  # fmt: skip


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))


@pytest.mark.gpu
def test_graphs_give_the_eager_greedy_tokens(qwen3, monkeypatch):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = _prompts(12, seed=0)
    eager = _llm(qwen3, True)
    assert eager.llm_engine.runner.decode_replay is None
    ref = eager.generate(prompts, params, use_tqdm=False)
    llm = _llm(qwen3, False)
    replays = _replays(llm, monkeypatch)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert replays and max(replays) == 12


@pytest.mark.gpu
def test_moe_graphs_give_the_eager_greedy_tokens(tmp_path, monkeypatch):
    """Qwen3-MoE decode steps replay with the fused-MoE kernel (its expert alignment included)
    captured, padded batches too."""
    folder = make_checkpoint("qwen3_moe", tmp_path / "qwen3_moe")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = _prompts(11, seed=4)
    ref = _llm(folder, True).generate(prompts, params, use_tqdm=False)
    llm = _llm(folder, False)
    replays = _replays(llm, monkeypatch)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert 11 in replays


@pytest.mark.gpu
@pytest.mark.parametrize("num_prompts", [3, 5, 6, 9, 13])
def test_batch_sizes_between_captured_sizes(qwen3, monkeypatch, num_prompts):
    """Captured sizes 1, 2, 4, 8, 16: every batch here pads (or, at its tail, lands exactly)."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = _prompts(num_prompts, seed=num_prompts)
    ref = _llm(qwen3, True).generate(prompts, params, use_tqdm=False)
    llm = _llm(qwen3, False)
    replays = _replays(llm, monkeypatch)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert num_prompts in replays


@pytest.mark.gpu
def test_graphs_under_preemption_and_prefix_hits(qwen3, monkeypatch):
    """A tight KV pool preempts and recomputes (from the prefix cache) while decodes replay."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = _prompts(10, seed=3, shared=48)
    kw = {"num_kv_blocks": 40, "max_num_batched_tokens": 64}
    ref = _llm(qwen3, True, **kw).generate(prompts, params, use_tqdm=False)
    llm = _llm(qwen3, False, **kw)
    replays = _replays(llm, monkeypatch)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert llm.llm_engine.stats().num_preemptions > 0
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert replays
    assert llm.cache_stats()["used_blocks"] == 0


@pytest.mark.gpu
def test_cascade_steps_run_eagerly_under_graphs(qwen3, monkeypatch):
    """Where cascade pays (forced here), decode steps skip the graphs; tokens are unchanged."""
    from prefixserve.attention import triton_backend

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = _prompts(6, seed=4, shared=80)
    ref = _llm(qwen3, True).generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(triton_backend, "cascade_pays", lambda *_: True)
    llm = _llm(qwen3, False)
    replays = _replays(llm, monkeypatch)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert 6 not in replays  # the full batch shares the prefix: cascade, eagerly


def test_graphs_are_off_without_cuda_and_with_enforce_eager(qwen3):
    from prefixserve.core.config import EngineConfig
    from prefixserve.core.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="enforce_eager"):
        EngineConfig(enforce_eager="yes")
    llm = LLM(str(qwen3), attention_backend="triton", device="cpu", num_kv_blocks=16)
    replay = llm.llm_engine.runner.decode_replay  # graphs exist on CUDA only
    assert replay is None or replay.kind != "cuda_graphs"
    if torch.cuda.is_available():
        llm = LLM(str(qwen3), attention_backend="triton", enforce_eager=True, num_kv_blocks=16)
        assert llm.llm_engine.runner.decode_replay is None
