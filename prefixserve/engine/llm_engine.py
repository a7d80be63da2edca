"""LLMEngine: add requests, step the batch, stream ``RequestOutput`` s. The server drives this loop.

One ``step()`` is a straight line; every stage hands the next one a value::

    Scheduler.schedule()             -> SchedulerOutput: sequences, token counts, block tables,
                                        copy-on-write copies (blocks this step fills are already
                                        registered in the prefix cache)
    ModelRunner.execute()            -> ModelRunnerOutput: the logits of the sequences that sample
    SamplingStep.sample()            -> SamplingResult: tokens (+ logprobs), beam steps, failures
    Scheduler.update_from_output()   -> the requests it touched: tokens appended, blocks hashed,
                                        forks, stops, frees, finished requests
    OutputProcessor.make_outputs()   -> the RequestOutput each touched request's kind calls for

With tiers under the KV pool (``prefixserve.kv.tiers``), blocks the pool evicts are copied out
right after ``schedule()`` (before the forward can overwrite them) and the step's new blocks
right after ``update_from_output()``; the tier worker stores them and loads blocks back for
waiting requests while steps run. A step with nothing to run while loads are in flight waits
for one (briefly), so the serving loop does not spin.

Validation happens before a request is queued, in ``RequestPreprocessor.process`` (which
``add_request`` runs for a raw prompt): a request the engine accepts can fail later only alone
(``RequestOutput.error``), never the loop. A step whose forward (or sampling) raises is rolled
back (``Scheduler.abandon_step``): no block it registered stays in the prefix cache and its
requests are queued again; ``StepFailedError`` (or a ``KeyboardInterrupt`` as it was) tells the
caller, which retries them with the next ``step()`` or aborts them.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import torch

from prefixserve.core.config import EngineConfig
from prefixserve.core.detokenizer import IncrementalDetokenizer
from prefixserve.core.errors import InvalidArgumentError, StepFailedError
from prefixserve.core.outputs import RequestOutput
from prefixserve.core.sampling_params import BeamSearchParams, SamplingParams
from prefixserve.core.sequence import Request, Sequence
from prefixserve.engine.output_processor import OutputProcessor
from prefixserve.engine.preprocessor import PreparedRequest, RequestPreprocessor, StepLimits
from prefixserve.engine.scheduler import KVUsage, Scheduler
from prefixserve.engine.stop_checker import StopChecker
from prefixserve.kv.kv_cache_manager import KVCacheManager
from prefixserve.kv.retention import RetentionTable
from prefixserve.kv.segment_bounds import break_token_ids
from prefixserve.kv.segments import SegmentReuse
from prefixserve.kv.tiers import build_kv_tiers
from prefixserve.kv.tiers.events import record_tier_events
from prefixserve.models.loader import load_tokenizer
from prefixserve.runner.model_runner import ModelRunner
from prefixserve.sample.sampler import Sampler
from prefixserve.sample.sampling_step import SamplingStep
from prefixserve.structured_outputs.manager import StructuredOutputManager
from prefixserve.structured_outputs.request import StructuredOutputRequest

logger = logging.getLogger(__name__)

LOAD_WAIT_S = 0.005  # an idle step waits this long at most for a tier load


@dataclass
class StepTimes:
    """Cumulative wall time of ``step()`` by phase, in seconds (``benchmarks/step_profile.py``).

    ``prepare`` and ``forward`` are measured inside the model runner; on CUDA, ``forward`` ends when
    the sampler first reads its results back, so part of it may show up under ``sample``.
    ``sample`` covers sampling and the scheduler's update; ``output`` building the outputs.
    """

    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    output: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One consistent snapshot of the engine: what the server, the dashboard and the benchmarks
    read. Counters are monotonic; ``kv_cache`` is ``KVCacheManager.stats()``."""

    num_running: int
    num_waiting: int
    num_preemptions: int
    prompt_tokens: int
    computed_prompt_tokens: int
    generation_tokens: int
    num_steps: int
    kv_cache: dict[str, int | float]
    step_times: StepTimes
    # requests by kind ("json", "regex", ...), compiles, cache hits, the compile-time histogram
    structured_outputs: dict[str, Any]
    # speculative decoding (``DraftProposer.snapshot``: counters, the suffix index's memory);
    # None when it is off
    spec_decode: dict[str, Any] | None = None
    # replayed decode steps (``DecodeReplay.stats``: kind, buckets, capture seconds, steps);
    # None when every step runs eagerly
    decode_replay: dict[str, Any] | None = None
    # the tiers under the KV pool (``KVTierManager.stats``); None without any
    kv_tiers: dict[str, Any] | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.model_config = self.runner.model_config
        self.model_name = config.served_model_name or self.runner.model_name
        self.tokenizer = load_tokenizer(config.tokenizer or config.model, revision=config.revision)
        self.max_model_len = config.resolve_max_model_len(self.model_config.max_position_embeddings)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.kv_events, self.kv_event_publisher = self._kv_events(config)
        retention = RetentionTable(
            int(config.kv_retention_budget * self.runner.num_blocks),
            default_ttl_s=config.kv_retention_default_ttl_s,
            max_ttl_s=config.kv_retention_max_ttl_s,
            learn_ttl=config.kv_retention_learn_ttl,
            max_sessions_per_tenant=config.kv_retention_max_sessions,
        )
        self.kv_tiers = build_kv_tiers(config, self.runner.model, self.runner.kv_caches, retention)
        kv_cache_manager = KVCacheManager(
            self.runner.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            kv_events=self.kv_events,
            tiers=self.kv_tiers,
            retention=retention,
        )
        self.scheduler = Scheduler(config, kv_cache_manager, StopChecker(self.eos_token_ids),
                                   self._segment_reuse(config))  # fmt: skip
        self.structured_outputs = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids)
        )
        self._structured_requests: Counter[str] = Counter()
        self.preprocessor = RequestPreprocessor(
            self.tokenizer,
            self.model_config.vocab_size,
            self.max_model_len,
            StepLimits.of(config),
            self.structured_outputs,
        )
        self.sampling_step = SamplingStep(
            Sampler(), self.eos_token_ids, self.structured_outputs, self.tokenizer
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.step_times = StepTimes()
        self.num_steps = 0
        torch.manual_seed(config.seed)
        self._publish_kv_events()  # what a restart found in the disk tier

    def _segment_reuse(self, config: EngineConfig) -> SegmentReuse | None:
        """The segment index (``segment_reuse``), its break tokens read from the tokenizer."""
        if not config.segment_reuse:
            return None
        ids = list(range(len(self.tokenizer)))
        texts = self.tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)
        return SegmentReuse(config.block_size, break_token_ids(zip(ids, texts)))

    @staticmethod
    def _kv_events(config: EngineConfig):
        """The recorder the block pool reports to and the publisher of its events, or Nones."""
        if config.kv_events_endpoint is None:
            return None, None
        from prefixserve.kv.kv_event_publisher import KVEventPublisher
        from prefixserve.kv.kv_events import KVEventRecorder

        publisher = KVEventPublisher(
            config.kv_events_endpoint, replay_endpoint=config.kv_events_replay_endpoint
        )
        return KVEventRecorder(), publisher

    def _publish_kv_events(self) -> None:
        if self.kv_tiers is not None:
            tier_events = self.kv_tiers.take_events()
            if self.kv_events is not None:
                record_tier_events(self.kv_events, tier_events)
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(self.kv_events.take())

    def shutdown(self) -> None:
        """Stop the grammar compiler's threads, the KV-event publisher and the tier worker
        (after it wrote what is queued) (idempotent)."""
        self.structured_outputs.shutdown()
        if self.kv_tiers is not None:
            self.kv_tiers.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()

    # ---- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | PreparedRequest,
        params: SamplingParams | BeamSearchParams | None = None,
    ) -> Request:
        """Queue a request: a ``PreparedRequest`` as it is, or a prompt and its ``params`` through
        ``self.preprocessor`` first. Raises a typed error (and queues nothing) on bad input."""
        if isinstance(prompt, PreparedRequest):
            prepared = prompt
        else:
            if params is None:
                raise InvalidArgumentError("params: required with a prompt", "params")
            prepared = self.preprocessor.process(prompt, params)
        params = prepared.params
        if isinstance(params, BeamSearchParams) and self.config.speculative_config is not None:
            raise InvalidArgumentError(
                "beam search is not supported with speculative decoding; serve without "
                "--speculative-config for beam search",
                "use_beam_search",
            )
        token_ids = list(prepared.prompt_token_ids)
        self.scheduler.check_fits(len(token_ids), prepared.max_total_tokens, prepared.width)
        salt = params.cache_salt
        request = Request(
            request_id=request_id,
            prompt=prepared.prompt,
            prompt_token_ids=token_ids,
            params=params,
            extra_keys=(salt,) if salt is not None else (),
            max_total_tokens=prepared.max_total_tokens,
            seqs=[self._prompt_sequence(token_ids, params)],
            generators=self._generators(params),
            structured_output=self._structured_output(prepared),
            bad_words_token_ids=[list(ids) for ids in prepared.bad_words_token_ids],
        )
        if isinstance(params, SamplingParams) and params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        self.scheduler.add_request(request)
        if request.structured_output is not None:
            self._structured_requests[request.structured_output.params.kind] += 1
        return request

    def _prompt_sequence(
        self, token_ids: list[int], params: SamplingParams | BeamSearchParams
    ) -> Sequence:
        seq = Sequence(index=0, token_ids=list(token_ids), num_prompt_tokens=len(token_ids))
        if isinstance(params, SamplingParams):
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                token_ids,
                stop=params.stop,
                skip_special_tokens=params.skip_special_tokens,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            if params.logprobs is not None:
                seq.logprobs = []
        return seq

    def _generators(self, params: SamplingParams | BeamSearchParams) -> list | None:
        """A seeded request's generators: sample ``j`` draws from its own stream."""
        if not isinstance(params, SamplingParams) or params.seed is None:
            return None
        generators = []
        for index in range(params.n):
            generator = torch.Generator(self.runner.device)
            generator.manual_seed(_derive_seed(params.seed, index))
            generators.append(generator)
        return generators

    def _structured_output(self, prepared: PreparedRequest) -> StructuredOutputRequest | None:
        """The request's grammar, compiling off this thread (submitted by the preprocessor)."""
        if prepared.grammar is None:
            return None
        so = prepared.params.structured_outputs
        return StructuredOutputRequest(so, prepared.grammar, self.structured_outputs.new_grammar)

    def abort_request(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (failed with
        ``error`` if given), None if unknown."""
        request = self.scheduler.abort_request(request_id, error)
        if request is None:
            return None
        return self.output_processor.make_outputs([request])[0]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        times = self.step_times
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        tiers = self.kv_tiers
        if scheduler_output.is_empty:
            if tiers is not None and tiers.has_loads_in_flight():
                tiers.wait_for_loads(LOAD_WAIT_S)
                self._publish_kv_events()
            return []
        t1 = time.perf_counter()
        try:
            if tiers is not None:
                tiers.flush()  # evicted blocks out before the forward can overwrite them
            runner_output = self.runner.execute(scheduler_output)
            t2 = time.perf_counter()
            sampled = self.sampling_step.sample(
                runner_output.samplers, runner_output.logits, runner_output.prompt_logits
            )
        except Exception as exc:
            self.scheduler.abandon_step(scheduler_output)
            raise StepFailedError(
                f"the engine step failed: {exc!r}",
                list(dict.fromkeys(s.request.request_id for s in scheduler_output.scheduled)),
                self.output_processor.make_outputs(scheduler_output.finished),
            ) from exc
        except BaseException:  # KeyboardInterrupt: roll back, let it through as it is
            self.scheduler.abandon_step(scheduler_output)
            raise
        touched = self.scheduler.update_from_output(scheduler_output, sampled)
        rows = sum(s.num_new_tokens + len(s.draft_token_ids) for s in scheduler_output.scheduled)
        if (proposer := self.scheduler.proposer) is not None:
            proposer.observe_step(rows, runner_output.forward_seconds)  # what a row costs
        if tiers is not None:
            tiers.flush()  # the step's new blocks, written through to disk / shared
            tiers.observe_forward(
                sum(s.num_new_tokens for s in scheduler_output.scheduled),
                runner_output.forward_seconds,
            )
        t3 = time.perf_counter()
        outputs = self.output_processor.make_outputs(touched)
        times.schedule += t1 - t0
        times.prepare += runner_output.prepare_seconds
        times.forward += runner_output.forward_seconds
        times.sample += t3 - t2
        times.output += time.perf_counter() - t3
        self.num_steps += 1
        self._publish_kv_events()
        return outputs

    # ---- figures -------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_preemptions=s.num_preemptions,
            prompt_tokens=s.prompt_tokens,
            computed_prompt_tokens=s.computed_prompt_tokens,
            generation_tokens=s.generation_tokens,
            num_steps=self.num_steps,
            kv_cache=s.kv_cache,
            step_times=replace(self.step_times),
            structured_outputs={
                "requests": dict(self._structured_requests),
                **self.structured_outputs.stats(),
            },
            spec_decode=proposer.snapshot()
            if (proposer := self.scheduler.proposer) is not None
            else None,
            decode_replay=replay.stats()
            if (replay := self.runner.decode_replay) is not None
            else None,
            kv_tiers=self.kv_tiers.stats() if self.kv_tiers is not None else None,
        )

    def kv_usage(self) -> KVUsage:
        """How the live sequences use the KV cache now (slower than ``stats``: for benchmarks)."""
        return self.scheduler.kv_usage()

    def cache_stats(self) -> dict:
        return self.scheduler.stats().kv_cache

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (the host and disk tiers' too); refused (False) while any
        block is in use."""
        reset = self.scheduler.reset_prefix_cache()
        self._publish_kv_events()
        return reset

    # ---- retention (the protocol fronts map cache_control / prompt_cache_retention here) ------

    def release_kv(self, session: str) -> int:
        """Drop what ``session`` retained (its blocks stay cached as ordinary blocks); the
        number of blocks released."""
        return self.scheduler.release_kv(session)

    def rename_kv(self, session: str, name: str) -> None:
        """What ``session`` retained is held under ``name`` instead (a reply's provisional
        pause named after the tool call it ended with)."""
        self.scheduler.rename_kv(session, name)


def _derive_seed(seed: int, index: int) -> int:
    """Sample ``index`` of a seeded request gets its own stream; sample 0 uses the seed itself."""
    return seed if index == 0 else (seed * 1_000_003 + index) % (2**63)
