"""A step whose forward raises leaves nothing behind: no block it registered stays in the prefix
cache, nothing is freed twice, and the engine (offline and behind the server's loop) keeps
serving exact results."""

from __future__ import annotations

import asyncio

import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.api.async_engine import AsyncEngine
from prefixserve.api.engine_client import RequestFailedError
from prefixserve.core.errors import StepFailedError
from prefixserve.kv.hashing import extend_block_hashes
from prefixserve.kv.kv_cache_manager import KVCacheManager

BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _fail_once(llm_engine, exc: BaseException, after: int = 0):
    """Make the runner's ``execute`` raise ``exc`` on its call number ``after`` (0-based)."""
    real = llm_engine.runner.execute
    calls = [0]

    def execute(scheduler_output):
        calls[0] += 1
        if calls[0] == after + 1:
            raise exc
        return real(scheduler_output)

    llm_engine.runner.execute = execute


def _assert_clean(llm: LLM) -> None:
    stats = llm.cache_stats()
    assert stats["used_blocks"] == 0
    assert stats["free_blocks"] + stats["cached_blocks"] == stats["num_blocks"]
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def reference() -> list[int]:
    """Greedy tokens of a fresh engine for the 100-token prompt."""
    llm = LLM(block_size=BLOCK, num_kv_blocks=64)
    return llm.generate([_prompt(100)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("exc", [RuntimeError("device fault"), KeyboardInterrupt()])
def test_failed_prefill_leaves_no_cached_block(reference, exc):
    """The issue's reproduction: the prefill of a 100-token prompt fails; the same prompt again
    finds nothing cached (the 96 tokens' blocks were never written) and is exact."""
    llm = LLM(block_size=BLOCK, num_kv_blocks=64)
    _fail_once(llm.llm_engine, exc)
    expected = StepFailedError if isinstance(exc, Exception) else KeyboardInterrupt
    with pytest.raises(expected):
        llm.generate([_prompt(100)], GREEDY, use_tqdm=False)
    _assert_clean(llm)
    assert llm.cache_stats()["cached_blocks"] == 0 and llm.cache_stats()["tail_blocks"] == 0
    out = llm.generate([_prompt(100)], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == reference
    again = llm.generate([_prompt(100)], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 99  # the successful run's blocks and partial tail count
    assert again.outputs[0].token_ids == reference
    _assert_clean(llm)


def test_failed_decode_keeps_blocks_written_before(reference):
    """A failure in a later (decode) step unregisters only what that step registered: the
    prompt's blocks, written by the successful prefill, stay cached and exact."""
    llm = LLM(block_size=BLOCK, num_kv_blocks=64)
    _fail_once(llm.llm_engine, RuntimeError("late fault"), after=3)
    with pytest.raises(StepFailedError):
        llm.generate([_prompt(100)], GREEDY, use_tqdm=False)
    _assert_clean(llm)
    out = llm.generate([_prompt(100)], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 96
    assert out.outputs[0].token_ids == reference


def test_same_step_hit_is_undone_with_its_step():
    """Two requests with one 64-token prefix are admitted in one step (the second hits the
    first's blocks in that step). The step fails: neither request keeps a hit, and the retry
    (the engine's next step, driven by hand) is exact."""
    prompts = [_prompt(64) + [7, 8, 9], _prompt(64) + [10, 11]]
    fresh = LLM(block_size=BLOCK, num_kv_blocks=64)
    ref = [o.outputs[0].token_ids for o in fresh.generate(prompts, GREEDY, use_tqdm=False)]

    llm = LLM(block_size=BLOCK, num_kv_blocks=64)
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    _fail_once(engine, RuntimeError("fault"))
    with pytest.raises(StepFailedError) as info:
        engine.step()
    assert info.value.request_ids == ["0", "1"]
    assert engine.cache_stats()["cached_blocks"] == 0
    assert engine.stats().num_waiting == 2 and engine.stats().num_running == 0
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert [finals[str(i)].outputs[0].token_ids for i in range(2)] == ref
    # retried, the second request hits the first's blocks again (the same step's hit)
    assert finals["0"].num_cached_tokens == 0 and finals["1"].num_cached_tokens == 64
    _assert_clean(llm)


def test_discard_step_unregisters_only_this_steps_blocks():
    """KVCacheManager's journal, without tensors: blocks registered before the step stay,
    those registered in it go (a cached one back to the free queue), marks are restored."""
    kv = KVCacheManager(8, 4)
    tokens = list(range(12))
    hashes: list = []
    extend_block_hashes(tokens, 4, (), hashes)
    assert kv.allocate_for_prompt("a", kv.lookup(tokens, hashes), 12)
    kv.cache_full_blocks("a", tokens, hashes, 4)
    kv.commit_step()
    kv.cache_full_blocks("a", tokens, hashes, 12)
    assert len(kv.pool.hashed_blocks()) == 3
    kv.discard_step()
    assert list(kv.pool.hashed_blocks()) == hashes[:1]
    kv.cache_full_blocks("a", tokens, hashes, 12)  # the mark was restored: registers again
    assert len(kv.pool.hashed_blocks()) == 3
    kv.commit_step()
    kv.discard_step()  # nothing journaled any more
    assert len(kv.pool.hashed_blocks()) == 3
    kv.free("a")
    assert kv.pool.num_cached_blocks == 3
    b = KVCacheManager(8, 4)
    assert b.allocate_for_prompt("x", b.lookup(tokens, hashes), 12)
    b.cache_full_blocks("x", tokens, hashes, 12)
    b.free("x")  # cached, evictable, before the step's end
    b.discard_step()
    assert b.pool.num_cached_blocks == 0 and b.pool.num_free_blocks == 8


def test_server_loop_fails_the_steps_requests_and_keeps_serving(reference):
    """Behind the server's loop a failed step ends its requests with a 500; the next request
    with the same prompt is exact and finds nothing from the failed step cached."""
    llm = LLM(block_size=BLOCK, num_kv_blocks=64)
    _fail_once(llm.llm_engine, RuntimeError("device fault"))

    async def run() -> None:
        engine = AsyncEngine(llm.llm_engine)
        engine.start()
        try:
            stream = await engine.add("a", _prompt(100), GREEDY)
            with pytest.raises(RequestFailedError, match="device fault"):
                async for _ in stream:
                    pass
            stream = await engine.add("b", _prompt(100), GREEDY)
            outs = [o async for o in stream]
            assert outs[-1].num_cached_tokens == 0
            assert outs[-1].outputs[0].token_ids == reference
            assert engine.dead is None
        finally:
            engine.stop()

    asyncio.run(run())
    _assert_clean(llm)
