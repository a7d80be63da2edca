"""Each tier module's own decisions, without an engine: eviction order, capacity, retained-last
within a tenant's quota, the blob format's checks (flipped byte, truncation, temp files, another
fingerprint, format or secret, a forged or reshaped block, a crafted header, a full disk), the
tier secret's sources, the shared tier's memory of what it wrote, the codecs' error bound, the retention table (budget, TTL expiry, release, learned
TTL), the pool's retained LRU and the load/recompute cost model."""

from __future__ import annotations

import errno
import json
import struct
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import valkey
from safetensors.torch import save as st_save
from valkey_server import ValkeyProcess

from prefixserve.core.config import EngineConfig
from prefixserve.core.errors import InvalidArgumentError
from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.retention import KVRetention, RetentionTable
from prefixserve.kv.tiers import codec, payload
from prefixserve.kv.tiers.base import TierUnavailableError
from prefixserve.kv.tiers.block_io import kv_fingerprint
from prefixserve.kv.tiers.cost import LoadCost
from prefixserve.kv.tiers.disk import DiskTier
from prefixserve.kv.tiers.host import HostTier
from prefixserve.kv.tiers.payload import BlobFormat, BlockKey, CorruptBlockError
from prefixserve.kv.tiers.secret import SECRET_FILE, mac_key, tier_secret
from prefixserve.kv.tiers.shared import SharedTier

SHAPE = (2, 2, 4, 2, 8)  # layers, K/V, block_size, kv_heads, head_dim
FP = "f" * 32
FMT = BlobFormat(FP, mac_key("test secret"), SHAPE, torch.float32)


