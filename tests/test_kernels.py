"""Triton kernels and TritonAttentionBackend against a dense torch reference.

On CPU the kernels run through Triton's interpreter (``TRITON_INTERPRET=1`` must be set before they
are imported; tests/conftest.py does it too). Shapes are tiny because the interpreter is slow; the
parameter grid is a representative slice of block sizes x GQA ratios x head dims, not the product.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from prefixserve.attention.metadata import AttentionMetadata, SeqSpan, build_attention_metadata
from prefixserve.attention.triton_backend import TritonAttentionBackend
from prefixserve.kernels.decode_attention import decode_attention
from prefixserve.kernels.extend_attention import extend_attention
from prefixserve.kernels.kv_store import store_kv_cache

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_KV_HEADS = 2
RTOL, ATOL = 1e-4, 1e-5

# (block_size, gqa ratio, head_dim): every block size x ratio at head_dim 64, a few at 128, and a
# non-power-of-two head dim that the kernels pad with a mask.
SHAPES = [(bs, g, 64) for bs in (8, 16, 32) for g in (1, 2, 4, 8)] + [
    (8, 1, 128),
    (16, 4, 128),
    (32, 8, 128),
    (16, 2, 80),
]


class PagedBatch:
    """Dense per-sequence K/V and the same K/V scattered into a paged cache of shuffled blocks.

    ``cached_lens[i]`` positions of sequence ``i`` are in the cache before the step; the rest are
    the step's new tokens (``key``/``value``/``slot_mapping``). Unused cache slots hold noise so a
    kernel that reads past a sequence's context fails the comparison.
    """

    def __init__(
        self,
        seq_lens: list[int],
        query_lens: list[int],
        num_heads: int,
        head_dim: int,
        block_size: int,
        prefill_cache: bool,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)

        def randn(*shape: int) -> torch.Tensor:  # fp32 values exactly representable in ``dtype``
            return torch.randn(*shape, generator=gen).to(dtype).float()

        blocks_per_seq = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + 3
        order = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_size = block_size
        self.seq_lens, self.query_lens = seq_lens, query_lens
        self.k = [randn(n, NUM_KV_HEADS, head_dim) for n in seq_lens]
        self.v = [randn(n, NUM_KV_HEADS, head_dim) for n in seq_lens]
        self.query = randn(sum(query_lens), num_heads, head_dim)
        self.kv_cache = randn(2, num_blocks, block_size, NUM_KV_HEADS, head_dim)
        self.block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
        for i, nb in enumerate(blocks_per_seq):
            self.block_tables[i, :nb] = torch.tensor(order[:nb])
            order = order[nb:]
        slots, keys, values = [], [], []
        for i, (n, q) in enumerate(zip(seq_lens, query_lens)):
            written = n if prefill_cache else n - q
            for p in range(n):
                slot = self.slot(i, p)
                if p < written:
                    self.kv_cache[0].view(-1, NUM_KV_HEADS, head_dim)[slot] = self.k[i][p]
                    self.kv_cache[1].view(-1, NUM_KV_HEADS, head_dim)[slot] = self.v[i][p]
                if p >= n - q:
                    slots.append(slot)
            keys.append(self.k[i][n - q :])
            values.append(self.v[i][n - q :])
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64)
        self.key, self.value = torch.cat(keys), torch.cat(values)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32)

    def slot(self, seq: int, pos: int) -> int:
        return (
            int(self.block_tables[seq, pos // self.block_size]) * self.block_size
            + pos % self.block_size
        )

    def metadata(self) -> AttentionMetadata:
        """The step's metadata, from the engine's builder (its decodes: the leading one-token
        queries; no prefix groups)."""
        spans = [
            SeqSpan(self.block_tables[i, : -(-n // self.block_size)].tolist(), n - q, q)
            for i, (n, q) in enumerate(zip(self.seq_lens, self.query_lens))
        ]
        return build_attention_metadata(spans, self.block_size, DEVICE, plan_groups=False)[1]

    def reference(self, scale: float) -> torch.Tensor:
        """Dense causal attention of every query token over its sequence's whole context (fp64)."""
        outs = []
        for i, (n, q) in enumerate(zip(self.seq_lens, self.query_lens)):
            start = int(self.query_start_loc[i])
            q_rows = self.query[start : start + q]
            outs.append(dense_attention(q_rows, self.k[i], self.v[i], scale, ctx_len=n - q)[0])
        return torch.cat(outs)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, ctx_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[Tq, H, D]`` over k/v ``[L, Hkv, D]`` (GQA by repeat) in fp64: output and natural-log lse
    (fp32; no visible key: zeros and -inf). Causal with the queries at positions ``ctx_len ..``;
    without ``ctx_len`` every query sees every key."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->qhk", q.double(), k) * scale
    if ctx_len is not None:
        q_pos = ctx_len + torch.arange(q.shape[0])
        visible = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("qhk,khd->qhd", probs, v).float(), lse.float()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, **tol: float) -> None:
    tol = tol or {"rtol": RTOL, "atol": ATOL}
    torch.testing.assert_close(actual.float().cpu(), expected, **tol)


