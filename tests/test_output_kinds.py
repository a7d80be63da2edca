"""``RequestOutputKind``: deltas concatenate to the cumulative output, final-only is one output
equal to the cumulative last, and the progress observer sees every request whatever its kind."""

from __future__ import annotations

from dataclasses import replace

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.core.sampling_params import BeamSearchParams, RequestOutputKind

PROMPTS = [[5, 9, 14, 3] * 9, [7, 1, 2] * 5]  # one longer than a chunk, one short


@pytest.fixture(scope="module")
def llm():
    # no prefix cache: each run computes the same batches, so the kinds see the same numbers
    return LLM(
        num_kv_blocks=256, block_size=16, max_num_batched_tokens=24, enable_prefix_caching=False
    )


def _run(llm: LLM, params) -> dict[str, list]:
    """Every output of each request, step by step (request id -> outputs in order)."""
    engine = llm.llm_engine
    got: dict[str, list] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
        got[f"r{i}"] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].append(out)
    return got


def _sampling(kind: RequestOutputKind) -> SamplingParams:
    return SamplingParams(n=2, seed=3, temperature=0.9, max_tokens=20, logprobs=2,
                          stop=["e"], output_kind=kind)  # fmt: skip


def test_deltas_concatenate_to_the_cumulative_output(llm):
    whole = _run(llm, _sampling(RequestOutputKind.CUMULATIVE))
    deltas = _run(llm, _sampling(RequestOutputKind.DELTA))
    for rid, outs in deltas.items():
        final = whole[rid][-1]
        assert len(outs) == len(whole[rid]) and outs[-1].finished
        assert sum(o.finished for o in outs) == 1
        for c in final.outputs:
            pieces = [d for o in outs for d in o.outputs if d.index == c.index]
            assert "".join(d.text for d in pieces) == c.text
            assert [t for d in pieces for t in d.token_ids] == c.token_ids
            assert [lp for d in pieces for lp in d.logprobs] == c.logprobs
            assert pieces[-1].finish_reason == c.finish_reason
            assert pieces[-1].stop_reason == c.stop_reason
        # some step carried more than nothing and less than everything
        assert any(0 < len(d.token_ids) < len(c.token_ids) for o in outs for d in o.outputs
                   for c in final.outputs if c.index == d.index)  # fmt: skip
        assert outs[-1].num_cached_tokens == final.num_cached_tokens


def test_final_only_is_one_output_equal_to_the_cumulative_last(llm):
    whole = _run(llm, _sampling(RequestOutputKind.CUMULATIVE))
    final = _run(llm, _sampling(RequestOutputKind.FINAL_ONLY))
    for rid, outs in final.items():
        assert len(outs) == 1 and outs[0].finished
        assert outs[0].outputs == whole[rid][-1].outputs


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_beam_search_outputs_once_at_the_end(llm, kind):
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    whole = _run(llm, params)
    outs = _run(llm, replace(params, output_kind=kind))
    for rid in outs:
        assert len(outs[rid]) == 1 and outs[rid][0].outputs == whole[rid][-1].outputs


def test_the_observer_sees_final_only_requests_every_step(llm):
    seen: list = []
    engine = llm.llm_engine
    engine.output_processor.observer = lambda progress, now: seen.extend(progress)
    try:
        outs = _run(llm, _sampling(RequestOutputKind.FINAL_ONLY))
    finally:
        engine.output_processor.observer = None
    for rid, (out,) in outs.items():
        mine = [p for p in seen if p.request_id == rid]
        counts = [p.num_output_tokens for p in mine]
        assert counts == sorted(counts) and counts[-1] == sum(len(c.token_ids) for c in out.outputs)
        assert len({c for c in counts if c > 0}) > 1  # it progressed over several steps
        assert [p.finished for p in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].finish_reason == out.outputs[0].finish_reason


def test_adding_the_deltas_gives_the_cumulative_outputs(llm):
    whole = _run(llm, _sampling(RequestOutputKind.CUMULATIVE))
    deltas = _run(llm, _sampling(RequestOutputKind.DELTA))
    for rid, outs in deltas.items():
        total = outs[0]
        for out, expected in zip(outs[1:], whole[rid][1:]):
            total = total.add(out)
            assert total.outputs == expected.outputs and total.finished == expected.finished