def block(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def key(i: int, parent: int | None = None) -> BlockKey:
    return BlockKey(1000 + i, (i, i + 1, i + 2, i + 3), parent)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---- host tier ---------------------------------------------------------------------------------


def test_host_tier_evicts_lru_first_and_retained_last():
    size = codec.nbytes({"kv": block(0)})
    retained = {1001}
    tier = HostTier(3 * size, retained_by=lambda h: "A" if h in retained else None)
    for i in range(3):
        assert tier.put(key(i), {"kv": block(i)}) == []
    assert tier.get(key(0)) is not None  # 0 is now the most recently used
    evicted = tier.put(key(3), {"kv": block(3)})
    assert [k for k, _ in evicted] == [key(2)]  # 1 is retained, 0 was used: 2 goes
    assert torch.equal(evicted[0][1]["kv"], block(2))  # handed back for demotion
    evicted = tier.put(key(4), {"kv": block(4)})
    assert [k for k, _ in evicted] == [key(0)]
    retained.clear()
    assert [k for k, _ in tier.put(key(5), {"kv": block(5)})] == [key(1)]
    assert tier.counters.blocks == 3 and tier.counters.bytes == 3 * size
    assert tier.counters.evictions == 3


def test_a_tenants_retained_entries_keep_priority_only_within_its_share():
    """Tenant A retains four entries of a six-entry tier at share 0.5 (three entries): its
    oldest goes first, then B's unretained ones while A's three newest stay protected; once every
    entry is protected, the tenant holding the most bytes loses its oldest."""
    size = codec.nbytes({"kv": block(0)})
    owner = {1000: "A", 1001: "A", 1002: "A", 1003: "A"}
    tier = HostTier(6 * size, retained_by=owner.get, tenant_share=0.5)
    for i in range(6):  # A's 0..3, then B's unretained 4, 5
        tier.put(key(i), {"kv": block(i)})
    assert [k for k, _ in tier.put(key(6), {"kv": block(6)})] == [key(0)]
    assert [k for k, _ in tier.put(key(7), {"kv": block(7)})] == [key(4)]  # A's 1..3 protected
    owner.update({1005: "B", 1006: "B", 1007: "C"})  # everyone retains now: A holds most
    assert [k for k, _ in tier.put(key(8), {"kv": block(8)})] == [key(1)]
    full = HostTier(6 * size, retained_by=owner.get)  # share 1.0: retained always last
    for i in range(6):
        full.put(key(i), {"kv": block(i)})
    owner.pop(1005)
    assert [k for k, _ in full.put(key(6), {"kv": block(6)})] == [key(4)]


def test_host_tier_compares_token_ids():
    tier = HostTier(1 << 20)
    tier.put(key(0), {"kv": block(0)})
    other = BlockKey(key(0).block_hash, (9, 9, 9, 9))  # same hash, other tokens: a collision
    assert not tier.contains(other) and tier.get(other) is None
    assert tier.contains(key(0)) and torch.equal(tier.get(key(0))["kv"], block(0))


def test_host_tier_entry_larger_than_capacity_goes_straight_down():
    tier = HostTier(16)
    assert [k for k, _ in tier.put(key(0), {"kv": block(0)})] == [key(0)]
    assert tier.counters.blocks == 0


# ---- codecs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,bound", [("int8", 1 / 254), ("fp8", 1 / 16)])
def test_codec_error_is_within_half_a_step(name, bound):
    x = block(1) * 3
    enc = codec.encode(x, name)
    y = codec.decode(enc, torch.float32)
    amax = x.abs().amax(dim=-1, keepdim=True)
    assert ((y - x).abs() <= amax * bound + 1e-6).all()
    assert codec.nbytes(enc) < codec.nbytes({"kv": x}) / 2  # head_dim 8: scales cost 1/2


def test_codec_auto_is_exact():
    x = block(2).to(torch.bfloat16)
    assert torch.equal(codec.decode(codec.encode(x, "auto"), torch.bfloat16), x)


# ---- payload format ----------------------------------------------------------------------------


def test_payload_round_trip_and_checks():
    data = FMT.encode(key(0, parent=7), {"kv": block(0)})
    assert torch.equal(FMT.decode(data, key(0))["kv"], block(0))
    assert FMT.header_key(payload.read_header(data)) == key(0, parent=7)
    with pytest.raises(CorruptBlockError, match="fingerprint"):
        replace(FMT, fingerprint="0" * 32).decode(data, key(0))
    with pytest.raises(CorruptBlockError, match="another block"):
        FMT.decode(data, BlockKey(key(0).block_hash, (5, 5, 5, 5)))
    flipped = bytearray(data)
    flipped[-3] ^= 0x10
    with pytest.raises(CorruptBlockError, match="MAC"):
        FMT.decode(bytes(flipped), key(0))
    with pytest.raises(CorruptBlockError):
        FMT.decode(data[: len(data) // 2], key(0))
    with pytest.raises(CorruptBlockError):
        FMT.decode(b"\x00" * 4, key(0))


def test_a_blob_under_another_secret_or_forged_is_refused():
    """Whoever can write the folder or the server but lacks the secret cannot make a blob this
    engine accepts: not under another secret, not with changed values and a matching plain
    checksum, not with its MAC recomputed under a guessed key."""
    other = replace(FMT, mac_key=mac_key("another secret"))
    with pytest.raises(CorruptBlockError, match="MAC"):
        FMT.decode(other.encode(key(0), {"kv": block(0)}), key(0))
    forged = block(0).clone()
    forged[0, 0, 0, 0, 0] += 1.0
    meta = payload.read_header(FMT.encode(key(0), {"kv": block(0)}))
    blob = st_save({"kv": forged}, metadata=meta)  # the true block's header and MAC
    with pytest.raises(CorruptBlockError, match="MAC"):
        FMT.decode(blob, key(0))


@pytest.mark.parametrize(
    "tensors",
    [
        {"kv": torch.zeros(2, 2, 2, 2, 8)},  # a block cut in half
        {"kv": torch.zeros(SHAPE, dtype=torch.float16)},  # another dtype
        {"kv": torch.zeros(SHAPE), "extra": torch.zeros(1)},  # more than a block
        {"q": torch.zeros(SHAPE, dtype=torch.int8), "scale": torch.zeros(SHAPE)},  # bad scales
    ],
    ids=["half", "dtype", "extra", "scale"],
)
def test_a_blob_is_refused_unless_it_is_exactly_a_pool_block(tensors):
    """Shape and dtype are checked after the MAC: even a blob signed with the right secret (a
    bug, an old engine of another layout) never reaches the copy into the pool."""
    with pytest.raises(CorruptBlockError, match="payload"):
        FMT.decode(FMT.encode(key(0), tensors), key(0))
    compressed = codec.encode(block(0), "int8")
    assert torch.equal(FMT.decode(FMT.encode(key(0), compressed), key(0))["q"], compressed["q"])


def test_a_header_with_a_number_where_a_string_belongs_is_a_bad_file(tmp_path):
    tier = disk(tmp_path)
    meta = payload.read_header(FMT.encode(key(0), {"kv": block(0)}))
    path = tier.dir / (key(0).hex + ".kvb")
    header = json.dumps({"__metadata__": {**meta, "token_ids": 7}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    again = disk(tmp_path)  # start-up goes on: the file is removed
    assert again.stored_keys() == [] and again.removed_at_start == 1


# ---- the tier secret ---------------------------------------------------------------------------


def test_the_tier_secret_comes_from_the_config_else_the_disk_folder_else_the_process(
    tmp_path, caplog
):
    given = EngineConfig(kv_cache_dir=str(tmp_path), kv_tier_secret="s3cret")
    assert tier_secret(given) == "s3cret" and not (tmp_path / SECRET_FILE).exists()
    kept = tier_secret(EngineConfig(kv_cache_dir=str(tmp_path)))
    assert len(kept) == 64 and (tmp_path / SECRET_FILE).stat().st_mode & 0o777 == 0o600
    assert tier_secret(EngineConfig(kv_cache_dir=str(tmp_path))) == kept  # a restart reads it
    shared = EngineConfig(kv_shared_url="redis://127.0.0.1:1")
    with caplog.at_level("WARNING"):
        assert tier_secret(shared) != tier_secret(shared)  # one per process: its blocks alone
    assert "--kv-tier-secret" in caplog.text
    assert "s3cret" not in repr(given)
    (tmp_path / SECRET_FILE).write_text("")
    with pytest.raises(InvalidArgumentError, match="tier-secret"):
        tier_secret(EngineConfig(kv_cache_dir=str(tmp_path)))
    with pytest.raises(InvalidArgumentError, match="kv_tier_secret"):
        EngineConfig(kv_tier_secret=" ")
    assert mac_key("a") != mac_key("b") and len(mac_key("x" * 1000)) == 32


# ---- disk tier ---------------------------------------------------------------------------------


def disk(tmp_path: Path, capacity: int = 1 << 30, **kw) -> DiskTier:
    return DiskTier(tmp_path, capacity, FMT, **kw)


def test_disk_tier_round_trip_and_restart(tmp_path):
    tier = disk(tmp_path)
    for i in range(3):
        tier.put(key(i, parent=i - 1 if i else None), {"kv": block(i)})
    assert not list(tier.dir.glob("*.tmp"))
    again = disk(tmp_path)  # a restart rebuilds the index from the folder
    assert [k.block_hash for k in again.stored_keys()] == [1000, 1001, 1002]
    assert (
        again.stored_keys()[1].parent_hash == 0
        and again.stored_keys()[1].token_ids == key(1).token_ids
    )
    assert torch.equal(again.get(key(2))["kv"], block(2))


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_disk_tier_damaged_file_is_deleted_and_missed(tmp_path, damage):
    tier = disk(tmp_path)
    tier.put(key(0), {"kv": block(0)})
    path = tier.dir / (key(0).hex + ".kvb")
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) - 10] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) - 100]
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    assert tier.get(key(0)) is None
    assert not path.exists() and not tier.contains(key(0)) and tier.counters.corrupt == 1
    assert tier.counters.blocks == 0 and tier.counters.bytes == 0


def test_disk_tier_rebuild_removes_temp_and_foreign_files(tmp_path):
    tier = disk(tmp_path)
    tier.put(key(0), {"kv": block(0)})
    tier.put(key(1), {"kv": block(1)})
    (tier.dir / "leftover.kvb.123.456.tmp").write_bytes(b"half a file")
    (tier.dir / (key(5).hex + ".kvb")).write_bytes(b"garbage")
    # a block of another model, copied into this folder
    other = replace(FMT, fingerprint="0" * 32).encode(key(2), {"kv": block(2)})
    (tier.dir / (key(2).hex + ".kvb")).write_bytes(other)
    # a block under another block's name
    (tier.dir / (key(3).hex + ".kvb")).write_bytes((tier.dir / (key(1).hex + ".kvb")).read_bytes())
    again = disk(tmp_path)
    assert sorted(k.block_hash for k in again.stored_keys()) == [1000, 1001]
    assert again.removed_at_start == 4
    assert sorted(p.name for p in again.dir.iterdir()) == sorted(
        [key(0).hex + ".kvb", key(1).hex + ".kvb"]
    )


def test_disk_tier_format_version_bump_deletes_old_files(tmp_path, monkeypatch):
    disk(tmp_path).put(key(0), {"kv": block(0)})
    monkeypatch.setattr(payload, "FORMAT_VERSION", "3")
    again = disk(tmp_path)
    assert again.stored_keys() == [] and again.removed_at_start == 1
    assert not list(again.dir.iterdir())


def test_disk_tier_keeps_models_apart(tmp_path):
    disk(tmp_path).put(key(0), {"kv": block(0)})
    other = DiskTier(tmp_path, 1 << 30, replace(FMT, fingerprint="0" * 32))
    assert other.stored_keys() == [] and other.get(key(0)) is None
    assert disk(tmp_path).contains(key(0))  # the other model's files were left alone


def test_disk_tier_evicts_least_recently_used_within_its_size(tmp_path):
    size = len(FMT.encode(key(0), {"kv": block(0)}))
    retained = {1000}
    tier = disk(tmp_path, capacity=3 * size + 10, retained_by=lambda h: "A" if h in retained else None)
    for i in range(3):
        tier.put(key(i), {"kv": block(i)})
    tier.get(key(1))
    evicted = tier.put(key(3), {"kv": block(3)})
    assert evicted == [(key(2), None)]  # 0 retained, 1 recently used
    assert not (tier.dir / (key(2).hex + ".kvb")).exists()
    assert tier.counters.bytes <= 3 * size + 10
    small = disk(tmp_path, capacity=2 * size)  # a restart with a smaller cap trims the folder
    assert len(small.stored_keys()) == 2


def test_disk_tier_full_disk_raises_and_leaves_no_file(tmp_path, monkeypatch):
    tier = disk(tmp_path)

    real_open = Path.open

    class FullFile:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[:10])  # a partial temp file, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "open", lambda self, mode="r": FullFile(real_open(self, mode)))
    with pytest.raises(TierUnavailableError, match="No space"):
        tier.put(key(0), {"kv": block(0)})
    monkeypatch.undo()
    assert list(tier.dir.iterdir()) == [] and tier.stored_keys() == []
    tier.put(key(1), {"kv": block(1)})  # the tier works again once there is room
    assert tier.contains(key(1))