def decode_inputs(batch, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """``query, k_cache, v_cache, block_tables, seq_lens`` of a batch of decodes (a ``PagedBatch``
    or test_cascade_kernels' ``SharedBatch``) on DEVICE, query and cache in ``dtype`` if given:
    the first arguments of the decode kernels."""
    kv = batch.kv_cache.to(DEVICE, dtype)
    seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int32, device=DEVICE)
    return batch.query.to(DEVICE, dtype), kv[0], kv[1], batch.block_tables.to(DEVICE), seq_lens


def decode_lens(block_size: int) -> list[int]:
    """Context length 1, exact multiples of the block size, ragged (partial last block)."""
    return [1, block_size, 3 * block_size, 2 * block_size + 5]


@pytest.mark.parametrize("block_size,gqa,head_dim", SHAPES)
def test_decode_attention(block_size: int, gqa: int, head_dim: int) -> None:
    seq_lens = decode_lens(block_size)
    batch = PagedBatch(
        seq_lens, [1] * len(seq_lens), NUM_KV_HEADS * gqa, head_dim, block_size, True
    )
    scale = head_dim**-0.5
    out = torch.empty_like(batch.query, device=DEVICE)
    decode_attention(*decode_inputs(batch), scale, out, max(seq_lens))
    assert_close(out, batch.reference(scale))


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_attention_splits(num_splits: int) -> None:
    """Split counts that leave some splits empty (short sequences) and that are not powers of two."""
    seq_lens = [1, 7, 40, 77]
    batch = PagedBatch(seq_lens, [1] * 4, NUM_KV_HEADS * 4, 64, 8, True, seed=1)
    out = torch.empty_like(batch.query, device=DEVICE)
    decode_attention(
        *decode_inputs(batch), 0.125, out, max(seq_lens), num_splits=num_splits, block_n=16
    )
    assert_close(out, batch.reference(0.125))


@pytest.mark.parametrize("block_size,gqa,head_dim", SHAPES)
def test_extend_attention(block_size: int, gqa: int, head_dim: int) -> None:
    # (cached prefix, new tokens): plain prefill, prefix of exactly one block, ragged prefix with a
    # chunk crossing blocks, a single new token after an almost-full second block.
    pairs = [(0, 5), (block_size, 3), (block_size + 3, block_size + 2), (2 * block_size - 1, 1)]
    seq_lens = [c + q for c, q in pairs]
    query_lens = [q for _, q in pairs]
    batch = PagedBatch(seq_lens, query_lens, NUM_KV_HEADS * gqa, head_dim, block_size, True, seed=2)
    scale = head_dim**-0.5
    kv = batch.kv_cache.to(DEVICE)
    out = torch.empty_like(batch.query, device=DEVICE)
    extend_attention(
        batch.query.to(DEVICE),
        kv[0],
        kv[1],
        batch.query_start_loc.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        batch.block_tables.to(DEVICE),
        max(query_lens),
        scale,
        out,
    )
    assert_close(out, batch.reference(scale))


