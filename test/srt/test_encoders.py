"""Encoders and classification heads served for RAG stacks: BERT and XLM-RoBERTa embedding models on /v1/embeddings,
their cross-encoders (`*ForSequenceClassification`) and decoder ones (`Qwen3ForSequenceClassification`,
`Qwen2ForSequenceClassification`) on /v1/rerank, each a tiny random model with a real tokenizer kind (WordPiece
for BERT, SentencePiece Unigram for XLM-RoBERTa, trained here with the `tokenizers` library; SmolLM2's BPE for
Qwen), against sentence-transformers float32 (`SentenceTransformer.encode`, `CrossEncoder.predict`): embeddings
within cosine 0.99999, rerank scores within 1e-4, over inputs of 1 to 256 tokens packed into shared sequences
(steps laid out in rows: layers/encoder_attention.py); the pools idle after (the servers' teardown), no compile
while serving.
"""

from __future__ import annotations

import shutil

import httpx
import numpy as np
import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer, models

from srt_helpers import default_model_path, module_server, wait_pool_idle

COSINE_MIN = 0.99999  # issue #41's bounds against sentence-transformers float32
SCORE_ATOL = 1e-4
CORPUS = [
    "The capital of France is Paris, a city on the Seine with many museums and bridges.",
    "Bananas are yellow when they are ripe and green before they ripen on the tree.",
    "Encoders read a whole sentence at once; decoders read it from left to right.",
    "A reranker orders documents by how well they answer a query; an embedder maps text to vectors.",
    "Berlin is the capital of Germany. Madrid is the capital of Spain. Rome is the capital of Italy.",
]
QUERY = "What is the capital of France?"
LONG = " ".join(CORPUS[:3])  # ~80 WordPiece tokens, ~150 of the small Unigram vocabulary's
DOCS = [CORPUS[0], CORPUS[1], "x", LONG, CORPUS[4], "Paris"]
TEXTS = CORPUS + ["a", LONG]  # (the largest compiled prefill holds 256 tokens)
ENGINE = ["--dtype", "float32"]  # (and srt_helpers.SMALL_ENGINE_ARGS: buckets of 64 and 256 tokens)


def wordpiece_tokenizer(path):
    """A BERT WordPiece tokenizer trained on CORPUS (lower-cased, [CLS] / [SEP] pairs with token types)."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
    from tokenizers.models import WordPiece
    from transformers import BertTokenizerFast

    tok = Tokenizer(WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(CORPUS * 4, trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tok.decoder = decoders.WordPiece()
    fast = BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                             sep_token="[SEP]", mask_token="[MASK]")
    fast.save_pretrained(path)
    return fast


def unigram_tokenizer(path):
    """An XLM-RoBERTa SentencePiece Unigram tokenizer trained on CORPUS (<s> 0, <pad> 1, </s> 2, <unk> 3)."""
    from tokenizers import SentencePieceUnigramTokenizer, processors
    from transformers import XLMRobertaTokenizerFast

    sp = SentencePieceUnigramTokenizer()
    sp.train_from_iterator(CORPUS * 4, vocab_size=200, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                           unk_token="<unk>")
    tok = sp._tokenizer
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    fast = XLMRobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                   cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")
    fast.save_pretrained(path)
    return fast


def encoder_config(kind: str, vocab: int, num_labels: int = 1):
    from transformers import BertConfig, XLMRobertaConfig

    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, num_labels=num_labels, initializer_range=0.2)
    if kind == "bert":
        return BertConfig(max_position_embeddings=512, type_vocab_size=2, **common)
    return XLMRobertaConfig(max_position_embeddings=514, type_vocab_size=1, pad_token_id=1, **common)


def save_encoder(root, kind: str, head: bool) -> str:
    """A tiny random BERT / XLM-RoBERTa: the embedding form saved by sentence-transformers (BERT: mean pooling,
    XLM-RoBERTa: CLS, both normalized, as all-MiniLM and bge-m3), or the sequence-classification form (1 label)."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    torch.manual_seed(1)
    base = root / f"{kind}_{'cls' if head else 'base'}"
    tok = (wordpiece_tokenizer if kind == "bert" else unigram_tokenizer)(base)
    cfg = encoder_config(kind, len(tok))
    if head:
        AutoModelForSequenceClassification.from_config(cfg).eval().save_pretrained(base)
        return str(base)
    AutoModel.from_config(cfg, add_pooling_layer=False).eval().save_pretrained(base)
    st = SentenceTransformer(modules=[models.Transformer(str(base), max_seq_length=64),  # (LONG gets truncated)
                                      models.Pooling(64, pooling_mode="mean" if kind == "bert" else "cls"),
                                      models.Normalize()], device="cpu")
    out = root / f"{kind}_st"
    st.save(str(out))
    return str(out)


def save_decoder_classifier(root, kind: str) -> str:
    """A tiny random Qwen3ForSequenceClassification or Qwen2ForSequenceClassification (1 label; Qwen2's q/k/v
    biases randomized, transformers initializes them to 0) with SmolLM2's tokenizer (its pad token set)."""
    import transformers

    from sgl_jax.srt.configs.model_config import resolve_model_path

    torch.manual_seed(2)
    path = root / f"{kind}_cls"
    tok_dir = resolve_model_path(default_model_path()).hf_dir
    name = "Qwen3" if kind == "qwen3" else "Qwen2"
    cfg = getattr(transformers, f"{name}Config")(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, num_labels=1, pad_token_id=2,
        initializer_range=0.2)
    model = getattr(transformers, f"{name}ForSequenceClassification")(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tok_dir}/{name}", path / name)
    return str(path)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("encoders")


