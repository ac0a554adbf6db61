"""The HTTP routes, one `fastapi.APIRouter` per group: native (SGLang's /generate, /health, /tokenize, ..., and /),
openai (/v1/models, /v1/completions, /v1/chat/completions), responses (OpenAI's /v1/responses), anthropic
(/v1/messages), ollama (/api/*), scoring (/v1/score), rerank (/v1/rerank:
Cohere's and Jina's API), embeddings (OpenAI's /v1/embeddings), sessions (/open_session, /close_session) and admin
(/get_server_info, /get_load, /flush_cache, /abort_request, /metrics). `http_server.build_app` includes them; each
handler reaches the TokenizerManager through the app's state (`common.tokenizer_manager`)."""