# ---- shared tier -------------------------------------------------------------------------------


def test_shared_tier_remembers_what_it_wrote_or_read_and_refuses_other_secrets(tmp_path):
    server = ValkeyProcess(tmp_path)
    try:
        writer = SharedTier(server.url, FMT)
        assert not writer.contains(key(0))
        writer.put(key(0), {"kv": block(0)})
        assert writer.contains(key(0))  # the manager will not write it again
        assert not writer.contains(BlockKey(key(0).block_hash, (9, 9, 9, 9)))
        reader = SharedTier(server.url, FMT)
        assert torch.equal(reader.get(key(0))["kv"], block(0)) and reader.contains(key(0))
        stranger = SharedTier(server.url, replace(FMT, mac_key=mac_key("another secret")))
        assert stranger.get(key(0)) is None and stranger.counters.corrupt == 0  # apart
        assert reader.get(key(0)) is not None  # and nothing of the writer's was deleted
        client = valkey.Valkey.from_url(server.url)
        client.set(writer._key(key(1)), stranger.format.encode(key(1), {"kv": block(1)}))
        assert reader.get(key(1)) is None and reader.counters.corrupt == 1  # forged: deleted
        assert client.get(writer._key(key(1))) is None
        client.close()
        writer.discard(key(0))
        assert not writer.contains(key(0)) and reader.get(key(0)) is None
        for tier in (writer, reader, stranger):
            tier.close()
    finally:
        server.kill()