def test_store_kv_cache_skips_negative_slots() -> None:
    batch = PagedBatch([5, 12], [5, 4], NUM_KV_HEADS, 64, 8, False, seed=3)
    slot_mapping = batch.slot_mapping.clone()
    slot_mapping[[1, 6]] = -1
    expected = batch.kv_cache.clone()
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected[0].view(-1, NUM_KV_HEADS, 64)[slot] = batch.key[t]
            expected[1].view(-1, NUM_KV_HEADS, 64)[slot] = batch.value[t]
    kv = batch.kv_cache.to(DEVICE)
    store_kv_cache(
        batch.key.to(DEVICE), batch.value.to(DEVICE), kv[0], kv[1], slot_mapping.to(DEVICE)
    )
    assert torch.equal(kv.cpu(), expected)


def test_copy_blocks_across_layers() -> None:
    gen = torch.Generator().manual_seed(4)
    caches = torch.randn(3, 2, 10, 16, NUM_KV_HEADS, 64, generator=gen)
    src, dst = torch.tensor([0, 4, 4, 7]), torch.tensor([2, 5, 9, 1])
    expected = caches.clone()
    expected[:, :, dst] = caches[:, :, src]
    on_device = caches.to(DEVICE)
    TritonAttentionBackend().copy_blocks(on_device, src.to(DEVICE), dst.to(DEVICE))
    assert torch.equal(on_device.cpu(), expected)


@pytest.mark.parametrize(
    "block_size,gqa,head_dim,dtype",
    [
        (8, 2, 64, torch.float32),
        (16, 1, 128, torch.float32),
        (32, 4, 64, torch.float32),
        (16, 2, 64, torch.bfloat16),
    ],
)
def test_backend_forward_mixed_batch(
    block_size: int, gqa: int, head_dim: int, dtype: torch.dtype
) -> None:
    """Decodes first, then prefill chunks over cached prefixes; the forward also stores new K/V."""
    seq_lens = [1, block_size, 2 * block_size + 3, 5, block_size + 2, 3 * block_size]
    query_lens = [1, 1, 1, 5, 4, block_size + 1]
    batch = PagedBatch(
        seq_lens, query_lens, NUM_KV_HEADS * gqa, head_dim, block_size, False, seed=5, dtype=dtype
    )
    scale = head_dim**-0.5
    kv = batch.kv_cache.to(DEVICE, dtype)
    md = batch.metadata()
    assert md.num_decodes == 3
    backend = TritonAttentionBackend()
    out = backend.forward(
        batch.query.to(DEVICE, dtype),
        batch.key.to(DEVICE, dtype),
        batch.value.to(DEVICE, dtype),
        kv,
        backend.plan(md, kv),
        scale,
    )
    assert out.shape == batch.query.shape and out.dtype == dtype
    if dtype == torch.float32:
        assert_close(out, batch.reference(scale))
    else:  # one rounding of the fp32 result to bf16
        assert_close(out, batch.reference(scale), rtol=1e-2, atol=1e-2)
    for i, n in enumerate(seq_lens):
        slots = [batch.slot(i, p) for p in range(n)]
        assert torch.equal(
            kv[0].reshape(-1, NUM_KV_HEADS, head_dim)[slots].float().cpu(), batch.k[i]
        )
        assert torch.equal(
            kv[1].reshape(-1, NUM_KV_HEADS, head_dim)[slots].float().cpu(), batch.v[i]
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path without the interpreter")
def test_backend_unavailable_without_interpreter() -> None:
    code = (
        "from prefixserve.attention.triton_backend import check_triton_available\n"
        "from prefixserve.core.errors import BackendUnavailableError\n"
        "try:\n"
        "    check_triton_available('cpu')\n"
        "except BackendUnavailableError as e:\n"
        "    print('raised:', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "raised:" in result.stdout and "TRITON_INTERPRET=1" in result.stdout