def served(path, context: int = 512):
    """The server of `path` (the encoders' 512 learned positions; SMALL_ENGINE_ARGS asks 2,048)."""
    return module_server(["--model-path", path, *ENGINE, "--context-length", str(context)])


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_gelu_erf_equals_torch_gelu():
    from sgl_jax.srt.layers.activation import gelu_erf
    x = np.linspace(-12, 12, 100_001, dtype=np.float32)
    ref = torch.nn.functional.gelu(torch.from_numpy(x).double()).numpy()
    assert np.abs(np.asarray(gelu_erf(x)) - ref).max() <= 2e-6


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_encoder_embeddings_equal_sentence_transformers(models_dir, kind):
    """BertModel (WordPiece, mean pooling) and XLMRobertaModel (Unigram, CLS pooling): /v1/embeddings of texts of
    1 to ~150 tokens in one request, packed together, and of token ids of 1 and 256 tokens (the largest compiled
    prefill), each within cosine 0.99999 of sentence-transformers';
    the server refuses generation (an encoder has no LM head) and /v1/rerank (no head either)."""
    path = save_encoder(models_dir, kind, head=False)
    st = SentenceTransformer(path, device="cpu")
    ref = st.encode(TEXTS, convert_to_numpy=True)
    # token-id inputs of 1 token and of the largest compiled prefill (256), packed with each other
    ids = [[5], [int(t) for t in np.random.default_rng(0).integers(5, st.tokenizer.vocab_size, 256)]]
    with torch.no_grad():
        ref_ids = np.stack([st.forward({"input_ids": torch.tensor([x]), "attention_mask": torch.ones(
            1, len(x), dtype=torch.long)})["sentence_embedding"][0].numpy() for x in ids])
    for server in served(path):
        r = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS}, timeout=120)
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]])
        assert got.shape == ref.shape and cosines(got, ref).min() >= COSINE_MIN, cosines(got, ref)
        r = httpx.post(server.url + "/v1/embeddings", json={"input": ids}, timeout=120)
        got_ids = np.array([d["embedding"] for d in r.json()["data"]])
        assert cosines(got_ids, ref_ids).min() >= COSINE_MIN, cosines(got_ids, ref_ids)
        for path_, body in (("/generate", {"text": "hi"}), ("/v1/rerank", {"query": "a", "documents": ["b"]})):
            r = httpx.post(server.url + path_, json=body, timeout=30)
            assert r.status_code == 400, r.text
        assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
        r = httpx.post(server.url + "/v1/embeddings", json={"input": [5] * 300}, timeout=30)
        assert r.status_code == 413 and "256 tokens" in r.text, r.text  # (an encoder's input is never chunked)
        wait_pool_idle(server.url)


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta", "qwen3", "qwen2"])
def test_cross_encoder_rerank_equals_crossencoder_predict(models_dir, kind):
    """BertForSequenceClassification (token types 0 / 1), XLMRobertaForSequenceClassification,
    Qwen3ForSequenceClassification and Qwen2ForSequenceClassification (the last token) on /v1/rerank: every
    document's relevance_score within 1e-4 of
    CrossEncoder.predict on the (query, document) pairs (a sigmoid of the one logit), best first; /v1/embeddings is
    refused (a cross-encoder answers rerank)."""
    path = (save_decoder_classifier(models_dir, kind) if kind.startswith("qwen") else
            save_encoder(models_dir, kind, head=True))
    ref = CrossEncoder(path, device="cpu").predict([(QUERY, d) for d in DOCS])
    for server in served(path, 2048 if kind.startswith("qwen") else 512):
        r = httpx.post(server.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS}, timeout=120)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        got = {x["index"]: x["relevance_score"] for x in results}
        assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: (-got[i], i))
        assert np.abs(np.array([got[i] for i in range(len(DOCS))]) - ref).max() <= SCORE_ATOL, (got, ref)
        r = httpx.post(server.url + "/v1/embeddings", json={"input": "a"}, timeout=30)
        assert r.status_code == 400 and "/v1/rerank" in r.text, r.text
        r = httpx.post(server.url + "/v1/rerank", json={"query": QUERY, "documents": ["x"] * 513}, timeout=30)
        assert r.status_code == 400 and "--max-multi-item-count" in r.text, r.text
        assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
        wait_pool_idle(server.url)


def test_an_encoder_refuses_data_parallel_ranks(models_dir):
    """Encoders compute a step's segments over every rank's tokens at once: --dp-size > 1 is refused at start-up,
    naming the flag."""
    from sgl_jax.srt.configs.model_config import ModelConfig
    from sgl_jax.srt.server_args import ServerArgs

    path = save_encoder(models_dir, "bert", head=True)
    with pytest.raises(ValueError, match="--dp-size 2"):
        ModelConfig.from_server_args(ServerArgs(model_path=path, dp_size=2), "cpu")
