"""The structured-output paths of the libraries agent builders use, unchanged, against a real
``prefixserve serve`` on the built-in random-weight model: each must get back a valid object.

openai SDK ``chat.completions.parse`` (json_schema), instructor (JSON_SCHEMA and TOOLS modes), the
OpenAI Agents SDK (``OpenAIChatCompletionsModel`` with an ``output_type``), LangChain's
``with_structured_output`` (json_schema and function_calling), pydantic-ai's default structured
output (a forced tool call) and LiteLLM (json_schema, and forced tool calls streamed). Without the server's constraint none of them could parse a reply.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
from pydantic import BaseModel, Field
from servers import MODEL, launch_server

PROMPT = "Invent a person: give a name and an age."


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def server():
    with launch_server() as base:
        yield f"{base}/v1"


def test_openai_sdk_parse(server):
    client = openai.OpenAI(base_url=server, api_key="unused", max_retries=0)
    for seed in (0, 1):
        completion = client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], response_format=Person,
            seed=seed,
        )  # fmt: skip
        assert isinstance(completion.choices[0].message.parsed, Person)


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor(server, mode):
    import instructor

    client = instructor.from_openai(
        openai.OpenAI(base_url=server, api_key="unused", max_retries=0),
        mode=getattr(instructor.Mode, mode),
    )
    person = client.chat.completions.create(
        model=MODEL, response_model=Person, max_retries=0,
        messages=[{"role": "user", "content": PROMPT}],
    )  # fmt: skip
    assert isinstance(person, Person)


def test_openai_agents_sdk_output_type(server):
    from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # no trace export: the machine is offline
    model = OpenAIChatCompletionsModel(
        model=MODEL, openai_client=openai.AsyncOpenAI(base_url=server, api_key="unused")
    )
    agent = Agent(name="people", instructions="Answer with a person.", model=model,
                  output_type=Person)  # fmt: skip
    result = asyncio.run(Runner.run(agent, PROMPT))
    assert isinstance(result.final_output, Person)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(server, method):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=server, api_key="unused", max_retries=0)
    person = llm.with_structured_output(Person, method=method).invoke(PROMPT)
    assert isinstance(person, Person)


def test_pydantic_ai_default_structured_output(server):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=server, api_key="unused"))
    agent = Agent(model, output_type=Person, retries=0)
    result = agent.run_sync(PROMPT)
    assert isinstance(result.output, Person)


def test_litellm_json_schema_and_forced_tool_call(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # offline: no cost-map download
    import litellm

    common = dict(model=f"openai/{MODEL}", api_base=server, api_key="unused", max_tokens=60)
    reply = litellm.completion(
        messages=[{"role": "user", "content": PROMPT}], **common,
        response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": Person.model_json_schema()}},
    )  # fmt: skip
    Person.model_validate_json(reply.choices[0].message.content)
    tools = [{"type": "function", "function": {
        "name": "record_person", "parameters": Person.model_json_schema()}}]  # fmt: skip
    for tool_choice in ("required", {"type": "function", "function": {"name": "record_person"}}):
        chunks = list(litellm.completion(
            messages=[{"role": "user", "content": PROMPT}], tools=tools, tool_choice=tool_choice,
            stream=True, **common,
        ))  # fmt: skip
        call = litellm.stream_chunk_builder(chunks).choices[0].message.tool_calls[0]
        assert call.function.name == "record_person"
        Person.model_validate_json(call.function.arguments)
