"""The offline API: ``LLM(...).generate(prompts, SamplingParams(...))``, ``chat``, ``beam_search``."""

from __future__ import annotations

import itertools

from tqdm.auto import tqdm

from prefixserve.core.config import EngineConfig
from prefixserve.core.errors import InvalidArgumentError
from prefixserve.core.inputs import PromptType, parse_prompts
from prefixserve.core.outputs import RequestOutput
from prefixserve.core.sampling_params import BeamSearchParams, SamplingParams
from prefixserve.engine.chat_template import render_chat
from prefixserve.engine.llm_engine import LLMEngine


class LLM:
    """An engine in this process. ``model=None`` uses the built-in ``prefixserve/tiny-random``.

    Keyword options are those of ``EngineConfig``: block_size, max_model_len, num_kv_blocks,
    kv_cache_memory_gb, max_num_seqs, max_num_batched_tokens, enable_prefix_caching,
    enable_chunked_prefill, scheduling_policy, device, dtype, seed, attention_backend, ...;
    the KV tiers: kv_offloading_size, kv_offloading_dtype, kv_cache_dir, kv_cache_dir_size,
    kv_shared_url (docs/kv-tiers.md).
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._request_ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def cache_stats(self) -> dict:
        """Prefix-cache counters (in tokens) and block usage; see ``KVCacheManager.stats``."""
        return self.llm_engine.cache_stats()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def release_kv(self, session: str) -> int:
        """Drop what ``session`` retained (``SamplingParams.kv_retention``); the number of
        blocks released. They stay cached as ordinary blocks."""
        return self.llm_engine.release_kv(session)

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string, token ids, or vLLM's ``{"prompt": ...}`` /
        ``{"prompt_token_ids": [...]}``: see ``prefixserve.core.inputs``); outputs in their order."""
        prompt_list = parse_prompts(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, list):
            if len(params) != len(prompt_list):
                raise InvalidArgumentError(
                    f"sampling_params: got {len(params)} for {len(prompt_list)} prompts",
                    "sampling_params",
                )
            param_list = params
        else:
            param_list = [params] * len(prompt_list)
        return self._run(prompt_list, param_list, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_content_format: str = "auto",
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Render one conversation or a list of them with the tokenizer's chat template (see
        ``prefixserve.engine.chat_template``), then generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tokenizer = self.get_tokenizer()
        prompts = [
            render_chat(
                tokenizer,
                conv,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                content_format=chat_template_content_format,
                chat_template_kwargs=chat_template_kwargs,
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(
        self, prompts: PromptType | list[PromptType], params: BeamSearchParams
    ) -> list[RequestOutput]:
        """Beam search inside the engine on forked sequences; each output's beams are best first."""
        prompt_list = parse_prompts(prompts)
        return self._run(prompt_list, [params] * len(prompt_list), use_tqdm=False)

    def _run(
        self, prompts: list[str | list[int]], params: list, use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        # every prompt is prepared (and its grammar compiled) before anything is queued, so a
        # bad one raises with nothing left running
        prepared = [engine.preprocessor.process(prompt, p) for prompt, p in zip(prompts, params)]
        for request in prepared:
            if request.grammar is not None:
                request.grammar.result()  # raises the compile's InvalidArgumentError
        ids = []
        try:
            for request in prepared:
                rid = str(next(self._request_ids))
                engine.add_request(rid, request)
                ids.append(rid)
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2)
        try:
            while len(finished) < len(ids):
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in finished:
                    engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in ids]
