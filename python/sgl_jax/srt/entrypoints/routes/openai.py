"""OpenAI's routes: /v1/models, /v1/models/{id}, /v1/completions, /v1/chat/completions (the work is in
entrypoints/openai/; /v1/responses has routes/responses.py)."""

from __future__ import annotations

import time

from fastapi import Depends, Request

from sgl_jax.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from sgl_jax.srt.entrypoints.openai.serving_chat import create_chat_completion
from sgl_jax.srt.entrypoints.openai.serving_completions import create_completion
from sgl_jax.srt.entrypoints.routes.common import json_response
from sgl_jax.srt.entrypoints.routes.common import new_router, tokenizer_manager, until_disconnect
from sgl_jax.srt.tokenizer.tokenizer_manager import RequestError, TokenizerManager

router = new_router()


def model_card(tm: TokenizerManager) -> dict:
    """The served model as OpenAI's Model object (plus vLLM's/SGLang's ``root`` and ``max_model_len``)."""
    return {"id": tm.served_model_name, "object": "model", "created": int(time.time()), "owned_by": "sgl-jax",
            "root": tm.served_model_name, "max_model_len": tm.context_len}


def adapter_cards(tm: TokenizerManager) -> list:
    """One card per loaded LoRA adapter, as SGLang lists them: ``id`` its name, ``root`` its path, ``parent`` the
    served model (requests name it as ``model: "<adapter>"`` or ``"<base>:<adapter>"``)."""
    return [{"id": name, "object": "model", "created": int(time.time()), "owned_by": "sgl-jax", "root": path,
             "parent": tm.served_model_name, "max_model_len": None}
            for name, path in sorted((tm.lora_adapters or {}).items())]


@router.get("/v1/models")
async def models(tm: TokenizerManager = Depends(tokenizer_manager)):
    return json_response({"object": "list", "data": [model_card(tm)] + adapter_cards(tm)})


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, tm: TokenizerManager = Depends(tokenizer_manager)):
    """OpenAI's models.retrieve: the served model's card; 404 (OpenAI's error body, param ``model``) for any
    other id."""
    card = next((c for c in adapter_cards(tm) if c["id"] == model_id), None)
    if card is not None:
        return json_response(card)
    if model_id != tm.served_model_name:
        raise RequestError(f"The model '{model_id}' does not exist; this server serves '{tm.served_model_name}'",
                           404, param="model")
    return json_response(model_card(tm))


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, tm: TokenizerManager = Depends(tokenizer_manager)):
    return await create_completion(tm, req, lambda coro: until_disconnect(request, coro))


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request,
                           tm: TokenizerManager = Depends(tokenizer_manager)):
    return await create_chat_completion(tm, req, lambda coro: until_disconnect(request, coro))
