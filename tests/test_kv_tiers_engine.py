"""The KV tiers end to end on a random checkpoint: a pool far smaller than the sessions, so their
prefixes leave the pool and come back from the host, disk or shared (Valkey) tier. Tokens equal
those of the same engine without tiers (greedy; logprobs within 1e-5), with forks, partial
tails, speculative decoding and grammars; faults (corrupt files, a full disk, the Valkey server
killed mid-run, another dtype in the folder) are misses, never wrong tokens; a restart serves
the next turn from disk and announces its blocks; one tenant's blocks never reach another."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

import pytest
import torch
from checkpoints import make_checkpoint
from valkey_server import ValkeyProcess

from prefixserve import LLM, SamplingParams
from prefixserve.kv.kv_event_publisher import KVEventSubscriber
from prefixserve.kv.kv_events import BlockStored
from prefixserve.kv.retention import KVRetention
from prefixserve.kv.tiers.base import TierUnavailableError
from prefixserve.kv.tiers.cost import LoadCost
from prefixserve.kv.tiers.disk import DiskTier
from prefixserve.structured_outputs.params import StructuredOutputsParams

BLOCK = 16
POOL = 24  # blocks: about three of the six sessions
NEW = [11, 12, 13, 14, 15]
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "draft_row_price": 0.0}  # fmt: skip


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(autouse=True)
def loads_always_pay(monkeypatch):
    """These tests check what loads do (exact tokens, hits), not whether one pays: on a tiny
    model that depends on the machine's timing (``LoadCost``, tested in test_kv_tier_units)."""
    monkeypatch.setattr(LoadCost, "worth_loading", lambda self, medium: True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_checkpoint("llama", tmp_path_factory.mktemp("tiers-model"), seed=3))


@pytest.fixture
def valkey_server(tmp_path):
    server = ValkeyProcess(tmp_path)
    yield server
    server.kill()


def _llm(model: str, **kw) -> LLM:
    return LLM(model, block_size=BLOCK, num_kv_blocks=POOL, **kw)


def _one(llm: LLM, prompt: list[int], params: SamplingParams | None = None):
    return llm.generate([prompt], params or _greedy(), use_tqdm=False)[0]


def _sessions(llm: LLM, num: int = 6, salt: str | None = None) -> list:
    """Two turns of ``num`` sessions, one request at a time (so both engines run the same
    batch shapes); the second turn resends the first's prompt and output."""
    params = _greedy()
    params.cache_salt = salt
    outs, follows = [], []
    for s in range(num):
        prompt = [1, 2, 3, 4] * 4 + _prompt(74, s)  # a shared first block, then the session's
        first = _one(llm, prompt, params)
        outs.append(first)
        follows.append(prompt + list(first.outputs[0].token_ids) + NEW)
    outs += [_one(llm, follow, params) for follow in follows]
    return outs


