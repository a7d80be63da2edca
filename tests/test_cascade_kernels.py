"""Cascade decode kernels (shared-prefix attention, suffix decode, lse merge) against dense torch.

On CPU the kernels run through Triton's interpreter (set up as in test_kernels.py, whose dense
reference and tolerances these tests share). Shapes are tiny: head_dim 16/32, a handful of tokens.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_kernels import DEVICE, NUM_KV_HEADS, assert_close, decode_inputs, dense_attention

pytest.importorskip("triton")

from prefixserve.kernels.cascade_attention import (
    CascadeGroups,
    cascade_decode_attention,
    cascade_pays,
    shared_prefix_attention,
)
from prefixserve.kernels.decode_attention import decode_attention
from prefixserve.kernels.merge_attn_states import merge_attn_states


class SharedBatch:
    """Decode sequences whose block tables start with shared physical blocks, in a cache of
    noise (a kernel reading a wrong slot fails the comparison).

    ``layout``: per sequence ``(prefix key, own length)``; sequences with the same prefix key
    share its blocks; a key is a tuple of named prefixes so sharing can nest, e.g. ``("sys",)``
    and ``("sys", "docA")``. ``prefix_blocks[name]`` is each named prefix's length in blocks.
    """

    def __init__(
        self,
        layout: list[tuple[tuple[str, ...], int]],
        prefix_blocks: dict[str, int],
        num_heads: int,
        head_dim: int,
        block_size: int,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        own_blocks = [-(-own // block_size) for _, own in layout]
        num_blocks = sum(prefix_blocks.values()) + sum(own_blocks) + 3
        free = torch.randperm(num_blocks, generator=gen).tolist()
        named = {name: [free.pop() for _ in range(n)] for name, n in prefix_blocks.items()}
        self.block_size = block_size
        self.tables = []
        self.seq_lens = []
        for (key, own), nb in zip(layout, own_blocks):
            shared = [b for name in key for b in named[name]]
            self.tables.append(shared + [free.pop() for _ in range(nb)])
            self.seq_lens.append(len(shared) * block_size + own)
        self.kv_cache = torch.randn(
            2, num_blocks, block_size, NUM_KV_HEADS, head_dim, generator=gen
        ).to(dtype)
        self.query = torch.randn(len(layout), num_heads, head_dim, generator=gen).to(dtype)
        width = max(len(t) for t in self.tables)
        self.block_tables = torch.tensor(
            [t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32
        )

    def context(self, seq: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``start .. end - 1`` of ``seq``, ``[n, nkv, hd]`` each."""
        pos = torch.arange(start, end)
        blocks = torch.tensor(self.tables[seq])[pos // self.block_size]
        return (
            self.kv_cache[0][blocks, pos % self.block_size],
            self.kv_cache[1][blocks, pos % self.block_size],
        )

    def groups(self, prefix_groups: list[tuple[list[int], int]]) -> CascadeGroups:
        qsl = list(range(len(self.seq_lens) + 1))  # one decode token per sequence
        return CascadeGroups.build(
            prefix_groups, self.block_tables.to(DEVICE), qsl, self.seq_lens, self.block_size
        )

    def reference(
        self, scale: float, starts: list[int] | None = None, ends: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query over positions ``starts[b] .. ends[b] - 1`` (default: whole context):
        output and natural-log lse, fp64 math."""
        outs, lses = [], []
        for b, n in enumerate(self.seq_lens):
            start = 0 if starts is None else starts[b]
            end = n if ends is None else ends[b]
            k, v = self.context(b, start, end)
            o, lse = dense_attention(self.query[b : b + 1], k, v, scale)
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses)


# Batch: a nested prefix ("sys" shared by 6 sequences, "docA"/"docB" within two sets), a group
# of one, sequences in no group (one of which starts with the "sys" blocks too), members
# interleaved, and members whose suffix is their decode token alone (seq_len = shared + 1).
LAYOUT = [
    (("sys", "docA"), 1),  # 0: group A, empty suffix
    ((), 9),  # 1: no group
    (("sys", "docB"), 7),  # 2: group B
    (("sys", "docA"), 20),  # 3: group A
    (("sys",), 3),  # 4: group C (one member, "sys" only)
    (("sys", "docB"), 1),  # 5: group B, empty suffix
    (("sys", "docA"), 37),  # 6: group A
    (("sys",), 5),  # 7: no group, though it starts with the shared "sys" blocks
]
PREFIX_BLOCKS = {"sys": 2, "docA": 1, "docB": 2}
GROUPS = [([0, 3, 6], 3), ([2, 5], 4), ([4], 2)]


@pytest.mark.parametrize(
    "block_size,num_heads,head_dim,splits",
    [
        (16, 8, 16, (None, None)),  # GQA 4; shared 48 / 64 / 32 tokens vs 32-token tiles
        (32, 8, 32, (None, None)),  # GQA 4, a shared part spanning 96 .. 128 tokens
        (16, 2, 32, (None, None)),  # MHA
        (16, 16, 16, (3, 3)),  # GQA 8, split counts that leave splits empty
    ],
)
def test_cascade_decode_matches_dense(
    block_size: int, num_heads: int, head_dim: int, splits: tuple[int | None, int | None]
) -> None:
    batch = SharedBatch(LAYOUT, PREFIX_BLOCKS, num_heads, head_dim, block_size)
    groups = batch.groups(GROUPS)
    scale = head_dim**-0.5
    out = torch.empty_like(batch.query, device=DEVICE)
    cascade_decode_attention(
        *decode_inputs(batch), groups, scale, out, num_splits=splits[0], shared_splits=splits[1]
    )
    assert_close(out, batch.reference(scale)[0])


def test_cascade_groups_layout() -> None:
    batch = SharedBatch(LAYOUT, PREFIX_BLOCKS, 2, 16, 16)
    g = batch.groups(GROUPS)
    assert g.token_idx.tolist() == [0, 3, 6, 2, 5, 4]
    assert g.token_start.tolist() == [0, 3, 5, 6]
    assert g.token_rows.tolist() == [0, -1, 3, 1, 5, 4, 2, -1]
    assert g.shared_lens.tolist() == [48, 64, 32]
    assert g.context_starts.tolist() == [48, 0, 64, 48, 32, 64, 48, 0]
    assert g.shared_block_tables.shape == (3, 4)
    for row, (members, nb) in enumerate(GROUPS):
        assert g.shared_block_tables[row, :nb].tolist() == batch.tables[members[0]][:nb]
    assert (g.num_groups, g.num_rows, g.max_group_tokens) == (3, 6, 3)
    assert (g.max_shared_len, g.max_suffix_len) == (64, 37)


def test_cascade_decode_bf16_cache() -> None:
    batch = SharedBatch(LAYOUT, PREFIX_BLOCKS, 8, 16, 16, seed=1, dtype=torch.bfloat16)
    batch.kv_cache, batch.query = batch.kv_cache.float(), batch.query.float()
    expected = batch.reference(0.25)[0]
    inputs = decode_inputs(batch, torch.bfloat16)
    out = torch.empty_like(inputs[0])
    cascade_decode_attention(*inputs, batch.groups(GROUPS), 0.25, out)
    assert out.dtype == torch.bfloat16
    assert_close(out, expected, rtol=1e-2, atol=1e-2)  # one rounding of the fp32 result


def test_cascade_without_groups_is_decode() -> None:
    batch = SharedBatch(LAYOUT[:3], PREFIX_BLOCKS, 4, 16, 16, seed=2)
    out = torch.empty_like(batch.query, device=DEVICE)
    cascade_decode_attention(*decode_inputs(batch), batch.groups([]), 0.25, out)
    assert_close(out, batch.reference(0.25)[0])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_context_starts_and_lse(num_splits: int) -> None:
    """Suffixes of one token, of a ragged length, empty (start == seq_len), and a whole context."""
    batch = SharedBatch([((), 40), ((), 33), ((), 17), ((), 5)], {}, 8, 16, 16, seed=3)
    starts = [39, 16, 17, 0]
    out = torch.empty_like(batch.query, device=DEVICE)
    lse = torch.empty(batch.query.shape[:2], device=DEVICE)
    decode_attention(
        *decode_inputs(batch),
        0.25,
        out,
        max(batch.seq_lens),
        num_splits=num_splits,
        block_n=16,
        context_starts=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        lse=lse,
    )
    ref_out, ref_lse = batch.reference(0.25, starts=starts)
    assert_close(out, ref_out)
    assert_close(lse, ref_lse)
    assert torch.isneginf(lse[2]).all() and not out[2].any()


def test_shared_prefix_attention_rows_and_tiles() -> None:
    """Several query tokens per member (prefill-like rows), a group larger than one row tile
    (GQA 8 packs 4 tokens a tile under the interpreter), and tokens outside every group."""
    bs, nh, hd = 16, 16, 16
    batch = SharedBatch([(("p",), 10), (("p",), 12), ((), 9), (("p",), 6)], {"p": 3}, nh, hd, bs)
    query_lens = [3, 2, 1, 2]
    qsl = [0, 3, 5, 6, 8]
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(qsl[-1], nh, hd, generator=gen)
    groups = CascadeGroups.build(
        [([0, 1, 3], 3)], batch.block_tables.to(DEVICE), qsl, batch.seq_lens, bs
    )
    assert groups.max_group_tokens == 7
    out = torch.full_like(query, float("nan"), device=DEVICE)
    lse = torch.full(query.shape[:2], float("nan"), device=DEVICE)
    kv = batch.kv_cache.to(DEVICE)
    shared_prefix_attention(query.to(DEVICE), kv[0], kv[1], groups, 0.25, out, lse, num_splits=2)
    k, v = batch.context(0, 0, 3 * bs)
    for seq in (0, 1, 3):
        rows = slice(qsl[seq], qsl[seq] + query_lens[seq])
        ref_out, ref_lse = dense_attention(query[rows], k, v, 0.25)
        assert_close(out[rows], ref_out)
        assert_close(lse[rows], ref_lse)
    assert not out[5].any() and torch.isneginf(lse[5]).all()  # sequence 2, in no group


def test_composed_parts_match_dense() -> None:
    """The unfused pipeline: shared part, suffix part (decode with context_starts and lse), and
    merge_attn_states give the same result as dense attention, lse included."""
    batch = SharedBatch(LAYOUT, PREFIX_BLOCKS, 8, 32, 16, seed=5)
    groups = batch.groups(GROUPS)
    inputs = decode_inputs(batch)
    shape = batch.query.shape
    shared_out, suffix_out, out = (torch.empty(shape, device=DEVICE) for _ in range(3))
    shared_lse, suffix_lse, out_lse = (torch.empty(shape[:2], device=DEVICE) for _ in range(3))
    shared_prefix_attention(*inputs[:3], groups, 0.2, shared_out, shared_lse)
    decode_attention(
        *inputs,
        0.2,
        suffix_out,
        groups.max_suffix_len,
        context_starts=groups.context_starts,
        lse=suffix_lse,
    )
    merge_attn_states(suffix_out, suffix_lse, shared_out, shared_lse, out, out_lse)
    ref_out, ref_lse = batch.reference(0.2)
    assert_close(out, ref_out)
    assert_close(out_lse, ref_lse)


def test_merge_attn_states_empty_parts() -> None:
    """Random parts merge like logaddexp; a part with lse -inf leaves the other exactly (even
    when its output is nan), and two empty parts give zeros and -inf."""
    gen = torch.Generator().manual_seed(6)
    t, h, d = 5, 4, 16
    out_a, out_b = torch.randn(2, t, h, d, generator=gen)
    lse_a, lse_b = torch.randn(2, t, h, generator=gen) * 3
    lse_a[1], lse_b[2] = float("-inf"), float("-inf")
    lse_a[3], lse_b[3] = float("-inf"), float("-inf")
    out_a[1] = float("nan")
    out_b[2] = float("nan")
    out, out_lse = torch.empty(t, h, d), torch.empty(t, h)
    dev = [x.to(DEVICE) for x in (out_a, lse_a, out_b, lse_b, out, out_lse)]
    merge_attn_states(*dev)
    out, out_lse = dev[4].cpu(), dev[5].cpu()
    total = torch.logaddexp(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - total)[..., None], torch.exp(lse_b - total)[..., None]
    for i in (0, 4):
        assert_close(out[i], wa[i] * out_a[i] + wb[i] * out_b[i])
        assert_close(out_lse[i], total[i])
    assert torch.equal(out[1], out_b[1]) and torch.equal(out_lse[1], lse_b[1])
    assert torch.equal(out[2], out_a[2]) and torch.equal(out_lse[2], lse_a[2])
    assert not out[3].any() and torch.isneginf(out_lse[3]).all()


def test_merge_attn_states_in_place_bf16() -> None:
    gen = torch.Generator().manual_seed(7)
    out_a, out_b = torch.randn(2, 3, 2, 32, generator=gen)
    lse_a, lse_b = torch.randn(2, 3, 2, generator=gen)
    expected = (out_a * lse_a.exp()[..., None] + out_b * lse_b.exp()[..., None]) / (
        lse_a.exp() + lse_b.exp()
    )[..., None]
    a = out_a.to(DEVICE, torch.bfloat16)
    merge_attn_states(a, lse_a.to(DEVICE), out_b.to(DEVICE), lse_b.to(DEVICE), a)
    # out_a was rounded to bf16 on the way in, the result once more on the way out
    assert_close(a, expected, rtol=2e-2, atol=2e-2)


def test_cascade_pays() -> None:
    assert not cascade_pays(1, 4096, [10])  # a group of one saves nothing
    assert not cascade_pays(2, 256, [10, 10])  # 256 token reads saved < a launch
    assert cascade_pays(8, 1024, [20] * 8)  # 7,168 token reads saved
    assert cascade_pays(32, 256, [50] * 32)
    assert not cascade_pays(8, 1024, [20_000] * 8)  # saving < 10% of the group's traffic
    # a small model (2 KV heads x 64 x bf16) reads 8x fewer bytes per token
    assert not cascade_pays(8, 1024, [20] * 8, kv_bytes_per_token=512)
    assert math.isclose(
        min(n for n in range(1, 10_000) if cascade_pays(8, n, [1] * 8)), 437, abs_tol=1
    )
