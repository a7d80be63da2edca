"""A pause on a tool call rides on the request: the engine applies it (prompt and reply) when
the request retires, only to a reply that stopped, and a later request's ``kv_resume`` ends it;
renaming keeps its blocks (``Scheduler._retain``, ``add_request``, ``LLMEngine.rename_kv``)."""

from __future__ import annotations

from prefixserve import LLM, SamplingParams
from prefixserve.kv.retention import KVRetention

PROMPT = [5, 9, 14, 3] * 10  # 40 tokens: two full blocks of 16


def _llm() -> LLM:
    return LLM(num_kv_blocks=64, block_size=16)


def _pause(session: str) -> KVRetention:
    return KVRetention(ttl_s=None, include_output=True, session=session)


def test_a_pause_holds_the_prompt_and_reply_of_a_reply_that_stopped_only():
    llm = _llm()
    table = llm.llm_engine.scheduler.kv.retention
    first = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    token = first[0].outputs[0].token_ids[0]
    # stopped on a stop token (as a reply ending in a call stops): prompt + reply retained
    stopped = SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[token],
                             kv_retention=_pause("s/~a"))  # fmt: skip
    (out,) = llm.generate([PROMPT], stopped, use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and len(table) == 2
    # cut off by max_tokens: no call can have ended it, nothing is retained
    cut = SamplingParams(max_tokens=2, temperature=0, kv_retention=_pause("s/~b"))
    (out,) = llm.generate([PROMPT[:-1]], cut, use_tqdm=False)
    assert out.outputs[0].finish_reason == "length" and out.kv_retained_tokens == (None,)
    assert len(table) == 2


def test_a_renamed_pause_ends_when_a_request_resumes_it():
    llm = _llm()
    engine, table = llm.llm_engine, llm.llm_engine.scheduler.kv.retention
    token = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0),
                         use_tqdm=False)[0].outputs[0].token_ids[0]  # fmt: skip
    paused = SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[token],
                            kv_retention=_pause("s/~a"))  # fmt: skip
    llm.generate([PROMPT], paused, use_tqdm=False)
    engine.rename_kv("s/~a", "s/call_1")
    assert engine.release_kv("s/~a") == 0 and len(table) == 2
    resumed = SamplingParams(max_tokens=1, temperature=0, kv_resume=["s/call_1"])
    llm.generate([PROMPT + [token, 7]], resumed, use_tqdm=False)
    assert len(table) == 0 and table.released == 2
