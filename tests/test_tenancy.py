"""Tenants by API key over HTTP and WebSocket (docs/tenancy.md): keys verified in both headers on
every /v1 route, cached blocks isolated between tenants unless shared, stored responses never
shared, and keys that name one tenant sharing everything."""

from __future__ import annotations

import json

import httpx
import pytest
from servers import MODEL, server_process
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from prefixserve.api.frontend.tenancy import Tenant, Tenants

PROMPT = "Tell me about shared prefixes and paged attention in serving engines. " * 4


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps({"k1": "team-a", "k3": "team-a", "k2": "team-b"}))
    return str(path)


@pytest.fixture(scope="module")
def server(keys_file):
    with server_process("--api-keys-file", keys_file) as (_, base):
        yield base


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def cached(base: str, headers: dict) -> int:
    r = httpx.post(f"{base}/v1/completions", headers=headers, timeout=60,
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_both_headers_are_verified_on_every_route(server):
    models = f"{server}/v1/models"
    assert httpx.get(models).status_code == 401
    assert httpx.get(models, headers=bearer("k1")).status_code == 200
    assert httpx.get(models, headers={"x-api-key": "k2"}).status_code == 200
    for headers in ({**bearer("nope"), "x-api-key": "k1"}, {**bearer("k1"), "x-api-key": "nope"},
                    {**bearer("k1"), "x-api-key": "k2"}):  # fmt: skip
        r = httpx.get(models, headers=headers)
        assert r.status_code == 401, headers
    assert httpx.get(models, headers={**bearer("k1"), "x-api-key": "k3"}).status_code == 200
    anthropic = httpx.post(f"{server}/v1/messages", headers={"x-api-key": "bad"},
                           json={"model": MODEL, "max_tokens": 1, "messages": []})  # fmt: skip
    assert anthropic.status_code == 401 and anthropic.json()["type"] == "error"


def test_tenants_share_no_cached_blocks_and_one_tenants_keys_share_them(server):
    assert cached(server, bearer("k1")) == 0
    assert cached(server, bearer("k2")) == 0  # another tenant: no timing side channel
    assert cached(server, {"x-api-key": "k3"}) > 0  # k3 is team-a too


def test_stored_responses_belong_to_their_tenant(server):
    r = httpx.post(f"{server}/v1/responses", headers=bearer("k1"), timeout=60,
                   json={"model": MODEL, "input": "hi", "max_output_tokens": 2})  # fmt: skip
    url = f"{server}/v1/responses/{r.json()['id']}"
    assert httpx.get(url, headers=bearer("k2")).status_code == 404
    assert httpx.get(url, headers={"x-api-key": "k3"}).status_code == 200
    assert httpx.get(url + "?cache_salt=x", headers=bearer("k1")).status_code == 404


def test_the_websocket_takes_either_header(server):
    url = server.replace("http://", "ws://") + "/v1/responses"
    with pytest.raises(InvalidStatus):
        connect(url, additional_headers={"x-api-key": "nope"}).close()
    with connect(url, additional_headers={"x-api-key": "k2"}) as ws:
        ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": "hi",
                            "max_output_tokens": 1, "store": False}))  # fmt: skip
        while (event := json.loads(ws.recv(timeout=60)))["type"] != "response.incomplete":
            assert event["type"] != "error", event


def test_sharing_the_prefix_cache_never_shares_stored_responses():
    with server_process("--api-key", "k1", "--api-key", "k2",
                        "--share-prefix-cache-across-tenants") as (_, base):  # fmt: skip
        assert cached(base, bearer("k1")) == 0 and cached(base, bearer("k2")) > 0
        r = httpx.post(f"{base}/v1/responses", headers=bearer("k1"), timeout=60,
                       json={"model": MODEL, "input": "hi", "max_output_tokens": 2})  # fmt: skip
        url = f"{base}/v1/responses/{r.json()['id']}"
        assert httpx.get(url, headers=bearer("k2")).status_code == 404


def test_the_engine_salt_carries_the_tenant_only_when_tenants_are_isolated():
    two = Tenants({"a": "A", "b": "B"})
    a = two.authenticate("Bearer a", None)
    assert a.isolated and a.cache_salt(None) != two.authenticate(None, "b").cache_salt(None)
    assert a.cache_salt("s").endswith("/s") and a.namespace("s") != a.namespace(None)
    assert not Tenants({"a": "A", "b": "B"}, share_prefix_cache=True).isolated
    one = Tenants({"a": "A"}).authenticate(None, "a")
    assert one.cache_salt("s") == "s" and one.cache_salt(None) is None
    assert Tenants({}).authenticate("Bearer anything", None) == Tenant(
        Tenants({}).authenticate(None, "anything").identity)  # fmt: skip
