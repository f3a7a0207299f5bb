"""router/http/openapi.py: the spec lists exactly the app's routes, and it is valid OpenAPI."""

from __future__ import annotations

import pytest

from common.config import RouterConfig
from router.app import API, DISPATCHER, make_app
from router.http.limits import Limits
from router.http.openapi import ENDPOINTS, build_spec


@pytest.fixture
async def app_routes() -> set[tuple[str, str]]:
    app = make_app(RouterConfig(model="demo", worker_mode="external", worker_addr="ipc:///tmp/x.sock"),
                   "ipc:///tmp/x.sock", {}, api_keys=["k"], link_keys=None)
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes()
              if r.resource is not None and r.method != "HEAD"}
    await app[DISPATCHER].stop()
    app[API].pool.shutdown(wait=False)
    return routes


def test_every_route_is_described_once(app_routes: set[tuple[str, str]]) -> None:
    described = [(e.method, e.path) for e in ENDPOINTS]
    assert len(described) == len(set(described))
    assert set(described) == app_routes


def test_limits_reach_the_schemas() -> None:
    spec = build_spec(Limits(max_tokens=64, max_messages=5), context_length=4096)
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["max_tokens"]["maximum"] == 64 and chat["messages"]["maxItems"] == 5
    assert build_spec(Limits(), 4096)["components"]["schemas"]["CompletionRequest"][
        "properties"]["max_tokens"]["maximum"] == 4096
    assert spec["paths"]["/health"]["get"]["security"] == []
    assert spec["paths"]["/v1/models"]["get"]["security"]


def test_spec_is_valid_openapi() -> None:
    import schemathesis

    schema = schemathesis.openapi.from_dict(build_spec(Limits(), 4096))
    operations = [op.ok() for op in schema.get_all_operations()]
    assert len(operations) == len(ENDPOINTS)
