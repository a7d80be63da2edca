"""API parity for agent, RAG and evaluation clients: prompt logprobs and echo against
transformers, content parts, token controls, chat controls, token ids, truncation, and a 400 for
every option that is not honoured. One server on a random-weight test checkpoint."""

from __future__ import annotations

import itertools
import json
import math

import httpx
import openai
import pytest
import torch
from checkpoints import hf_logits, load_hf_model, make_checkpoint
from servers import server_process

from prefixserve import LLM, SamplingParams
from prefixserve.core.errors import InvalidArgumentError
from prefixserve.engine.chat_template import detect_content_format, render_chat
from prefixserve.models.builtin import builtin_tokenizer

MODEL = "parity-model"
USER = [{"role": "user", "content": "Tell me about prefix caching."}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("parity")
    return make_checkpoint("qwen2", folder, seed=5, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def hf(checkpoint):
    return load_hf_model(checkpoint)


@pytest.fixture(scope="module")
def server(checkpoint):
    with server_process("--model", str(checkpoint), "--served-model-name", MODEL) as (_, base):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def hf_prompt_logprobs(hf, ids: list[int]) -> list[float]:
    logprobs = torch.log_softmax(hf_logits(hf, ids), dim=-1)
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


# ---- prompt logprobs ------------------------------------------------------------------------


@pytest.mark.parametrize("caching", [True, False])
def test_prompt_logprobs_equal_transformers_even_when_the_prefix_is_cached(checkpoint, hf, caching):
    llm = LLM(checkpoint, enable_prefix_caching=caching, max_num_batched_tokens=48)
    prompt = list(range(10, 110))
    llm.generate([prompt[:70] + [5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)
    entries = out[0].prompt_logprobs
    assert out[0].num_cached_tokens == 0  # scored prompts are computed in full, in chunks
    assert len(entries) == len(prompt) and entries[0] is None
    got = [entry[token] for entry, token in zip(entries[1:], prompt[1:])]
    assert max(abs(a - b) for a, b in zip(got, hf_prompt_logprobs(hf, prompt))) < 1e-3
    assert all(len(entry) in (3, 4) for entry in entries[1:])  # the token plus the top 3


def test_echo_with_logprobs_scores_the_prompt_first(client, server, hf):
    prompt = list(range(40, 90))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, logprobs=1,
                                  echo=True, temperature=0)  # fmt: skip
    lps = r.choices[0].logprobs
    assert len(lps.tokens) == len(prompt) + 1 and lps.token_logprobs[0] is None
    assert lps.top_logprobs[0] is None and lps.text_offset[0] == 0
    reference = hf_prompt_logprobs(hf, prompt)
    assert max(abs(a - b) for a, b in zip(lps.token_logprobs[1:-1], reference)) < 1e-3
    body = httpx.post(f"{server}/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2,
    }).json()  # fmt: skip
    scored = body["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(prompt)
    first = scored[1][str(prompt[1])]
    assert abs(first["logprob"] - reference[0]) < 1e-3 and set(first) == {
        "logprob", "rank", "decoded_token"
    }  # fmt: skip


def test_lm_evaluation_harness_scores_equal_transformers(server, checkpoint, hf):
    """lm-eval's ``local-completions`` (echo, logprobs=1, max_tokens=1), unchanged."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        model=MODEL, base_url=f"{server}/v1/completions", tokenizer=str(checkpoint),
        tokenizer_backend="huggingface", tokenized_requests=True, max_length=1024,
    )  # fmt: skip
    pairs = [
        ("The capital of France is", " Paris"),
        ("1 2 3 4 5", " 6 7"),
        ("Prefix caching makes agents", " fast and cheap."),
    ]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    results = lm.loglikelihood(requests)
    for (context, continuation), (ll, greedy) in zip(pairs, results):
        ctx, cont = lm._encode_pair(context, continuation)
        logprobs = torch.log_softmax(hf_logits(hf, ctx + cont), dim=-1)
        rows = range(len(ctx) - 1, len(ctx) + len(cont) - 1)
        reference = sum(logprobs[r, t].item() for r, t in zip(rows, cont))
        reference_greedy = all(logprobs[r].argmax().item() == t for r, t in zip(rows, cont))
        assert abs(ll - reference) < 1e-2 and greedy == reference_greedy
    rolling = lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, ("A short text to score as a whole.",), 0)]
    )
    assert len(rolling) == 1 and math.isfinite(rolling[0]) and rolling[0] < 0
    text = "Once upon a time"
    generated = lm.generate_until(
        [Instance("generate_until", {}, (text, {"until": ["e"], "max_gen_toks": 16}), 0)]
    )
    assert len(generated) == 1 and "e" not in generated[0]


# ---- content parts -----------------------------------------------------------------------------

PARTS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for p in m['content'] %}{{ p['text'] }}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("template", [None, PARTS_TEMPLATE], ids=["string", "parts"])
def test_content_parts_render_as_the_same_text(template):
    tok = builtin_tokenizer()
    if template is not None:
        tok.chat_template = template
    assert detect_content_format(tok.chat_template) == ("string" if template is None else "openai")
    as_text = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"}]
    as_parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    if template is not None:  # a parts template joins parts itself, with nothing between
        as_text[1]["content"] = "ab"
    assert render_chat(tok, as_parts) == render_chat(tok, as_text)
    with pytest.raises(InvalidArgumentError, match="accepts text only"):
        render_chat(tok, [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


CONCAT_TEMPLATE = (  # SmolLM2's way: the content concatenated, so it must be a string
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
)


@pytest.mark.parametrize("missing", [{}, {"content": None}], ids=["absent", "null"])
def test_a_tool_calling_turn_without_content_renders_as_no_text(missing):
    tok = builtin_tokenizer()
    tok.chat_template = CONCAT_TEMPLATE
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turn = {"role": "assistant", "tool_calls": [call], **missing}
    rendered = render_chat(tok, [{"role": "user", "content": "hi"}, turn], add_generation_prompt=False)
    with_empty = render_chat(tok, [{"role": "user", "content": "hi"}, {**turn, "content": ""}],
                             add_generation_prompt=False)  # fmt: skip
    assert rendered == with_empty


def test_content_parts_over_http(server, client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me about "},
                                          {"type": "text", "text": "prefix caching."}]}]  # fmt: skip
    joined = [{"role": "user", "content": "Tell me about \nprefix caching."}]
    counts = [httpx.post(f"{server}/tokenize", json={"messages": m}).json()["tokens"]
              for m in (parts, joined)]  # fmt: skip
    assert counts[0] == counts[1]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": MODEL, "messages": image})
    assert r.status_code == 400 and "accepts text only" in r.json()["error"]["message"]


# ---- token controls ---------------------------------------------------------------------------


def test_logit_bias_forces_and_bans(client):
    forced = client.completions.create(model=MODEL, prompt="x", max_tokens=5, temperature=1.0,
                                       seed=1, logit_bias={"300": 100},
                                       extra_body={"return_token_ids": True})  # fmt: skip
    assert forced.choices[0].model_extra["token_ids"] == [300] * 5
    free = client.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=0,
                                     extra_body={"return_token_ids": True})  # fmt: skip
    banned_id = free.choices[0].model_extra["token_ids"][0]
    banned = client.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=0,
                                       logit_bias={str(banned_id): -100},
                                       extra_body={"return_token_ids": True})  # fmt: skip
    assert banned_id not in banned.choices[0].model_extra["token_ids"]


def test_allowed_token_ids_and_bad_words_hold_at_temperature_one(checkpoint):
    llm = LLM(checkpoint)
    allowed = [11, 22, 33]
    outs = llm.generate(["Sample: "] * 8, [SamplingParams(max_tokens=12, temperature=1.0, seed=s,
                        allowed_token_ids=allowed) for s in range(8)], use_tqdm=False)  # fmt: skip
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in outs)
    tok = llm.get_tokenizer()

    def runs(params):
        outs = llm.generate(["Sample: "] * 8, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    def contains(ids: list[int], seq: list[int]) -> bool:
        return any(ids[i : i + len(seq)] == seq for i in range(len(ids)))

    free = runs([SamplingParams(max_tokens=30, temperature=1.0, seed=s) for s in range(8)])
    # a two-token word the model wrote, that the tokenizer writes as those two tokens
    word = next(
        text for ids in free for pair in itertools.pairwise(ids)
        if tok.encode(text := tok.decode(list(pair)), add_special_tokens=False) == list(pair)
        and text.strip() == text
    )  # fmt: skip
    banned = tok.encode(word, add_special_tokens=False)
    assert any(contains(ids, banned) for ids in free)
    outs = runs([SamplingParams(max_tokens=30, temperature=1.0, seed=s, bad_words=[word])
                 for s in range(8)])  # fmt: skip
    spaced = tok.encode(" " + word, add_special_tokens=False)
    assert not any(contains(ids, banned) or contains(ids, spaced) for ids in outs)


def test_min_tokens_still_holds_with_token_controls(checkpoint):
    llm = LLM(checkpoint)
    eos = llm.llm_engine.eos_token_ids
    out = llm.generate("x", SamplingParams(max_tokens=6, min_tokens=6, temperature=0,
                       logit_bias={t: 100 for t in eos}), use_tqdm=False)[0]  # fmt: skip
    assert len(out.outputs[0].token_ids) == 6 and not set(out.outputs[0].token_ids) & eos


# ---- chat controls and plumbing ---------------------------------------------------------------


def test_continue_final_message_leaves_the_turn_open(server, checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    messages = [*USER, {"role": "assistant", "content": "Prefix caching is"}]
    reference = tok.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    reference = tok(reference, add_special_tokens=False).input_ids
    r = httpx.post(f"{server}/tokenize", json={
        "messages": messages, "add_generation_prompt": False, "continue_final_message": True,
        "return_token_strs": True,
    }).json()  # fmt: skip
    assert r["tokens"] == reference and len(r["token_strs"]) == len(reference)
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "echo": True,
            "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
    out = httpx.post(f"{server}/v1/chat/completions", json=body).json()
    assert out["choices"][0]["message"]["content"].startswith("Prefix caching is")
    assert out["usage"]["prompt_tokens"] == len(reference)
    both = httpx.post(f"{server}/v1/chat/completions", json={**body, "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_token_ids_truncation_and_token_id_strings(server, client):
    prompt = list(range(100, 160))
    out = httpx.post(f"{server}/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 3, "truncate_prompt_tokens": 20,
        "return_token_ids": True, "logprobs": 1, "return_tokens_as_token_ids": True,
    }).json()  # fmt: skip
    choice = out["choices"][0]
    assert choice["prompt_token_ids"] == prompt[-20:] and out["usage"]["prompt_tokens"] == 20
    assert len(choice["token_ids"]) == 3
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, logprobs=True,
                                          extra_body={"return_token_ids": True,
                                                      "return_tokens_as_token_ids": True})  # fmt: skip
    assert chat.model_extra["prompt_token_ids"] and chat.choices[0].model_extra["token_ids"]
    assert chat.choices[0].logprobs.content[0].token.startswith("token_id:")


def test_continuous_usage_stats_on_every_chunk(client):
    stream = client.completions.create(
        model=MODEL, prompt="count", max_tokens=5, temperature=0, stream=True, logprobs=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )  # fmt: skip
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    # A slow reader may get several steps' tokens in one chunk: usage counts what was sent so far.
    sent, seen = 0, []
    for c in (c for c in chunks if c.choices):
        sent += len(c.choices[0].logprobs.tokens)
        seen.append((c.usage.completion_tokens, sent))
    assert all(usage == count for usage, count in seen) and sent == 5
    assert chunks[-1].usage.completion_tokens == 5


def test_a_stop_token_id_leaves_its_text_out(checkpoint):
    llm = LLM(checkpoint)
    free = llm.generate("x", SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    stop = free.outputs[0].token_ids[2]
    tok = llm.get_tokenizer()
    out = llm.generate("x", SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[stop]),
                       use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert out.stop_reason == stop and out.text == tok.decode(free.outputs[0].token_ids[:2])
    kept = llm.generate("x", SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[stop],
                        include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert kept.text == tok.decode(free.outputs[0].token_ids[:3])


# ---- honour or refuse ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
        ("completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
        ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("completions", {"allowed_token_ids": []}, "allowed_token_ids"),
        ("completions", {"allowed_token_ids": [-3]}, "allowed_token_ids"),
        ("completions", {"allowed_token_ids": [10**9]}, "allowed_token_ids"),
        ("completions", {"bad_words": [""]}, "bad_words"),
        ("completions", {"prompt_logprobs": 99}, "prompt_logprobs"),
        ("completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ("completions", {"suffix": "tail"}, "suffix"),
        ("completions", {"best_of": 3}, "best_of"),
        ("completions", {"logits_processors": ["x"]}, "logits_processors"),
        ("completions", {"use_beam_search": True, "n": 2, "logit_bias": {"5": 1}}, "logit_bias"),
        ("chat/completions", {"audio": {"voice": "x"}}, "audio"),
        ("chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        ("chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("chat/completions", {"prediction": {"type": "content"}}, "prediction"),
        ("chat/completions", {"reasoning_effort": "extreme"}, "reasoning_effort"),
        ("chat/completions", {"store": True}, "store"),
        ("chat/completions", {"priority": 5}, "priority"),
    ],
)
def test_unsupported_or_invalid_options_are_400s(server, path, body, param):
    base = {"prompt": "x"} if path == "completions" else {"messages": USER}
    r = httpx.post(f"{server}/v1/{path}", json={"model": MODEL, "max_tokens": 2, **base, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert httpx.get(f"{server}/health").status_code == 200


def test_harmless_values_of_refused_fields_are_accepted(server):
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, "modalities": ["text"],
            "store": False, "best_of": 1, "metadata": {"k": "v"}, "service_tier": "auto",
            "some_undocumented_extra": 1}  # fmt: skip
    r = httpx.post(f"{server}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert json.loads(r.text)["choices"][0]["message"]["content"] is not None
