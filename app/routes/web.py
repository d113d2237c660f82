"""``GET /``: a page to hear the service: type text (or let it be typed like an LLM would), pick a voice,
and listen to the audio streamed over the WebSocket as it arrives."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse

router = APIRouter(include_in_schema=False)
STATIC = Path(__file__).resolve().parent.parent / "static"


@router.get("/", response_class=HTMLResponse)
async def index():
    return FileResponse(STATIC / "index.html", media_type="text/html")


@router.get("/static/app.js")
async def script():
    return FileResponse(STATIC / "app.js", media_type="text/javascript")
