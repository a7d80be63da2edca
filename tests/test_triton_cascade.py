"""``TritonAttentionBackend`` with cascade decode against the torch reference backend.

Batches come from the engine's own metadata builder, so prefix groups are those the shared
planner finds: nested sharing (a preamble for all, documents within sets), GQA, suffixes that
end on and just past block boundaries, a group with a single decode (its other members are
prefill chunks, which keep the extend kernel), sequences in no group. On CPU the kernels run
through Triton's interpreter; shapes are tiny.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attn_utils import BlockAllocator, attend, build_attn_metadata

pytest.importorskip("triton")

from prefixserve.attention import triton_backend
from prefixserve.attention.torch_backend import TorchAttentionBackend
from prefixserve.attention.triton_backend import TritonAttentionBackend, cascade_decode_groups

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_KV_HEADS, HEAD_DIM = 2, 16
PREAMBLE = 64  # tokens shared by every grouped sequence (MIN_SHARED_PREFIX_TOKENS)


def nested_batch(block_size: int):
    """Decodes first, then prefill chunks; ``(seqs, tables)`` with ``seqs[i] = (cached, new)``.

    Sharing: sequences 0, 1, 5 (set A) and 2, 6, 7 (set B) start with the preamble and then
    their set's document (as long as the preamble, so the planner splits the preamble's group
    into one group per set); 3 shares the preamble alone; 4 and 8 share nothing.
    """
    doc = PREAMBLE
    alloc = BlockAllocator(256, seed=block_size)
    preamble = alloc.grow([], PREAMBLE, block_size)
    docs = {"A": alloc.grow([], doc, block_size), "B": alloc.grow([], doc, block_size)}
    shared = PREAMBLE + doc
    layout = [  # (prefix, cached tokens, new tokens)
        ("A", shared, 1),  # suffix = its own token (the first position after the shared part)
        ("A", shared + block_size - 1, 1),  # suffix ends on a block boundary
        ("B", shared + block_size, 1),  # one token past a block boundary
        ("P", PREAMBLE + 40, 1),
        ("", 19, 1),
        ("A", shared + 36, 1),
        ("B", shared + 3, 6),  # prefill chunks over the shared part
        ("B", shared, 9),
        ("", 0, 12),
    ]
    seqs, tables = [], []
    for prefix, cached, new in layout:
        table = list(preamble) + docs.get(prefix, []) if prefix else []
        seqs.append((cached, new))
        tables.append(alloc.grow(table, cached + new, block_size))
    return seqs, tables, shared // block_size


def run_both(seqs, tables, block_size: int, num_heads: int, cascade: bool | None, seed: int = 0):
    """Triton and torch forwards of one step over the same (noise-filled) cache."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = max(max(t) for t in tables) + 1
    kv = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    _, md = build_attn_metadata(seqs, tables, block_size)
    num_tokens = sum(n for _, n in seqs)
    q = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    scale = HEAD_DIM**-0.5
    ref = attend(TorchAttentionBackend(), q, k, v, kv.clone(), md, scale)
    tensors = {f.name: getattr(md, f.name) for f in dataclasses.fields(md)}
    tensors = {k: t.to(DEVICE) for k, t in tensors.items() if isinstance(t, torch.Tensor)}
    tmd = dataclasses.replace(md, **tensors, backend_plan=None)
    backend = TritonAttentionBackend(cascade=cascade)
    tkv = kv.to(DEVICE)
    out = attend(backend, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), tkv, tmd, scale)
    return out.cpu(), ref, tmd, tkv.cpu(), backend


@pytest.mark.parametrize("block_size,gqa", [(8, 4), (16, 1), (16, 4)])
def test_cascade_matches_torch_on_nested_groups(block_size: int, gqa: int) -> None:
    seqs, tables, shared_blocks = nested_batch(block_size)
    out, ref, md, _, _ = run_both(seqs, tables, block_size, NUM_KV_HEADS * gqa, cascade=True)
    # the planner split the preamble group where sharing deepens: one group per set
    assert sorted(md.prefix_groups) == [([0, 1, 5], shared_blocks), ([2, 6, 7], shared_blocks)]
    groups = md.backend_plan.cascade
    assert groups is not None and groups.num_groups == 2
    assert groups.token_idx.tolist() == [0, 1, 5, 2]  # decode members only: B is a group of one
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_cascade_off_and_on_agree() -> None:
    seqs, tables, _ = nested_batch(16)
    on, ref, _, kv_on, _ = run_both(seqs, tables, 16, 8, cascade=True, seed=1)
    off, _, md_off, kv_off, _ = run_both(seqs, tables, 16, 8, cascade=False, seed=1)
    assert md_off.backend_plan.cascade is None
    torch.testing.assert_close(on, off, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(on, ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(kv_on, kv_off)  # both stored the step's K/V in the same slots


def test_forward_runs_the_plan_that_plan_built() -> None:
    """The model runner plans a step once, before the model runs; every layer's forward reads
    that plan, and a step nobody planned is refused."""
    seqs, tables, _ = nested_batch(8)
    _, _, md, _, backend = run_both(seqs, tables, 8, 4, cascade=True)
    kv = torch.zeros(2, 256, 8, NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    assert backend.plan(md, kv) is md and md.backend_plan.cascade is not None
    q = torch.zeros(md.slot_mapping.shape[0], 4, HEAD_DIM, device=DEVICE)
    k = torch.zeros(md.slot_mapping.shape[0], NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    with pytest.raises(RuntimeError, match="plan"):
        backend.forward(q, k, k, kv, dataclasses.replace(md, backend_plan=None), 1.0)


def test_heuristic_decides_per_group(monkeypatch) -> None:
    """By default ``cascade_pays`` decides: never at these tiny shapes; when it says yes, the
    groups it accepts take cascade and the result is unchanged."""
    seqs, tables, _ = nested_batch(8)
    out, ref, md, _, _ = run_both(seqs, tables, 8, 4, cascade=None)
    assert md.backend_plan.cascade is None
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(triton_backend, "cascade_pays", lambda n, *_: n >= 2)
    out, ref, md, _, _ = run_both(seqs, tables, 8, 4, cascade=None)
    assert md.backend_plan.cascade.token_idx.tolist() == [0, 1, 5]  # set B's lone decode is out
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_cascade_decode_groups_keeps_decode_members() -> None:
    groups = [([0, 2, 5, 6], 8), ([1, 7], 4), ([8, 9], 4)]
    seq_lens = [200, 100, 300, 0, 0, 150, 40, 70, 90, 90]
    assert cascade_decode_groups(groups, 6, seq_lens, 16, 4096, cascade=True) == [
        ([0, 2, 5], 8),
        ([1], 4),
    ]
    assert cascade_decode_groups(groups, 6, seq_lens, 16, 4096, cascade=False) == []
    # 3 decodes over 128 shared tokens save 256 token reads: less than a launch costs
    assert cascade_decode_groups(groups, 6, seq_lens, 16, 4096) == []
    long = [32_768 + 100] * 6 + [0] * 4
    assert cascade_decode_groups(groups, 6, long, 2048, 4096) == [([0, 2, 5], 8)]
