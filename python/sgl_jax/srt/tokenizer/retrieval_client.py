"""The TokenizerManager's side of /v1/rerank and /v1/embeddings: what kind of model the server holds (a decoder
reranker with a prompt template, a cross-encoder with a classification head, an embedding model, an encoder) and
the requests each kind answers. The scheduler computes them through the scoring path (tokenizer/score_client.py):
label log-probabilities for a template reranker, pooled final hidden states (and the head's logits) otherwise.
"""

from __future__ import annotations

import time
from typing import List, Optional

from sgl_jax.srt.configs.model_config import resolve_model
from sgl_jax.srt.errors import RequestError
from sgl_jax.srt.metrics.collector import RequestTimes
from sgl_jax.srt.tokenizer import embedding, rerank


class RetrievalClient:
    """Rerank and embedding requests for a TokenizerManager `tm` (its tokenizer, limits and score client).

    Attributes:
        rerank_template / rerank_labels: a decoder reranker's prompt template and (negative, positive) label
            ids (tokenizer/rerank.py), or None.
        is_embedding: --is-embedding, or a model class whose role is not "causal" (no LM head:
            `SchedulerInfo.model_role`): generation and /v1/score are refused (`TokenizerManager.check_generates`).
        is_encoder: a BERT / XLM-RoBERTa model (token types go with its tokens).
        is_classifier: a sequence-classification head (a cross-encoder): /v1/rerank scores with it.
        pooling: how final hidden states become one vector (tokenizer/embedding.Pooling), or None.

    Raises:
        ValueError: at start-up, a bad --rerank-template or one whose labels are not single tokens.
    """

    def __init__(self, tm):
        self.tm = tm
        sa, arch = tm.server_args, tm.info.architecture
        self.rerank_template = rerank.template_for_model(sa.rerank_template, sa.model_path or "", arch)
        self.rerank_labels = (rerank.label_token_ids(self.rerank_template, tm.tokenizer)
                              if self.rerank_template else None)
        self.is_embedding = bool(sa.is_embedding) or tm.info.model_role != "causal"
        self.is_encoder = bool(tm.info.is_encoder)
        self.is_classifier = tm.info.model_role == "classifier"
        self.pooling: Optional[embedding.Pooling] = None
        if self.is_classifier:  # the head reads the first (encoder) or last (decoder) token, as transformers'
            self.pooling = embedding.Pooling("cls" if self.is_encoder else "last", False)
        elif self.is_embedding:
            default = embedding.Pooling("mean", False) if self.is_encoder else embedding.Pooling("last", True)
            self.pooling = embedding.read_pooling(resolve_model(sa).hf_dir, default)

    async def rerank(self, query: str, documents: List[str], instruct: Optional[str] = None,
                     max_tokens_per_doc: Optional[int] = None) -> dict:
        """Relevance of `documents` to `query`: {"scores": [float in [0, 1] per document, in input order],
        "prompt_tokens"}. A cross-encoder scores each (query, document) pair with its head
        (`embedding.relevance`); a decoder reranker through its template (`rerank.score_input`, the second label's
        softmax probability). Documents longer than `max_tokens_per_doc` tokens are cut to that many (Cohere's
        truncation); a pair longer than the largest input is cut longest-first, as CrossEncoder does.

        Raises RequestError: 400 when this model is not a reranker (naming ``model``), else as
            `TokenizerManager.score_request`.
        """
        tm, received = self.tm, time.perf_counter()
        if self.rerank_template is None and not self.is_classifier:
            raise RequestError(f"{tm.served_model_name} is not a reranker: serve a cross-encoder or a decoder "
                               "reranker such as Qwen3-Reranker, or start the server with --rerank-template",
                               param="model")
        if self.is_classifier and len(documents) > tm.server_args.max_multi_item_count:
            raise RequestError(f"{len(documents)} documents exceed --max-multi-item-count "
                               f"({tm.server_args.max_multi_item_count})", param="documents")
        if max_tokens_per_doc is not None:
            documents = await tm.run_blocking(self._truncated, documents, max_tokens_per_doc)
        if not self.is_classifier:
            obj = rerank.score_input(self.rerank_template, self.rerank_labels, query, documents, instruct)
            result = await tm.score_request(obj)
            return self._observed(received, {"scores": [s[1] for s in result["scores"]],
                                             "prompt_tokens": result["prompt_tokens"]})
        tm.start()
        ids, types = await tm.run_blocking(embedding.tokenize_pairs, tm.tokenizer, query, documents,
                                           tm.kv_limits.max_req_input_len)
        logits = await tm.score_client.embed(ids, self.pooling.mode, types if self.is_encoder else None,
                                             classify=True)
        return self._observed(received, {"scores": [embedding.relevance(x) for x in logits],
                                         "prompt_tokens": sum(map(len, ids))})

    async def embed(self, inputs, dimensions: Optional[int] = None) -> dict:
        """OpenAI's embeddings of `inputs` (`embedding.split_inputs`'s forms): {"embeddings": [float32 [d] per
        input, in order], "prompt_tokens"}; d: the hidden size, or `dimensions` (truncated and renormalized).

        Raises RequestError: 400 on a server that does not serve an embedding model, or serves a cross-encoder
            (naming ``model``), an invalid input (naming ``input``) or `dimensions`; 413 / 503 as
            `TokenizerManager.score_request`.
        """
        tm, received = self.tm, time.perf_counter()
        if not self.is_embedding:
            raise RequestError(f"{tm.served_model_name} is a generation model: start the server with "
                               "--is-embedding to serve /v1/embeddings", param="model")
        if self.is_classifier:
            raise RequestError(f"{tm.served_model_name} is a cross-encoder (a classification head): it "
                               "answers /v1/rerank, not /v1/embeddings", param="model")
        tm.start()
        items = embedding.split_inputs(inputs, tm.vocab_size, tm.server_args.max_multi_item_count)
        ids = await tm.run_blocking(embedding.tokenize_inputs, tm.tokenizer, items, self.pooling.max_seq_length)
        empty = [i for i, x in enumerate(ids) if not x]
        if empty:
            raise RequestError(f"input[{empty[0]}] has no tokens", param="input")
        types = [[0] * len(x) for x in ids] if self.is_encoder else None
        vectors = await tm.score_client.embed(ids, self.pooling.mode, types)
        return self._observed(received, {"embeddings": [embedding.finish(v, self.pooling, dimensions)
                                                        for v in vectors],
                                         "prompt_tokens": sum(len(x) for x in ids)})

    async def probe(self) -> None:
        """/health_generate on an embedding server: one input of one token through the model (and its head).
        Raises RequestError as `embed`."""
        tm = self.tm
        tm.start()
        await tm.score_client.embed([[0]], self.pooling.mode, [[0]] if self.is_encoder else None,
                                    classify=self.is_classifier)

    def _observed(self, received: float, result: dict) -> dict:
        """`result`, counted in /metrics (--enable-metrics) as one finished request of its prompt tokens and no
        output (sglang:num_requests_total, sglang:prompt_tokens_total, the end-to-end latency)."""
        if self.tm.metrics is not None:
            self.tm.metrics.observe_output(RequestTimes(received=received), 0, True,
                                           prompt_tokens=result["prompt_tokens"])
        return result

    def _truncated(self, documents: List[str], max_tokens: int) -> List[str]:
        out = []
        for d in documents:
            ids = self.tm.tokenizer.encode(d, add_special_tokens=False)
            out.append(d if len(ids) <= max_tokens else self.tm.tokenizer.decode(ids[:max_tokens]))
        return out