# ---- retention ---------------------------------------------------------------------------------


def test_retention_budget_expiry_and_release():
    clock = Clock()
    table = RetentionTable(budget_blocks=3, clock=clock)
    assert table.retain([1, 2], ttl_s=10, session="a") == ([1, 2], [])
    assert table.retain([2, 3, 4], ttl_s=60, session="b") == ([2, 3], [])  # 4: past the budget
    assert table.refused == 1 and len(table) == 3
    clock.now += 11
    assert table.expire() == [1]  # 2 is still held by b's longer retention
    assert table.is_retained(2) and not table.is_retained(1)
    assert sorted(table.release("b")) == [2, 3]  # a's retention of 2 ended with its TTL
    assert table.release("a") == []
    assert len(table) == 0 and table.expire() == []


def test_release_keeps_blocks_other_sessions_retain():
    table = RetentionTable(budget_blocks=10, clock=Clock())
    table.retain([1, 2], ttl_s=60, session="a")
    table.retain([1], ttl_s=60, session="b")  # a shorter prefix of the same chain
    table.retain([3], ttl_s=60)  # anonymous: no session releases it
    assert table.release("a") == [2]
    assert table.is_retained(1) and table.is_retained(3)


def test_ttl_is_capped_and_learned_from_tool_call_gaps():
    clock = Clock()
    table = RetentionTable(10, default_ttl_s=30, max_ttl_s=600, learn_ttl=True, clock=clock)
    assert table.ttl_for(10_000) == 600
    assert table.ttl_for(None) == 30  # no gaps seen yet
    for gap in (100, 120, 140, 160):
        table.retain([1], ttl_s=None, session="s")  # paused on a tool call
        clock.now += gap
        table.observe_request("s")
    assert table.ttl_for(None) == 160 * 1.5
    table.learn_ttl = False
    assert table.ttl_for(None) == 30