def _assert_same(got, expected) -> None:
    for a, b in zip(got, expected, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids
            if y.logprobs is not None:
                drift = max(abs(pa[t] - pb[t]) for pa, pb in zip(x.logprobs, y.logprobs)
                            for t in pb)  # fmt: skip
                assert drift <= 1e-5


def _tier(llm: LLM, medium: str) -> dict:
    return llm.llm_engine.stats().kv_tiers["tiers"][medium]


def _close(*llms: LLM) -> None:
    for llm in llms:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("tier", ["host", "disk", "shared"])
def test_tokens_equal_without_tiers_and_second_turns_hit(model, tmp_path, tier, request):
    kw = {
        "host": lambda: {"kv_offloading_size": 0.05},
        "disk": lambda: {"kv_cache_dir": str(tmp_path / "kv")},
        "shared": lambda: {"kv_shared_url": request.getfixturevalue("valkey_server").url},
    }[tier]()
    plain = _llm(model)
    expected = _sessions(plain)
    tiered = _llm(model, **kw)
    got = _sessions(tiered)
    _assert_same(got, expected)
    medium = {"host": "CPU_TIER", "disk": "DISK", "shared": "SHARED"}[tier]
    assert _tier(tiered, medium)["hits"] >= 6 * 5  # the second turns' prefixes came back
    second_turns = slice(6, 12)
    hits = sum(o.num_cached_tokens for o in got[second_turns])
    assert hits > sum(o.num_cached_tokens for o in expected[second_turns]) + 6 * 4 * BLOCK
    _close(plain, tiered)


def test_forks_tails_and_grammars_are_exact_with_a_host_tier(model):
    seeded = SamplingParams(max_tokens=6, temperature=0.8, seed=5, n=3, ignore_eos=True)
    grammar = SamplingParams(
        max_tokens=12, temperature=0.0,
        structured_outputs=StructuredOutputsParams(regex="[a-e]{3,8}"),
    )  # fmt: skip

    def run(llm: LLM) -> list:
        outs = _sessions(llm)
        first = [1, 2, 3, 4] * 4 + _prompt(74, 0)
        follow = first + list(outs[0].outputs[0].token_ids) + NEW
        return outs + [_one(llm, follow, seeded), _one(llm, follow + [9], grammar)]

    plain, tiered = _llm(model), _llm(model, kv_offloading_size=0.05)
    _assert_same(run(tiered), run(plain))
    assert _tier(tiered, "CPU_TIER")["hits"] > 0
    _close(plain, tiered)


def test_speculative_decoding_is_exact_with_a_disk_tier(model, tmp_path):
    plain = _llm(model, speculative_config=SPEC)
    tiered = _llm(model, speculative_config=SPEC, kv_cache_dir=str(tmp_path))
    _assert_same(_sessions(tiered), _sessions(plain))
    assert _tier(tiered, "DISK")["hits"] > 0
    _close(plain, tiered)


def test_compressed_host_tier_holds_more_and_keeps_greedy_tokens_close(model):
    plain, int8 = _llm(model), _llm(model, kv_offloading_size=0.05, kv_offloading_dtype="int8")
    expected, got = _sessions(plain), _sessions(int8)
    agree = [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(got, expected)]
    assert sum(agree) >= len(agree) - 2  # lossy: measured on SmolLM2 in docs/kv-tiers.md
    host = _tier(int8, "CPU_TIER")
    assert host["hits"] > 0 and host["bytes"] < host["blocks"] * 2 * 2 * BLOCK * 2 * 16 * 4 / 3
    _close(plain, int8)


# ---- faults ------------------------------------------------------------------------------------


def test_corrupt_files_are_misses_never_wrong_tokens(model, tmp_path):
    plain = _llm(model)
    expected = _sessions(plain)
    tiered = _llm(model, kv_cache_dir=str(tmp_path))
    prompts_only = _sessions(tiered)[:6]  # fills the disk tier
    tiered.llm_engine.kv_tiers.close()  # everything written
    _close(tiered)
    files = sorted(tmp_path.rglob("*.kvb"))
    assert len(files) > 20
    for i, path in enumerate(files):  # flip a byte or truncate every file
        data = bytearray(path.read_bytes())
        if i % 2:
            data[len(data) // 2 + i] ^= 0x40
        else:
            del data[len(data) - 64 :]
        path.write_bytes(bytes(data))
    again = _llm(model, kv_cache_dir=str(tmp_path))
    _assert_same(prompts_only + _sessions(again)[6:], expected)
    assert _tier(again, "DISK")["corrupt"] >= 6  # every second turn met a damaged file first
    _close(plain, again)


def test_a_full_disk_costs_hits_not_tokens(model, tmp_path, monkeypatch, caplog):
    def full(self, key, payload):
        raise TierUnavailableError("No space left on device")

    monkeypatch.setattr(DiskTier, "put", full)
    plain, tiered = _llm(model), _llm(model, kv_cache_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="prefixserve.kv.tiers.manager"):
        _assert_same(_sessions(tiered), _sessions(plain))
    assert _tier(tiered, "DISK")["store_errors"] > 0
    assert "No space left" in caplog.text
    _close(plain, tiered)


def test_another_model_in_the_same_folder_never_loads(model, tmp_path, tmp_path_factory):
    """Same tokens, same hashes, other weights: its own fingerprint folder, no hit. (Another
    dtype or block size changes the fingerprint the same way: test_kv_tier_units.py.)"""
    first = _llm(model, kv_cache_dir=str(tmp_path))
    _sessions(first)
    _close(first)
    other_model = str(make_checkpoint("llama", tmp_path_factory.mktemp("other"), seed=4))
    other = _llm(other_model, kv_cache_dir=str(tmp_path))
    plain = _llm(other_model)
    got, expected = _sessions(other)[:6], _sessions(plain)[:6]
    _assert_same(got, expected)
    assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in expected]
    assert len({p.parent for p in tmp_path.rglob("*.kvb")}) == 2  # one folder per fingerprint
    _close(other, plain)


def test_valkey_killed_mid_run_engine_goes_on_without_it(model, valkey_server, caplog):
    plain = _llm(model)
    expected = _sessions(plain)
    tiered = _llm(model, kv_shared_url=valkey_server.url)
    first = [_one(tiered, [1, 2, 3, 4] * 4 + _prompt(74, s)) for s in range(3)]
    valkey_server.kill()
    with caplog.at_level(logging.WARNING, logger="prefixserve.kv.tiers.shared"):
        rest = _sessions(tiered)
    _assert_same(first, expected[:3])
    _assert_same(rest, expected)
    shared = _tier(tiered, "SHARED")
    assert shared["available"] is False and "unreachable" in caplog.text
    _close(plain, tiered)


# ---- restart, replicas, tenants, retention -----------------------------------------------------


def test_warm_restart_serves_the_next_turn_from_disk_and_announces_it(model, tmp_path):
    before = _llm(model, kv_cache_dir=str(tmp_path))
    first_turns = _sessions(before)[:6]
    _close(before)  # the worker drains its queue: every computed block is on disk
    (next(tmp_path.rglob("*.kvb")).parent / "x.kvb.1.2.tmp").write_bytes(b"a write cut short")
    after = _llm(
        model, kv_cache_dir=str(tmp_path),
        kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay_endpoint="tcp://127.0.0.1:*",
    )  # fmt: skip
    publisher = after.llm_engine.kv_event_publisher
    with KVEventSubscriber(
        publisher.endpoint, replay_endpoint=publisher.replay_endpoint, start_seq=0
    ) as sub:
        _, batch = sub.recv(timeout_s=5)
    announced = [e for e in batch.events if isinstance(e, BlockStored)]
    assert announced and all(e.medium == "DISK" for e in announced)
    assert sum(len(e.block_hashes) for e in announced) == _tier(after, "DISK")["blocks"]
    assert not list(tmp_path.rglob("*.tmp"))
    plain = _llm(model)
    expected = _sessions(plain)
    follows = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) + NEW for o in first_turns]
    got = [_one(after, f) for f in follows]
    _assert_same(got, expected[6:])
    computed = [len(o.prompt_token_ids) + 8 - 1 for o in first_turns]
    served = sum(o.num_cached_tokens for o in got) / sum(c // BLOCK * BLOCK for c in computed)
    assert served >= 0.95
    _close(after, plain)


def test_two_replicas_share_blocks_through_valkey_under_one_secret(model, valkey_server):
    shared = {"kv_shared_url": valkey_server.url, "kv_tier_secret": "replicas' secret"}
    a, b = _llm(model, **shared), _llm(model, **shared)
    stranger = _llm(model, kv_shared_url=valkey_server.url)  # no secret: one of its own
    prompt = [1, 2, 3, 4] * 4 + _prompt(100, 1)
    _one(a, prompt)
    a.llm_engine.kv_tiers.close()  # flushed to the server
    assert _one(stranger, prompt + NEW).num_cached_tokens == 0
    out = _one(b, prompt + NEW)
    assert out.num_cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK
    assert _tier(b, "SHARED")["hits"] == (len(prompt) - 1) // BLOCK
    _assert_same([out], [_one(plain := _llm(model), prompt + NEW)])
    _close(a, b, stranger, plain)


def test_tenants_never_share_blocks_through_any_tier(model, tmp_path, valkey_server):
    tiered = _llm(
        model, kv_offloading_size=0.05, kv_cache_dir=str(tmp_path), kv_shared_url=valkey_server.url
    )
    _sessions(tiered, salt="tenant-a")  # every tier now holds tenant a's prefixes
    stats = tiered.llm_engine.stats().kv_tiers["tiers"]
    loaded = sum(t["hits"] for t in stats.values())
    other = _sessions(tiered, num=6, salt="tenant-b")
    assert all(o.num_cached_tokens < 2 * BLOCK for o in other[:6])  # b's own shared block only
    assert sum(t["hits"] for t in tiered.llm_engine.stats().kv_tiers["tiers"].values()) - loaded \
        <= 6 * 6  # fmt: skip
    _close(tiered)


def test_retained_prefix_survives_a_flood_and_release_drops_it(model):
    llm = _llm(model)
    system = _prompt(96, 42)
    retain = KVRetention(ttl_s=60, session="agent")
    params = SamplingParams(max_tokens=2, temperature=0.0, kv_retention=retain)
    _one(llm, system + [7], params)
    for s in range(8):  # unrelated requests fill the pool several times over
        _one(llm, _prompt(90, 100 + s))
    assert _one(llm, system + [8]).num_cached_tokens == 96
    assert llm.llm_engine.stats().kv_cache["retained_blocks"] == 6
    assert llm.release_kv("agent") == 6
    for s in range(8):
        _one(llm, _prompt(90, 200 + s))
    assert _one(llm, system + [9]).num_cached_tokens == 0
    _close(llm)


# ---- off the step path -------------------------------------------------------------------------


def test_a_request_waits_for_its_load_while_others_run(model, tmp_path, monkeypatch):
    """Its blocks come from a slow disk: the step never waits for them; an unrelated request
    runs meanwhile; once they are in the pool the waiting request runs on them. A request
    aborted while its load is in flight leaves nothing behind."""
    plain = _llm(model)
    expected = _sessions(plain)
    llm = _llm(model, kv_cache_dir=str(tmp_path))
    first_turns = _sessions(llm)[:6]
    llm.llm_engine.kv_tiers.close()  # everything on disk; a fresh engine reads it from there
    _close(llm)
    engine = _llm(model, kv_cache_dir=str(tmp_path)).llm_engine
    gate = threading.Event()
    real_get = DiskTier.get
    monkeypatch.setattr(DiskTier, "get", lambda self, key: gate.wait(30) and real_get(self, key))
    follow = list(first_turns[0].prompt_token_ids) + list(first_turns[0].outputs[0].token_ids)
    engine.add_request("aborted", follow + [99], _greedy())
    engine.add_request("waits", follow + NEW, _greedy())
    engine.add_request("runs", _prompt(40, 77), _greedy(3))
    engine.abort_request("aborted")
    seen: dict[str, list] = {"waits": [], "runs": []}
    while not seen["runs"] or not seen["runs"][-1].finished:
        for out in engine.step():
            seen[out.request_id].append(out)
    assert not seen["waits"] and engine.stats().num_waiting == 1  # "runs" finished first
    gate.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    waited = seen["waits"][-1]
    assert waited.num_cached_tokens >= (len(follow) - 1) // BLOCK * BLOCK
    _assert_same([waited], [expected[6]])
    assert engine.scheduler.kv._finished_loads == set() == engine.scheduler.kv._cancelled_loads
    engine.shutdown()
    _close(plain)


def test_an_offline_llm_never_shut_down_leaves_its_blocks_on_disk(model, tmp_path):
    script = (
        "from prefixserve import LLM, SamplingParams\n"
        f"llm = LLM({model!r}, block_size={BLOCK}, num_kv_blocks={POOL}, kv_cache_dir={str(tmp_path)!r})\n"
        "llm.generate([list(range(3, 3 + 161))], SamplingParams(max_tokens=2), use_tqdm=False)\n"
    )  # the script ends right after the request: the stores still queued are written at exit
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    assert len(list(tmp_path.rglob("*.kvb"))) == 10  # 161 + 1 computed tokens: 10 full blocks
