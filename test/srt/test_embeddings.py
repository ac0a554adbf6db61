"""/v1/embeddings (OpenAI's embeddings API) on a decoder embedding model, against sentence-transformers.

The model: a tiny random Qwen3 saved by sentence-transformers as Qwen3-Embedding is (a `Qwen3Model` checkpoint with
no LM head, last-token pooling, normalized; SmolLM2's tokenizer), served with --is-embedding in float32.
sentence-transformers (float32, torch) is the reference: every vector within cosine 0.99999 of its, over batches
mixing inputs of 1 token to more than the largest compiled prefill (they are packed into segments of few
sequences), text and token ids, concurrent requests; ``dimensions`` truncates and renormalizes; base64 round-trips;
the openai client and LangChain's OpenAIEmbeddings read the answers; generation and scoring are refused with 400,
as /v1/embeddings is on a generation server.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil

import httpx
import langchain_openai
import numpy as np
import openai
import pytest
import torch
from sentence_transformers import SentenceTransformer, models

from sgl_jax.srt.tokenizer import embedding
from sgl_jax.srt.tokenizer.score_request import ScoreLayout, pack_seqs
from srt_helpers import default_model_path, module_server, wait_pool_idle

COSINE_MIN = 0.99999  # issue #41's bound against sentence-transformers float32
TEXTS = [
    "The capital of France is Paris.",
    "a",
    "Bananas are yellow when they are ripe, and green before.",
    "Embeddings map text to vectors; similar texts get vectors pointing the same way. " * 12,
    "x y z",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Qwen3 embedding model in sentence-transformers' layout (modules.json, 1_Pooling, 2_Normalize)."""
    from transformers import Qwen3Config, Qwen3Model

    from sgl_jax.srt.configs.model_config import resolve_model_path

    torch.manual_seed(0)
    base = tmp_path_factory.mktemp("qwen3_base")
    cfg = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      tie_word_embeddings=True, initializer_range=0.2)
    Qwen3Model(cfg).eval().save_pretrained(base, safe_serialization=True)
    tok_dir = resolve_model_path(default_model_path()).hf_dir
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tok_dir}/{name}", base / name)
    st = SentenceTransformer(modules=[models.Transformer(str(base)),
                                      models.Pooling(64, pooling_mode="lasttoken"), models.Normalize()],
                             device="cpu")
    out = tmp_path_factory.mktemp("qwen3_embedding")
    st.save(str(out))
    return str(out)


@pytest.fixture(scope="module")
def reference(model_dir):
    return SentenceTransformer(model_dir, device="cpu")


@pytest.fixture(scope="module")
def server(model_dir):
    yield from module_server(["--model-path", model_dir, "--is-embedding", "--dtype", "float32"])


def embed(server, body, status=200):
    r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_pooling_is_read_from_the_sentence_transformers_modules(model_dir, tmp_path):
    p = embedding.read_pooling(model_dir)
    assert (p.mode, p.normalize) == ("last", True)
    assert embedding.read_pooling(str(tmp_path)) == embedding.Pooling("last", True)  # no modules.json
    (tmp_path / "modules.json").write_text(json.dumps([{"idx": 0, "path": "p", "type": embedding.ST_POOLING}]))
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert embedding.read_pooling(str(tmp_path)) == embedding.Pooling("mean", False)
    (tmp_path / "p" / "config.json").write_text(json.dumps({"pooling_mode": "cls"}))  # sentence-transformers 6
    assert embedding.read_pooling(str(tmp_path)) == embedding.Pooling("cls", False)
    for unsupported in ({"pooling_mode_max_tokens": True}, {"pooling_mode": "max"}):
        (tmp_path / "p" / "config.json").write_text(json.dumps(unsupported))
        with pytest.raises(ValueError, match="no supported pooling mode"):
            embedding.read_pooling(str(tmp_path))
    for several in ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True},
                    {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}):
        (tmp_path / "p" / "config.json").write_text(json.dumps(several))
        with pytest.raises(ValueError, match="several pooling modes"):
            embedding.read_pooling(str(tmp_path))


def test_inputs_are_packed_first_fit_keeping_their_order():
    # in order, the third input would open a third pack; first-fit puts it after the first
    items = [list(range(1, 301)), list(range(1, 401)), list(range(1, 201))]
    packs, where = pack_seqs(ScoreLayout([], items, items), 512, pool="mean")
    assert where == [(0, 0), (1, 0), (0, 1)] and [len(p.input_ids) for p in packs] == [500, 400]
    assert packs[0].segment_starts == [0] * 300 + [300] * 200 and packs[0].rope_positions[300] == 0
    assert packs[0].pool_index == [0] * 300 + [1] * 200 and packs[0].score_positions == list(range(500))


