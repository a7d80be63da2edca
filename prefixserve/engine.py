"""LLMEngine: add requests, step the batch, stream ``RequestOutput`` s. The server drives this loop.

One ``step()``::

    Scheduler.schedule()  -> which sequences run, how many tokens each, block copies; blocks
                             that this step fills are registered in the prefix cache already
    ModelRunner.execute() -> copies, one forward over the flattened batch, logits of samplers
    Scheduler.update_computed() -> num_computed_tokens advance
    fork n>1 groups whose prompt just finished
    OutputProcessor.process() -> sample, append, detokenize, check stops, free finished sequences
    BeamSearchStepper.step()  -> the same for beam-search groups
    finish requests whose sequences all finished; a request whose processing failed ends alone
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass

import torch

from prefixserve.beam_search import BeamSearchStepper
from prefixserve.config import EngineConfig
from prefixserve.detokenizer import IncrementalDetokenizer
from prefixserve.errors import CacheCapacityError, InvalidArgumentError, PromptTooLongError
from prefixserve.kv.kv_cache_manager import KVCacheManager
from prefixserve.model_runner import ModelRunner
from prefixserve.models.loader import load_tokenizer
from prefixserve.output_processor import OutputProcessor, describe_error
from prefixserve.outputs import CompletionOutput, RequestOutput
from prefixserve.sampler import Sampler
from prefixserve.sampling_params import BeamSearchParams, SamplingParams
from prefixserve.scheduler import ScheduledSeq, Scheduler
from prefixserve.sequence import Request, Sequence

logger = logging.getLogger(__name__)


@dataclass
class EngineCounters:
    """Monotonic counters the metrics layer exports."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    computed_prompt_tokens: int = 0
    num_steps: int = 0


