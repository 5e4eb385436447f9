"""`/docs` works on an air-gapped cluster: every script, style and icon it loads is served
by kvindex itself (fastapi-offline's copies), none from a CDN. The browser half (chromium
renders the operations with every outside request blocked) is in
tests/browser/test_docs_browser.py."""

from __future__ import annotations

import re

from service_workload import TestClient

from kvindex.runtime import Fleet
from kvindex.service.app import create_app

_REF = re.compile(r"""(?:src|href)=["']([^"']+)["']|url:\s*'([^']+)'|spec-url=["']([^"']+)""")


def test_the_docs_page_loads_nothing_from_elsewhere() -> None:
    with TestClient(create_app(Fleet())) as client:
        r = client.get("/docs")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        refs = [next(g for g in m.groups() if g) for m in _REF.finditer(r.text)]
        assert refs, r.text
        assert not [ref for ref in refs if "//" in ref], refs  # same origin only
        assert "cdn" not in r.text.lower() and "fonts.googleapis" not in r.text
        for ref in refs:
            asset = client.get(ref)
            assert asset.status_code == 200 and len(asset.content) > 1000, ref
        assert client.get("/docs/assets/nothing.js").status_code == 404
        assert client.get("/redoc").status_code == 404  # no page that needs another host


def test_the_openapi_document_is_where_the_pages_look() -> None:
    with TestClient(create_app(Fleet())) as client:
        spec = client.get("/openapi.json").json()
        assert "/v1/lookup" in spec["paths"] and "/docs" not in spec["paths"]