def test_embeddings_equal_sentence_transformers_across_lengths(server, reference, smollm2_tokenizer):
    """Texts of 1 to ~200 tokens and token-id inputs of 1 to 300 tokens (beyond the 256-token prefill bucket:
    their pack is prefilled in chunks) in one request: each vector within cosine 0.99999 of sentence-transformers',
    unit length, and usage counts the tokens."""
    ids = [[int(t) for t in np.random.default_rng(n).integers(0, 49152, n)] for n in (1, 2, 63, 64, 65, 255, 300)]
    out = embed(server, {"model": "m", "input": TEXTS})
    assert [d["index"] for d in out["data"]] == list(range(len(TEXTS))) and out["object"] == "list"
    ref = reference.encode(TEXTS, convert_to_numpy=True, normalize_embeddings=False)
    got = np.array([d["embedding"] for d in out["data"]])
    assert got.shape == ref.shape and cosines(got, ref).min() >= COSINE_MIN, cosines(got, ref)
    assert np.allclose(np.linalg.norm(got, axis=-1), 1, atol=1e-5)
    assert out["usage"]["prompt_tokens"] == sum(len(smollm2_tokenizer.encode(t)) for t in TEXTS)
    out_ids = embed(server, {"input": ids})
    got_ids = np.array([d["embedding"] for d in out_ids["data"]])
    with torch.no_grad():  # the reference on token ids: its model, last-token pooling, normalized
        ref_ids = np.stack([reference.forward({"input_ids": torch.tensor([x]),
                                               "attention_mask": torch.ones(1, len(x), dtype=torch.long)})
                            ["sentence_embedding"][0].numpy() for x in ids])
    assert cosines(got_ids, ref_ids).min() >= COSINE_MIN, cosines(got_ids, ref_ids)
    one = embed(server, {"input": ids[0]})["data"]  # a single list of ids is one input
    assert len(one) == 1 and cosines(one[0]["embedding"], got_ids[0]) >= COSINE_MIN
    wait_pool_idle(server.url)


def test_concurrent_requests_get_what_they_get_alone(server):
    """Eight requests at once (batched by the scheduler into the same steps) answer what each answers alone."""
    alone = [embed(server, {"input": [t]})["data"][0]["embedding"] for t in TEXTS]

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            rs = await asyncio.gather(*[c.post(server.url + "/v1/embeddings", json={"input": [TEXTS[i % 5]]})
                                        for i in range(8)])
        return [r.json()["data"][0]["embedding"] for r in rs]

    for i, v in enumerate(asyncio.run(run())):
        assert cosines(v, alone[i % 5]) >= COSINE_MIN


def test_dimensions_base64_and_the_openai_and_langchain_clients(server):
    """``dimensions`` keeps the first n values renormalized; base64 is the float32 bytes; the openai client
    (float and base64) and LangChain's OpenAIEmbeddings read the vectors."""
    full = np.array(embed(server, {"input": TEXTS[:2]})["data"][0]["embedding"], np.float32)
    cut = np.array(embed(server, {"input": TEXTS[:2], "dimensions": 16})["data"][0]["embedding"])
    assert cut.shape == (16,) and np.allclose(cut, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)
    b64 = embed(server, {"input": TEXTS[:2], "encoding_format": "base64"})["data"][0]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(b64), "<f4"), full)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    for fmt in ({"encoding_format": "float"}, {}):  # (with no format the client asks for base64 and decodes it)
        res = client.embeddings.create(model="m", input=TEXTS, **fmt)
        assert len(res.data) == len(TEXTS) and np.allclose(res.data[0].embedding, full, atol=1e-6)
    res = client.embeddings.create(model="m", input=TEXTS[0], encoding_format="base64")
    assert np.array_equal(np.frombuffer(base64.b64decode(res.data[0].embedding), "<f4"), full)
    lc = langchain_openai.OpenAIEmbeddings(model="m", base_url=server.url + "/v1", api_key="unused",
                                           check_embedding_ctx_length=False)  # (texts, not tiktoken ids)
    assert np.allclose(lc.embed_query(TEXTS[0]), full, atol=1e-6)
    assert len(lc.embed_documents(TEXTS)) == len(TEXTS)


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": [49152]}, "input"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "dimensions": 65}, "dimensions"),
])
def test_bad_embedding_requests_get_400_naming_the_field(server, body, param):
    err = embed(server, body, 400)["error"]
    assert err["param"] == param or param in err["message"], err


def test_an_embedding_server_refuses_generation_and_scoring(server):
    for path, body in (("/generate", {"text": "hi"}), ("/v1/completions", {"model": "m", "prompt": "hi"}),
                       ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/score", {"query": "a", "items": ["b"], "label_token_ids": [1]}),
                       ("/v1/messages", {"model": "m", "max_tokens": 4,
                                         "messages": [{"role": "user", "content": "x"}]}),
                       ("/api/chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/responses", {"model": "m", "input": "hi"})):
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 400 and "--is-embedding" in r.text, (path, r.text)


def test_health_generate_and_model_info_of_an_embedding_server(server):
    """/health_generate probes the model with a one-token input (it generates nothing); /get_model_info says it
    is no generation model."""
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
    assert httpx.get(server.url + "/get_model_info", timeout=30).json()["is_generation"] is False


def test_is_embedding_builds_a_causal_lm_without_its_head(model_dir, tmp_path):
    """A checkpoint that names Qwen3ForCausalLM, does not tie its head and stores none (Qwen3-Embedding-4B / 8B's
    form) loads with --is-embedding (the stack alone) and is refused without it."""
    from sgl_jax.srt.configs.model_config import ModelConfig
    from sgl_jax.srt.model_loader.loader import load_model
    from sgl_jax.srt.server_args import ServerArgs

    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{model_dir}/{name}", tmp_path / name)
    cfg = json.loads(open(f"{model_dir}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForCausalLM"],
                                                      "tie_word_embeddings": False}))
    mc = ModelConfig.from_server_args(ServerArgs(model_path=str(tmp_path), is_embedding=True), "cpu")
    _, params = load_model(mc)
    assert "lm_head" not in params
    with pytest.raises(ValueError, match="lm_head"):
        load_model(ModelConfig.from_server_args(ServerArgs(model_path=str(tmp_path)), "cpu"))


def test_a_generation_server_refuses_embeddings(default_server):
    r = httpx.post(default_server.url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
    assert r.status_code == 400 and "--is-embedding" in r.text and r.json()["error"]["param"] == "model"