@dataclass
class StepTimes:
    """Cumulative wall time of ``step()`` by phase, in seconds (``benchmarks/step_profile.py``).

    ``prepare`` and ``forward`` are measured inside the model runner; on CUDA, ``forward`` ends when
    the sampler first reads its results back, so part of it may show up under ``sample``.
    """

    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    output: float = 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.model_config = self.runner.model_config
        self.model_name = config.served_model_name or self.runner.model_name
        self.tokenizer = load_tokenizer(config.tokenizer or config.model, revision=config.revision)
        self.max_model_len = self._resolve_max_model_len()
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(config, self.kv)
        self.sampler = Sampler()
        self.beam_stepper = BeamSearchStepper(self)
        self.output_processor = OutputProcessor(self)
        self.requests: dict[str, Request] = {}
        self.counters = EngineCounters()
        self.step_times = StepTimes()
        self._seq_ids = itertools.count()
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        torch.manual_seed(config.seed)

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        if self.config.max_model_len is None:
            return limit
        if self.config.max_model_len > limit:
            raise InvalidArgumentError(
                f"max_model_len: {self.config.max_model_len} exceeds the model's "
                f"max_position_embeddings ({limit})",
                param="max_model_len",
            )
        return self.config.max_model_len

    # ---- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | BeamSearchParams,
    ) -> Request:
        """Validate and queue a request. Raises a typed error (and queues nothing) on bad input."""
        if request_id in self.requests:
            raise InvalidArgumentError(f"request_id {request_id!r} is already in use", "request_id")
        text, token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids, params)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
        max_total = min(len(token_ids) + max_tokens, self.max_model_len)
        self._check_fits(len(token_ids), max_total, params)
        salt = params.cache_salt
        request = Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            extra_keys=(salt,) if salt is not None else (),
            max_total_tokens=max_total,
        )
        request.seqs.append(self.new_sequence(request, 0, list(token_ids)))
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        self.counters.prompt_tokens += len(token_ids)
        return request

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return None, list(prompt)
        raise InvalidArgumentError("prompt: must be a string or a list of token ids", "prompt")

    def _check_prompt(
        self, token_ids: list[int], params: SamplingParams | BeamSearchParams
    ) -> None:
        if not token_ids:
            raise InvalidArgumentError("prompt: must not be empty", "prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgumentError(
                f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", "prompt"
            )
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens, and the "
                f"prompt has {len(token_ids)} tokens; shorten the prompt",
                "prompt",
            )
        if (
            not self.config.enable_chunked_prefill
            and len(token_ids) > self.config.max_num_batched_tokens
        ):
            raise PromptTooLongError(
                f"prompt: {len(token_ids)} tokens exceed max_num_batched_tokens="
                f"{self.config.max_num_batched_tokens} with chunked prefill disabled",
                "prompt",
            )
        bad_stop = [t for t in getattr(params, "stop_token_ids", []) if not 0 <= t < vocab]
        if bad_stop:
            raise InvalidArgumentError(
                f"stop_token_ids: {bad_stop} outside the vocabulary [0, {vocab})", "stop_token_ids"
            )

    def _check_fits(self, num_prompt: int, max_total: int, params) -> None:
        width = params.beam_width if isinstance(params, BeamSearchParams) else params.n
        if width > min(self.config.max_num_seqs, self.config.max_num_batched_tokens):
            raise InvalidArgumentError(
                f"n / beam_width: {width} sequences cannot run together with max_num_seqs="
                f"{self.config.max_num_seqs} and max_num_batched_tokens="
                f"{self.config.max_num_batched_tokens}",
                "n",
            )
        bs = self.config.block_size
        shared = num_prompt // bs
        needed = shared + width * (math.ceil(max_total / bs) - shared)
        if needed > self.kv.num_blocks - self.kv.watermark_blocks:
            raise CacheCapacityError(
                f"this request needs up to {needed} KV blocks ({width} sequences of up to "
                f"{max_total} tokens) but the cache has {self.kv.num_blocks}; lower max_tokens or "
                "n, or give the engine more KV blocks"
            )

    def new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        params = request.params
        seq = Sequence(
            seq_id=next(self._seq_ids),
            index=index,
            token_ids=token_ids,
            num_prompt_tokens=len(request.prompt_token_ids),
        )
        if isinstance(params, SamplingParams):
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                stop=params.stop,
                skip_special_tokens=params.skip_special_tokens,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            if params.seed is not None:
                seq.generator = torch.Generator(self.runner.device)
                seq.generator.manual_seed(_derive_seed(params.seed, index))
            if params.logprobs is not None:
                seq.logprobs = []
        return seq

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output, None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.live_seqs():
            seq.finish_reason = "abort"
        self.scheduler.finish_request(request)
        return self._make_output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        times = self.step_times
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        block_tables = {s.seq.seq_id: self.kv.get_block_table(s.seq.seq_id) for s in out.scheduled}
        t1 = time.perf_counter()
        times.schedule += t1 - t0
        samplers, logits = self.runner.execute(out, block_tables, times)
        t2 = time.perf_counter()
        self.counters.computed_prompt_tokens += self.scheduler.update_computed(out)
        self.counters.num_steps += 1
        touched: dict[str, Request] = {}
        rows: list[tuple[Request, Sequence, int]] = []
        beam_rows: dict[str, list[tuple[Sequence, int]]] = {}
        for i, sched in enumerate(samplers):
            request = sched.request
            touched[request.request_id] = request
            if request.is_beam_search:
                beam_rows.setdefault(request.request_id, []).append((sched.seq, i))
                continue
            for seq in self._fork_if_first_sample(request, sched):
                rows.append((request, seq, i))
        now = time.monotonic()
        for request in touched.values():
            if request.first_token_time is None:
                request.first_token_time = now
        failed = self.output_processor.process(rows, logits)
        for rid, group_rows in beam_rows.items():
            try:
                self.beam_stepper.step(touched[rid], group_rows, logits)
            except Exception as exc:
                failed[rid] = describe_error(exc, "beam search")
        t3 = time.perf_counter()
        times.sample += t3 - t2
        outputs = []
        for request in touched.values():
            if request.request_id in failed:
                outputs.append(self._fail_request(request, failed[request.request_id]))
                continue
            if all(s.is_finished for s in request.seqs) and not request.is_finished:
                self.scheduler.finish_request(request)
                self.requests.pop(request.request_id, None)
            outputs.append(self._make_output(request))
        times.output += time.perf_counter() - t3
        return outputs

    def _fail_request(self, request: Request, message: str) -> RequestOutput:
        """One request's processing failed: finish it with an error; the batch carries on."""
        logger.error("request %s failed: %s", request.request_id, message)
        for seq in request.live_seqs():
            seq.finish_reason = "abort"
        if not request.is_finished:
            self.scheduler.finish_request(request)
        self.requests.pop(request.request_id, None)
        output = self._make_output(request)
        output.error = message
        return output

    def _fork_if_first_sample(self, request: Request, sched: ScheduledSeq) -> list[Sequence]:
        """The prompt of an n>1 request is computed once; its n samples fork from it here."""
        seq = sched.seq
        if len(request.seqs) >= request.num_samples or seq.num_output_tokens > 0:
            return [seq]
        children = []
        for index in range(1, request.num_samples):
            child = self.new_sequence(request, index, list(seq.token_ids))
            child.num_computed_tokens = seq.num_computed_tokens
            child.block_hashes = list(seq.block_hashes)
            self.scheduler.fork_seq(seq, child)
            request.seqs.append(child)
            children.append(child)
        return [seq, *children]

    def _make_output(self, request: Request) -> RequestOutput:
        if request.is_beam_search:
            outputs = self.beam_stepper.outputs(request)
        else:
            outputs = [
                CompletionOutput(
                    index=s.index,
                    text=s.detokenizer.output_text,
                    token_ids=s.output_token_ids,
                    cumulative_logprob=s.cumulative_logprob,
                    logprobs=list(s.logprobs) if s.logprobs is not None else None,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
                for s in sorted(request.seqs, key=lambda s: s.index)
            ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.is_finished,
            num_cached_tokens=request.num_cached_tokens or 0,
        )

    def cache_stats(self) -> dict:
        return self.kv.stats()

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()


def _derive_seed(seed: int, index: int) -> int:
    """Sample ``index`` of a seeded request gets its own stream; sample 0 uses the seed itself."""
    return seed if index == 0 else (seed * 1_000_003 + index) % (2**63)
