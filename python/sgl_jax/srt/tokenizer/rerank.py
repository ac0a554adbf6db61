"""/v1/rerank (Cohere's and Jina's rerank API, SGLang's /v1/rerank) on a decoder reranker: the prompt template that
turns (instruct, query, document) into a /v1/score request, and the ranking of its scores (pure functions, no I/O).

A decoder reranker (Qwen3-Reranker) reads ``prefix + "<Instruct>: I\\n<Query>: Q\\n<Document>: D" + suffix`` and
answers "yes" or "no"; the relevance score is the softmax over the two labels' logits at the last position, taken
for "yes" (Qwen3-Reranker's model card; SGLang scores it the same way, through next-token logprobs). The text up to
the document is the same for every document of a request, so it is the /v1/score query and each
``document part + suffix`` is an item: the scoring engine computes the shared part once (packed or prefill_extend)
and the radix cache keeps it between requests with the same instruction and query.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import List, Optional, Sequence

from sgl_jax.srt.errors import RequestError
from sgl_jax.srt.tokenizer.score_request import ScoreReqInput


@dataclasses.dataclass(frozen=True)
class RerankTemplate:
    """How a decoder reranker is prompted and scored.

    Fields: ``query`` and ``document`` are str.format templates (``{instruct}``, ``{query}``; ``{document}``);
    the scored text is ``prefix + query.format(...) + document.format(...) + suffix``. ``labels``: the
    (negative, positive) label tokens, each one vocabulary token; the score is P(positive) under a softmax over
    the two. ``default_instruct``: the instruction when a request gives none.
    """

    name: str
    prefix: str
    query: str
    document: str
    suffix: str
    labels: tuple
    default_instruct: str = ""

    def score_texts(self, query: str, documents: Sequence[str], instruct: Optional[str]) -> tuple:
        """(the shared query text, one item text per document) of the /v1/score request."""
        shared = self.prefix + self.query.format(instruct=self.default_instruct if instruct is None else instruct,
                                                 query=query)
        return shared, [self.document.format(document=d) + self.suffix for d in documents]


# Qwen3-Reranker's prompt, instruction default and yes/no labels (its model card, Qwen/Qwen3-Reranker-0.6B)
QWEN3_RERANKER = RerankTemplate(
    name="qwen3_reranker",
    prefix="<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
           "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n",
    query="<Instruct>: {instruct}\n<Query>: {query}\n",
    document="<Document>: {document}",
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    labels=("no", "yes"),
    default_instruct="Given a web search query, retrieve relevant passages that answer the query",
)

BUILTIN_TEMPLATES = {QWEN3_RERANKER.name: QWEN3_RERANKER}
_FILE_KEYS = ("prefix", "query", "document", "suffix", "labels", "default_instruct")


def load_template(name_or_path: str) -> RerankTemplate:
    """A built-in template by name (BUILTIN_TEMPLATES) or a JSON file with the RerankTemplate fields (`_FILE_KEYS`;
    prefix, suffix and default_instruct may be left out).

    Raises:
        ValueError: an unknown name, an unreadable file, unknown or missing keys, or labels that are not two
            strings (the message names --rerank-template).
    """
    if name_or_path in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[name_or_path]
    if not os.path.isfile(name_or_path):
        raise ValueError(f"--rerank-template must be one of {sorted(BUILTIN_TEMPLATES)} or a JSON file, got "
                         f"{name_or_path!r}")
    try:
        with open(name_or_path, encoding="utf-8") as f:
            spec = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--rerank-template {name_or_path}: {e}") from e
    unknown = sorted(set(spec) - set(_FILE_KEYS)) if isinstance(spec, dict) else ["(not an object)"]
    if unknown:
        raise ValueError(f"--rerank-template {name_or_path}: unknown keys {unknown}; allowed: {list(_FILE_KEYS)}")
    missing = [k for k in ("query", "document", "labels") if k not in spec]
    labels = spec.get("labels")
    if missing or not (isinstance(labels, list) and len(labels) == 2 and all(isinstance(x, str) for x in labels)):
        raise ValueError(f"--rerank-template {name_or_path}: needs 'query', 'document' and 'labels' (two label "
                         f"tokens, negative then positive); missing {missing}")
    fields = {k: spec.get(k, "") for k in ("prefix", "query", "document", "suffix", "default_instruct")}
    if not all(isinstance(v, str) for v in fields.values()):
        raise ValueError(f"--rerank-template {name_or_path}: prefix, query, document, suffix and default_instruct "
                         "must be strings")
    template = RerankTemplate(name=os.path.basename(name_or_path), labels=tuple(labels), **fields)
    try:
        template.score_texts("q", ["d"], None)
    except (KeyError, IndexError, ValueError) as e:  # (a placeholder other than {instruct} {query} {document})
        raise ValueError(f"--rerank-template {name_or_path}: a format string does not render ({e!r}); the "
                         "placeholders are {instruct} and {query} in 'query', {document} in 'document' (double "
                         "other braces)") from e
    return template


def template_for_model(flag: Optional[str], model_path: str, architecture: str) -> Optional[RerankTemplate]:
    """The server's rerank template: `flag` (--rerank-template) when given, else Qwen3-Reranker's for a causal
    Qwen3 model whose path names a reranker (its config says no more), else None (the model is not a decoder
    reranker). Raises ValueError for a bad flag (`load_template`)."""
    if flag:
        return load_template(flag)
    if architecture == "Qwen3ForCausalLM" and "reranker" in os.path.basename(model_path.rstrip("/")).lower():
        return QWEN3_RERANKER
    return None


def label_token_ids(template: RerankTemplate, tokenizer) -> List[int]:
    """The (negative, positive) label token ids: each label must be one vocabulary token (as the model card's
    ``tokenizer.convert_tokens_to_ids``), else ValueError naming it."""
    ids = []
    for label in template.labels:
        tid = tokenizer.convert_tokens_to_ids(label)
        if tid is None or tid == getattr(tokenizer, "unk_token_id", None):
            raise ValueError(f"--rerank-template {template.name}: label {label!r} is not one token of this "
                             "model's vocabulary")
        ids.append(int(tid))
    return ids


def document_texts(documents: Sequence[object]) -> List[str]:
    """Each document's text: a string, or an object with a string ``text`` (Cohere v1's and Jina's form).
    Raises RequestError (400) naming the document."""
    out = []
    for i, d in enumerate(documents):
        text = d.get("text") if isinstance(d, dict) else d
        if not isinstance(text, str):
            raise RequestError(f"documents[{i}] must be a string or an object with a string 'text'",
                               param=f"documents[{i}]")
        out.append(text)
    return out


def score_input(template: RerankTemplate, labels: List[int], query: str, documents: List[str],
                instruct: Optional[str]) -> ScoreReqInput:
    """The /v1/score request whose second score per item is the documents' relevance (`RerankTemplate`)."""
    shared, items = template.score_texts(query, documents, instruct)
    return ScoreReqInput(query=shared, items=items, label_token_ids=list(labels), apply_softmax=True,
                         use_delimiter=False)


def ranked_results(scores: Sequence[float], documents: List[str], top_n: Optional[int],
                   return_documents: bool) -> List[dict]:
    """Cohere's / Jina's ``results``: the `top_n` best documents (all when None), highest score first, ties in
    input order; each {"index", "relevance_score", "score" (SGLang's name for it), "document": {"text"} when
    `return_documents`}."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    if top_n is not None:
        order = order[:top_n]
    results = []
    for i in order:
        r = {"index": i, "relevance_score": float(scores[i]), "score": float(scores[i])}
        if return_documents:
            r["document"] = {"text": documents[i]}
        results.append(r)
    return results
