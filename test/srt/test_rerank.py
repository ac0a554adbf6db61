"""/v1/rerank (Cohere's and Jina's rerank API, SGLang's /v1/rerank) with a decoder reranker: Qwen3-Reranker's
template and yes/no formula on SmolLM2 (conftest.default_server runs --rerank-template qwen3_reranker).

The relevance scores must equal /v1/score's with the template's texts and labels (the same engine: 1e-6), and
transformers' P(yes) / (P(yes) + P(no)) on the same tokens (1e-3, the scoring tests' bound); the cohere client
(v1 and v2) reads the answers; a server's --multi-item-scoring-delimiter is not put into the template; a model with
no reranker template refuses with 400 naming ``model``.
"""

from __future__ import annotations

import json
import math

import cohere
import httpx
import pytest
import torch

from sgl_jax.srt.errors import RequestError
from sgl_jax.srt.tokenizer import rerank
from srt_helpers import API_KEY, wait_pool_idle

QUERY = "What is the capital city of France?"
DOCS = [
    "Paris is the capital and largest city of France.",
    "Bananas are yellow when they are ripe.",
    "x",
    "Berlin is the capital of Germany; Paris is the capital of France, on the Seine.",
    "The Eiffel Tower was completed in 1889 for the World's Fair and is one of the most visited monuments on "
    "Earth, with millions of visitors every single year from all over the world.",
    "Cats sleep a lot.",
]
SAME_ENGINE_ATOL = 1e-6  # the same scores through /v1/rerank and /v1/score
TRANSFORMERS_ATOL = 1e-3  # test_score.py's bound against transformers


@pytest.fixture(scope="module")
def server(default_server):
    return default_server  # conftest.py: the suite's shared server, with --rerank-template qwen3_reranker


@pytest.fixture(scope="module")
def labels(smollm2_tokenizer):
    return rerank.label_token_ids(rerank.QWEN3_RERANKER, smollm2_tokenizer)


def post(server, path, body, status=200, headers=None):
    r = httpx.post(server.url + path, json=body, timeout=120, headers=headers)
    assert r.status_code == status, r.text
    return r.json()


def test_rerank_equals_score_with_the_template_and_transformers(server, labels, smollm2_tokenizer, hf_smollm2):
    """Every document's relevance_score is /v1/score's softmax over (no, yes) on the template's texts, and
    transformers' on the same tokens; results come best first with their input index and text."""
    out = post(server, "/v1/rerank", {"model": "x", "query": QUERY, "documents": DOCS})
    scores = [r["relevance_score"] for r in out["results"]]
    assert scores == sorted(scores, reverse=True) and all(0 < x < 1 for x in scores)
    by_index = {r["index"]: r for r in out["results"]}
    assert sorted(by_index) == list(range(len(DOCS)))
    shared, items = rerank.QWEN3_RERANKER.score_texts(QUERY, DOCS, None)
    ref = post(server, "/v1/score", {"query": shared, "items": items, "label_token_ids": labels,
                                     "apply_softmax": True})
    q_ids = smollm2_tokenizer.encode(shared, add_special_tokens=False)
    for i, doc in enumerate(DOCS):
        r = by_index[i]
        assert r["document"] == {"text": doc} and r["score"] == r["relevance_score"]
        assert abs(r["relevance_score"] - ref["scores"][i][1]) <= SAME_ENGINE_ATOL
        ids = q_ids + smollm2_tokenizer.encode(items[i], add_special_tokens=False)
        with torch.no_grad():
            logits = hf_smollm2(torch.tensor([ids])).logits[0, -1]
        p_yes = torch.softmax(logits[labels].double(), 0)[1].item()
        assert abs(r["relevance_score"] - p_yes) <= TRANSFORMERS_ATOL, (i, r["relevance_score"], p_yes)
    assert out["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"] > 0
    assert out["id"].startswith("rerank-") and out["model"]


def test_top_n_return_documents_objects_aliases_instruct_and_truncation(server, smollm2_tokenizer):
    """top_n keeps the best n; return_documents false drops the texts; {text} documents (Cohere v1, Jina) and
    the /v2/rerank and /rerank paths give the same scores; another instruction changes them; max_tokens_per_doc
    scores the documents cut to that many tokens."""
    full = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS})["results"]
    top = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": False})
    assert [r["index"] for r in top["results"]] == [r["index"] for r in full[:2]]
    assert all("document" not in r for r in top["results"])
    big = post(server, "/rerank", {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 99})
    assert [(r["index"], r["relevance_score"]) for r in big["results"]] == \
        [(r["index"], r["relevance_score"]) for r in full]
    v2 = post(server, "/v2/rerank", {"model": "m", "query": QUERY, "documents": DOCS, "priority": 0})
    assert [r["index"] for r in v2["results"]] == [r["index"] for r in full]
    other = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "instruct": "Find passages about fruit"})
    assert {r["index"]: r["score"] for r in other["results"]} != {r["index"]: r["score"] for r in full}
    n = 5
    cut = [smollm2_tokenizer.decode(smollm2_tokenizer.encode(d, add_special_tokens=False)[:n]) for d in DOCS]
    assert cut != DOCS
    trunc = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "max_tokens_per_doc": n})
    manual = post(server, "/v1/rerank", {"query": QUERY, "documents": cut})
    assert {r["index"]: r["score"] for r in trunc["results"]} == \
        pytest.approx({r["index"]: r["score"] for r in manual["results"]}, abs=SAME_ENGINE_ATOL)
    assert [r["document"]["text"] for r in trunc["results"]] == [DOCS[r["index"]] for r in trunc["results"]]
    wait_pool_idle(server.url)