def test_a_pause_that_never_resumes_is_forgotten_after_the_ttl_cap():
    clock = Clock()
    table = RetentionTable(10, default_ttl_s=30, max_ttl_s=600, clock=clock)
    table.retain([1], ttl_s=None, session="gone")
    clock.now += 300
    table.retain([2], ttl_s=None, session="late")
    clock.now += 301  # "gone" paused 601 s ago, "late" 301 s ago
    table.expire()
    table.observe_request("gone")  # too late: no gap sample
    table.observe_request("late")
    assert list(table._gaps) == [301]


def test_kv_retention_validates():
    with pytest.raises(ValueError, match="ttl_s"):
        KVRetention(ttl_s=0)
    with pytest.raises(ValueError, match="num_tokens"):
        KVRetention(num_tokens=0)


def test_pool_evicts_retained_blocks_last_and_unretained_first():
    retained: set[int] = set()
    pool = BlockPool(4, is_retained=lambda h: h in retained)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.cache_block(b, 10 + i, [i])
    retained.add(10)
    pool.free(blocks)  # LRU order 0,1,2,3 but 0 is retained
    assert pool.lru_block_ids() == [1, 2, 3, 0]
    assert pool.num_retained_blocks == 1 and pool.num_cached_blocks == 4
    retained.add(12)
    pool.retain([12])
    assert pool.lru_block_ids() == [1, 3, 0, 2]
    retained.discard(12)
    pool.unretain([12])  # expired: evicted next
    assert pool.lru_block_ids() == [2, 1, 3, 0]
    evicted = []
    pool.on_evict = lambda b: evicted.append(b.block_hash)
    pool.allocate(4)  # pressure: the retained block goes last
    assert evicted == [12, 11, 13, 10]


# ---- cost model --------------------------------------------------------------------------------


def test_cost_model_skips_tiers_slower_than_recomputing():
    cost = LoadCost(block_size=16)
    assert cost.worth_loading("DISK")  # nothing measured yet
    cost.observe_forward(num_tokens=8, seconds=1.0)  # too few tokens: a decode step
    assert cost.recompute_s_per_token is None
    cost.observe_forward(num_tokens=160, seconds=0.16)  # 1 ms per token, 16 ms per block
    cost.observe_load("DISK", num_blocks=4, seconds=0.004)
    cost.observe_load("SHARED", num_blocks=1, seconds=0.5)
    assert cost.worth_loading("DISK") and not cost.worth_loading("SHARED")
    assert cost.snapshot()["recompute_s_per_block"] == pytest.approx(0.016)


def test_fingerprint_names_weights_dtype_block_size_and_layout():
    model = torch.nn.Linear(4, 4)
    cache = torch.zeros(2, 2, 8, 4, 2, 8)
    base = kv_fingerprint(model, cache, 4)
    assert base == kv_fingerprint(model, cache.clone(), 4)
    assert base != kv_fingerprint(model, cache.to(torch.bfloat16), 4)
    assert base != kv_fingerprint(model, cache, 8)
    assert base != kv_fingerprint(model, torch.zeros(2, 2, 8, 4, 1, 16), 4)
    with torch.no_grad():
        model.weight[0, 0] += 1
    assert base != kv_fingerprint(model, cache, 4)
