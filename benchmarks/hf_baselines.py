"""The transformers baselines: what a Python user runs instead of prefixserve, on the same weights.

    python benchmarks/hf_baselines.py [--quick] [--threads 2]

Two static-batching servers built on ``model.generate`` (greedy, EOS ignored, float32, sdpa):

* ``hf-no-reuse``: a FIFO queue served in batches of ``batch_size``, prompts left-padded with an
  attention mask; every prompt is computed in full.
* ``hf-prefix-cache``: each group's shared prefix (a system prompt, a document set) is prefilled once
  into a ``DynamicCache``; a batch takes queued requests of one group (and one prompt length), gets
  a ``copy.deepcopy`` of the group's cache repeated along the batch, and ``generate`` continues from
  it with the full ``input_ids``. This is the best a user does by hand with transformers.

A request is submitted at the run's start (or, for follow-ups, when the request it follows
finishes); its TTFT ends when its batch's first token is computed (measured by a logits processor
that notes the time of its first call), its finish time when its batch returns.

Run as a script, it checks both baselines against prefixserve on a few prompts sharing a prefix
and prints the greedy agreement.
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from collections import deque

import torch
import transformers
from bench_model import (
    DEFAULT_MODEL_DIR,
    BenchRequest,
    FollowUp,
    ensure_checkpoint,
    load_hf_model,
    make_engine,
    run_engine,
    set_threads,
)
from report import agreement


class _FirstTokenClock(transformers.LogitsProcessor):
    """Notes when ``generate`` first asks for logits processing: the prefill forward has ended."""

    def __init__(self) -> None:
        self.time: float | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.time is None:
            self.time = time.perf_counter()
        return scores


class HFServer:
    """A static-batching server around one transformers model. ``prefix_len`` enables prefix reuse.

    ``prefix_len[group]`` is the length of a group's shared prefix (its system prompt or documents);
    the requests of one group share it token for token.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        batch_size: int,
        pad_token_id: int,
        prefix_len: dict[str, int] | None = None,
    ) -> None:
        self.model = model
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id
        self.prefix_len = prefix_len
        self.generation_config = copy.deepcopy(model.generation_config)
        # EOS ignored, as in prefixserve's runs. None would be filled in from the checkpoint's
        # generation config, so EOS is an id the model cannot produce.
        self.generation_config.eos_token_id = model.config.vocab_size
        self.generation_config.pad_token_id = pad_token_id
        self.generation_config.do_sample = False
        self._prefix_caches: dict[str, transformers.DynamicCache] = {}

    def run(
        self, requests: list[BenchRequest], follow_up: FollowUp | None = None
    ) -> tuple[list[BenchRequest], float]:
        """Serve ``requests`` (all submitted now) and their follow-ups; returns them and wall time.

        Every run starts cold: prefix caches of an earlier run are dropped first."""
        self._prefix_caches.clear()
        start = time.perf_counter()
        queue: deque[BenchRequest] = deque()
        for req in requests:
            req.submit_time = start
            queue.append(req)
        done: list[BenchRequest] = []
        while queue:
            batch = self._take_batch(queue)
            self._generate(batch)
            for req in batch:
                done.append(req)
                nxt = follow_up(req) if follow_up is not None else None
                if nxt is not None:
                    nxt.submit_time = req.finish_time
                    queue.append(nxt)
        return done, time.perf_counter() - start

    def _take_batch(self, queue: deque[BenchRequest]) -> list[BenchRequest]:
        head = queue.popleft()
        batch = [head]
        if self.prefix_len is None:
            while queue and len(batch) < self.batch_size:
                batch.append(queue.popleft())
            return batch
        rest: deque[BenchRequest] = deque()
        while queue:
            req = queue.popleft()
            same = req.group == head.group and len(req.prompt) == len(head.prompt)
            if same and len(batch) < self.batch_size:
                batch.append(req)
            else:
                rest.append(req)
        queue.extend(rest)
        return batch

    @torch.no_grad()
    def _generate(self, batch: list[BenchRequest]) -> None:
        clock = _FirstTokenClock()
        max_new = max(r.max_tokens for r in batch)
        kwargs: dict = {}
        if self.prefix_len is None:
            width = max(len(r.prompt) for r in batch)
            ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, r in enumerate(batch):
                ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt)
                mask[i, width - len(r.prompt) :] = 1
        else:
            ids = torch.tensor([r.prompt for r in batch])
            mask = torch.ones_like(ids)
            cache = copy.deepcopy(self._prefix_cache(batch[0]))
            cache.batch_repeat_interleave(len(batch))
            kwargs["cache"] = cache
        config = copy.copy(self.generation_config)
        config.max_new_tokens = max_new
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=config,
            logits_processor=transformers.LogitsProcessorList([clock]),
            **kwargs,
        )
        finish = time.perf_counter()
        for i, r in enumerate(batch):
            r.first_token_time = clock.time
            r.finish_time = finish
            r.output = out[i, ids.shape[1] : ids.shape[1] + r.max_tokens].tolist()

    def _prefix_cache(self, req: BenchRequest) -> transformers.DynamicCache:
        """The group's prefix KV, computed at the group's first batch (its cost counts in the run)."""
        cache = self._prefix_caches.get(req.group)
        if cache is None:
            assert self.prefix_len is not None
            n = self.prefix_len[req.group]
            if not 0 < n < len(req.prompt):
                raise ValueError(f"group {req.group!r}: prefix {n} must be shorter than the prompt")
            cache = transformers.DynamicCache(config=self.model.config)
            self.model(torch.tensor([req.prompt[:n]]), cache=cache, use_cache=True)
            self._prefix_caches[req.group] = cache
        return cache


def pad_token_id(model: torch.nn.Module) -> int:
    """A token to left-pad with (masked out): the first EOS id of the checkpoint."""
    eos = model.config.eos_token_id
    return eos[0] if isinstance(eos, list) else int(eos)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="4 prompts of 80 tokens, 8 outputs")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    folder = ensure_checkpoint(args.model_dir)
    prefix_len, question_len, out_len, n = (64, 16, 8, 4) if args.quick else (512, 32, 32, 8)
    rng = random.Random(0)
    prefix = [rng.randrange(10, 700) for _ in range(prefix_len)]

    def requests() -> list[BenchRequest]:
        q = random.Random(1)
        return [
            BenchRequest(
                f"r{i}", prefix + [q.randrange(10, 700) for _ in range(question_len)], out_len, "g"
            )
            for i in range(n)
        ]

    ref, _ = run_engine(make_engine(folder), requests())
    model = load_hf_model(folder)
    result = {}
    for name, lens in (("hf-no-reuse", None), ("hf-prefix-cache", {"g": prefix_len})):
        got, _ = HFServer(model, n, pad_token_id(model), lens).run(requests())
        result[name] = agreement(ref, got)
    print(
        f"greedy agreement with prefixserve ({n} prompts, {prefix_len}+{question_len} tokens, "
        f"{out_len} out, float32): "
        + ", ".join(
            f"{k} {v['requests_pct']:.0f}% requests / {v['tokens_pct']:.1f}% tokens"
            for k, v in result.items()
        )
    )
    return result


if __name__ == "__main__":
    main()