def test_cohere_clients_rerank_through_base_url(server):
    """The cohere client, v2 (/v2/rerank) and v1 (/v1/rerank, documents returned), pointed at the server."""
    full = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS})["results"]
    v2 = cohere.ClientV2(api_key="unused", base_url=server.url).rerank(model="m", query=QUERY, documents=DOCS,
                                                                        top_n=3)
    assert [(r.index, r.relevance_score) for r in v2.results] == [(r["index"], r["relevance_score"])
                                                                   for r in full[:3]]
    v1 = cohere.Client(api_key="unused", base_url=server.url).rerank(model="m", query=QUERY, documents=DOCS,
                                                                     return_documents=True)
    assert [(r.index, r.document.text) for r in v1.results] == [(r["index"], r["document"]["text"]) for r in full]


@pytest.mark.parametrize("body, param", [
    ({"documents": DOCS}, "query"),
    ({"query": "", "documents": DOCS}, "query"),
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": QUERY, "documents": "one"}, "documents"),
    ({"query": QUERY, "documents": [{"title": "no text"}]}, "documents[0]"),
    ({"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
    ({"query": QUERY, "documents": DOCS, "max_tokens_per_doc": -1}, "max_tokens_per_doc"),
])
def test_bad_rerank_requests_get_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/rerank", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param or param in err["message"], err


def test_a_delimiter_server_scores_the_template_without_its_delimiter(server, hardened_server):
    """The hardened server has --multi-item-scoring-delimiter (and the scoring cache: prefill_extend, where the
    default server packs): its rerank scores are the default server's, the template's text with no delimiter
    (test_score.py's bound between algorithms), it wants its API key, and /metrics counts the request."""
    body = {"query": QUERY, "documents": DOCS}
    plain = post(server, "/v1/rerank", body)["results"]
    assert httpx.post(hardened_server.url + "/v1/rerank", json=body, timeout=30).status_code == 401
    before = metrics(hardened_server)
    out = post(hardened_server, "/v1/rerank", body, headers={"authorization": f"Bearer {API_KEY}"})
    after, hard = metrics(hardened_server), out["results"]
    # /metrics counts the request and its prompt tokens (--enable-metrics)
    assert after["sglang:num_requests_total"] - before["sglang:num_requests_total"] == 1
    assert after["sglang:prompt_tokens_total"] - before["sglang:prompt_tokens_total"] == out["usage"]["prompt_tokens"]
    assert [r["index"] for r in hard] == [r["index"] for r in plain]
    assert [r["score"] for r in hard] == pytest.approx([r["score"] for r in plain], abs=1e-4)


def metrics(server) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_a_model_with_no_reranker_template_refuses_naming_model(shared_engine):
    """The shared Engine serves SmolLM2 with no --rerank-template: SmolLM2 is no reranker (400 naming model)."""
    tm = shared_engine.tokenizer_manager
    assert tm.retrieval.rerank_template is None
    with pytest.raises(RequestError, match="--rerank-template") as e:
        shared_engine._run(tm.retrieval.rerank(QUERY, DOCS))
    assert e.value.status_code == 400 and e.value.param == "model"


def test_templates_from_names_files_and_model_paths(tmp_path, smollm2_tokenizer):
    """--rerank-template: a built-in name or a JSON file (its errors name the flag); with no flag, Qwen3-Reranker's
    template for a causal Qwen3 whose path names a reranker, none otherwise; labels must be single tokens."""
    assert rerank.load_template("qwen3_reranker") is rerank.QWEN3_RERANKER
    spec = {"prefix": "P:", "query": "{instruct}|{query}|", "document": "<{document}>", "suffix": "?",
            "labels": ["no", "yes"], "default_instruct": "judge"}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(spec))
    t = rerank.load_template(str(path))
    assert t.score_texts("q", ["a", "b"], None) == ("P:judge|q|", ["<a>?", "<b>?"])
    assert t.score_texts("q", ["a"], "mine")[0] == "P:mine|q|"
    for bad in ({**spec, "extra": 1}, {k: v for k, v in spec.items() if k != "labels"}, {**spec, "labels": ["a"]},
                {**spec, "prefix": 3}):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="--rerank-template"):
            rerank.load_template(str(path))
    with pytest.raises(ValueError, match="--rerank-template"):
        rerank.load_template("no_such_template")
    for bad in ({**spec, "query": "{query} {other}"}, {**spec, "document": "{document"}, {**spec, "query": "{0}"}):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="does not render"):
            rerank.load_template(str(path))
    assert rerank.template_for_model(None, "/models/Qwen3-Reranker-0.6B/", "Qwen3ForCausalLM") is rerank.QWEN3_RERANKER
    assert rerank.template_for_model(None, "Qwen/Qwen3-0.6B", "Qwen3ForCausalLM") is None
    assert rerank.template_for_model(None, "x/my-reranker", "LlamaForCausalLM") is None
    path.write_text(json.dumps({**spec, "labels": ["no", "definitely-not-one-token"]}))
    with pytest.raises(ValueError, match="not one token"):
        rerank.label_token_ids(rerank.load_template(str(path)), smollm2_tokenizer)


def test_ranked_results_order_ties_and_top_n():
    res = rerank.ranked_results([0.5, 0.9, 0.5, math.nextafter(0.5, 1)], ["a", "b", "c", "d"], 3, True)
    assert [r["index"] for r in res] == [1, 3, 0] and res[2]["document"] == {"text": "a"}
    assert [r["index"] for r in rerank.ranked_results([0.1, 0.2], ["a", "b"], None, False)] == [1, 0]
