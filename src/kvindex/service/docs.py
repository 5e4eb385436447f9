"""`/docs` (Swagger UI) that works offline: its script, style and icon are served by
kvindex itself, from the `fastapi-offline` package, instead of a CDN (an air-gapped
cluster, where fleets usually run, would get a blank page).

`install_docs(app)` adds the page and `GET /docs/assets/{name}`; the app must be created
with `docs_url=None, redoc_url=None` so that FastAPI's CDN pages are not there too. (No
ReDoc page: even served locally, it fetches its logo from its vendor's site.)
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response

__all__ = ["ASSETS_PATH", "install_docs"]

ASSETS_PATH = "/docs/assets"
_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
_FILES = {
    "swagger-ui-bundle.js": ".js",
    "swagger-ui.css": ".css",
    "favicon.png": ".png",
}


def _asset(name: str) -> bytes:
    return (resources.files("fastapi_offline") / "static" / name).read_bytes()


def install_docs(app: FastAPI) -> None:
    assets = {name: _asset(name) for name in _FILES}  # read once: a few MB, served often
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    async def swagger() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title} - API",
            swagger_js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_PATH}/favicon.png",
        )

    @app.get(ASSETS_PATH + "/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        body = assets.get(name)
        if body is None:
            return Response(b'{"error": "no such file"}', 404, media_type="application/json")
        media = _TYPES.get(_FILES[name], "image/png")
        return Response(body, media_type=media, headers={"Cache-Control": "max-age=86400"})
