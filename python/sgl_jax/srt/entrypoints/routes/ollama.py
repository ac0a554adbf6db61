"""Ollama's routes (https://github.com/ollama/ollama/blob/main/docs/api.md): /api/chat, /api/generate, /api/tags,
/api/show, /api/ps, /api/version (the work is in entrypoints/ollama/). Errors are Ollama's ``{"error": msg}``
(error_bodies.py picks the shape by the /api/ path)."""

from __future__ import annotations

from fastapi import Depends, Request

from sgl_jax.srt.entrypoints.ollama.protocol import OllamaChatRequest, OllamaGenerateRequest, OllamaShowRequest
from sgl_jax.srt.entrypoints.ollama.models import cached_facts, is_served_model, ps_entry, show_body, tag_entry
from sgl_jax.srt.entrypoints.ollama.serving import ollama_chat, ollama_generate
from sgl_jax.srt.entrypoints.routes.common import json_response
from sgl_jax.srt.entrypoints.routes.common import new_router, tokenizer_manager, until_disconnect
from sgl_jax.srt.errors import RequestError
from sgl_jax.srt.tokenizer.tokenizer_manager import TokenizerManager
from sgl_jax.version import __version__

router = new_router()


@router.post("/api/chat")
async def chat(req: OllamaChatRequest, request: Request, tm: TokenizerManager = Depends(tokenizer_manager)):
    return await ollama_chat(tm, req, lambda coro: until_disconnect(request, coro))


@router.post("/api/generate")
async def generate(req: OllamaGenerateRequest, request: Request, tm: TokenizerManager = Depends(tokenizer_manager)):
    return await ollama_generate(tm, req, lambda coro: until_disconnect(request, coro))


@router.get("/api/tags")
async def tags(tm: TokenizerManager = Depends(tokenizer_manager)):
    """The one served model, as Ollama lists local models."""
    return json_response({"models": [tag_entry(tm, await cached_facts(tm))]})


@router.get("/api/ps")
async def ps(tm: TokenizerManager = Depends(tokenizer_manager)):
    """The one served model, as Ollama lists loaded models."""
    return json_response({"models": [ps_entry(tm, await cached_facts(tm))]})


@router.post("/api/show")
async def show(req: OllamaShowRequest, tm: TokenizerManager = Depends(tokenizer_manager)):
    """The served model's description; 404 for another name (Ollama: "model '<name>' not found")."""
    name = req.model or req.name
    if not name:
        raise RequestError("model is required", param="model")
    if not is_served_model(tm, name):
        raise RequestError(f"model '{name}' not found", 404, param="model")
    return json_response(show_body(tm, await cached_facts(tm)))


@router.get("/api/version")
async def version():
    """The server's version (sgl-jax's, not an Ollama release)."""
    return json_response({"version": __version__})
