"""Rerank and embedding throughput of a server against sentence-transformers in the same run (issue #41's numbers).

Three rows, each a server launched for it and its peer run in this process, one after the other (never at the
same time):

- rerank, cross-encoder: one query of ~30 tokens and 100 documents of ~300 tokens through /v1/rerank, with a
  `BertForSequenceClassification` of ms-marco-MiniLM-L-6's shapes (random weights, a WordPiece vocabulary of
  30,522 generated words, so a word is a token); peer: `CrossEncoder.predict` on the same pairs;
- rerank, decoder: the same request on SmolLM2 with Qwen3-Reranker's template (--rerank-template
  qwen3_reranker); its peer row is the same CrossEncoder (the issue's goal compares both to it);
- embeddings: 1,000 sentences of 10-60 words through /v1/embeddings (requests of `--embed-batch` sentences,
  `--concurrency` at once), with a `BertModel` of all-MiniLM-L6's shapes (mean pooling, normalized); peer:
  `SentenceTransformer.encode` (batch 32).

Each side runs once untimed, then `--repeats` times in turn with its peer (ours, peer, ours, peer, ...): documents
(or sentences) per second are each side's median, the ratio the median of the pairs' ratios (pairing keeps it
meaningful when the machine's speed drifts). Both sides run in float32 on the CPU; torch uses every core
(`torch.set_num_threads`). The encoders' servers get extend buckets fitted to the workload (`--rerank-buckets`:
a pair of 301-361 tokens a step, padded to the next 16 tokens; `--embed-buckets`), as a user would set
--precompile-token-paddings. ``--tiny`` uses small models and inputs (the test's smoke run).

``python -m sgl_jax.bench_retrieval --report reports/retrieval-cpu-DATE.md``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import os
import statistics
import tempfile
from typing import List, Optional

import numpy as np

from sgl_jax.bench_utils import LaunchedServer, cpu_name, fetch_server_info, publish_result, timed, wait_idle_info

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MINILM_L6 = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
                 vocab_size=30522, max_position_embeddings=512, type_vocab_size=2)
# extend buckets: a cross-encoder pair of 301-361 tokens padded to the next 16 (one a step); embedding steps of
# up to two 512-token packs, padded to the next 128 tokens
RERANK_BUCKETS = tuple(range(304, 385, 16))
EMBED_BUCKETS = tuple(range(128, 1025, 128))
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=2000,
            max_position_embeddings=512, type_vocab_size=2)


def make_words(n: int) -> List[str]:
    """`n` distinct lower-case words of 2-4 syllables: the WordPiece vocabulary (one token each)."""
    syl = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    rng = np.random.default_rng(0)
    words = set()
    while len(words) < n:
        words.add("".join(rng.choice(syl, rng.integers(2, 5))))
    return sorted(words)


def save_bert(path: str, shapes: dict, head: bool, words: List[str]) -> None:
    """A random-weight BERT of `shapes` with a WordPiece tokenizer over SPECIALS + `words`: the
    sequence-classification form (1 label), or the embedding form saved by sentence-transformers (mean pooling,
    normalized)."""
    import torch
    from sentence_transformers import SentenceTransformer, models
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece
    from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizerFast

    torch.manual_seed(0)
    vocab = {w: i for i, w in enumerate(SPECIALS + words)}
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.decoder = decoders.WordPiece()
    fast = BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                             sep_token="[SEP]", mask_token="[MASK]", model_max_length=512)
    cfg = BertConfig(num_labels=1, **{**shapes, "vocab_size": len(vocab)})
    if head:
        BertForSequenceClassification(cfg).eval().save_pretrained(path)
        fast.save_pretrained(path)
        return
    base = path + "_base"
    BertModel(cfg, add_pooling_layer=False).eval().save_pretrained(base)
    fast.save_pretrained(base)
    SentenceTransformer(modules=[models.Transformer(base, max_seq_length=512), models.Pooling(
        shapes["hidden_size"], pooling_mode="mean"), models.Normalize()], device="cpu").save(path)


def texts(words: List[str], n: int, lo: int, hi: int, seed: int) -> List[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, int(rng.integers(lo, hi + 1)))) for _ in range(n)]


def _rate(items: int, secs: List[float]) -> dict:
    return {"per_s": items / statistics.median(secs), "seconds": secs}


def median_rate(fn, items: int, repeats: int) -> dict:
    """{"per_s": items / median seconds, "seconds": [...]}: `fn` once untimed, then `repeats` timed runs."""
    fn()
    return _rate(items, [timed(fn)[1] for _ in range(repeats)])


def paired_rates(ours, peer, items: int, repeats: int) -> tuple:
    """(ours' rate, the peer's rate, the median of peer seconds / our seconds over the pairs): each callable once
    untimed, then `repeats` pairs timed in turn (rates as `median_rate`)."""
    ours()
    peer()
    pairs = [(timed(ours)[1], timed(peer)[1]) for _ in range(repeats)]
    return (_rate(items, [a for a, _ in pairs]), _rate(items, [b for _, b in pairs]),
            statistics.median(b / a for a, b in pairs))


def rerank_on_server(args: List[str], query: str, docs: List[str], repeats: int, timeout: float,
                     max_tokens_per_doc: Optional[int] = None, peer=None) -> tuple:
    """(rate, the peer's rate or None, ratio or None) of /v1/rerank on a server of `args` (`peer`: a callable
    timed in turn with it, `paired_rates`); the rate carries the prompt tokens and the idle server's info."""
    import httpx

    body = {"query": query, "documents": docs}
    if max_tokens_per_doc:
        body["max_tokens_per_doc"] = max_tokens_per_doc
    with LaunchedServer(args, timeout) as server:
        def run():
            r = httpx.post(server.url + "/v1/rerank", json=body, timeout=3600)
            r.raise_for_status()
            return r.json()
        if peer is None:
            rate, peer_rate, ratio = median_rate(run, len(docs), repeats), None, None
        else:
            rate, peer_rate, ratio = paired_rates(run, peer, len(docs), repeats)
        rate["prompt_tokens"] = run()["usage"]["prompt_tokens"]
        rate["server_info"] = wait_idle_info(lambda: fetch_server_info(server.url))
    return rate, peer_rate, ratio


def embed_on_server(args: List[str], sentences: List[str], batch: int, concurrency: int, repeats: int,
                    timeout: float, peer) -> tuple:
    """(rate, the peer's rate, ratio) of /v1/embeddings on a server of `args`, timed in turn with `peer`."""
    import httpx

    chunks = [sentences[i:i + batch] for i in range(0, len(sentences), batch)]
    with LaunchedServer(args, timeout) as server, httpx.Client(timeout=3600) as client:
        def one(chunk):
            r = client.post(server.url + "/v1/embeddings", json={"input": chunk})
            r.raise_for_status()
            return r.json()["usage"]["prompt_tokens"]

        def run():
            with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
                return sum(pool.map(one, chunks))
        rate, peer_rate, ratio = paired_rates(run, peer, len(sentences), repeats)
        rate["prompt_tokens"] = run()
        rate["server_info"] = wait_idle_info(lambda: fetch_server_info(server.url))
    return rate, peer_rate, ratio


def encoder_flags(buckets: List[int], pack: int) -> List[str]:
    """An encoder server's flags: its extend buckets and packs of at most `pack` tokens (encoders run every input
    whole in one step: the chunk is the largest bucket)."""
    return ["--precompile-token-paddings", *map(str, buckets), "--max-multi-item-seq-len", str(pack),
            "--chunked-prefill-size", str(max(buckets))]


def run_benchmark(tiny: bool = False, repeats: int = 3, embed_batch: int = 100, concurrency: int = 4,
                  rerank_buckets=RERANK_BUCKETS, embed_buckets=EMBED_BUCKETS, embed_pack: int = 512,
                  decoder: bool = True, decoder_repeats: int = 1, timeout: float = 900.0) -> dict:
    """Every row of the module docstring; returns the raw result (rates, ratios, token counts, the servers' idle
    /get_server_info)."""
    import torch
    from sentence_transformers import CrossEncoder, SentenceTransformer

    torch.set_num_threads(os.cpu_count() or 1)
    shapes = TINY if tiny else MINILM_L6
    words = make_words(shapes["vocab_size"] - len(SPECIALS))
    n_docs, n_sent = (10, 50) if tiny else (100, 1000)
    query = texts(words, 1, 28, 28, 1)[0]
    docs = texts(words, n_docs, 270, 330, 2)
    sentences = texts(words, n_sent, 10, 60, 3)
    common = ["--dtype", "float32", "--log-level", "warning", "--random-seed", "0"]
    out = {"cpu": cpu_name(), "date": datetime.date.today().isoformat(), "shapes": shapes, "docs": n_docs,
           "sentences": n_sent, "repeats": repeats, "rerank_buckets": list(rerank_buckets),
           "embed_buckets": list(embed_buckets), "embed_pack": embed_pack, "embed_batch": embed_batch,
           "concurrency": concurrency, "torch_threads": torch.get_num_threads(), "decoder_repeats": decoder_repeats}
    with tempfile.TemporaryDirectory() as tmp:
        cross, embedder = os.path.join(tmp, "cross"), os.path.join(tmp, "embed")
        save_bert(cross, shapes, True, words)
        save_bert(embedder, shapes, False, words)
        ce = CrossEncoder(cross, device="cpu")
        pairs = [(query, d) for d in docs]
        out["rerank_cross"], out["rerank_cross_peer"], out["rerank_cross_ratio"] = rerank_on_server(
            ["--model-path", cross, *common, *encoder_flags(rerank_buckets, max(rerank_buckets))], query, docs,
            repeats, timeout, peer=lambda: ce.predict(pairs, batch_size=32))
        if decoder:  # (SmolLM2's tokenizer makes ~3 tokens of a generated word: documents cut to 300 tokens)
            out["rerank_decoder"], _, _ = rerank_on_server(
                ["--rerank-template", "qwen3_reranker", *common, "--precompile-token-paddings", "512", "2048",
                 "--chunked-prefill-size", "2048"], " ".join(query.split()[:10]), docs, decoder_repeats, timeout,
                max_tokens_per_doc=300)
        st = SentenceTransformer(embedder, device="cpu")
        out["embed"], out["embed_peer"], out["embed_ratio"] = embed_on_server(
            ["--model-path", embedder, *common, *encoder_flags(embed_buckets, embed_pack)], sentences, embed_batch,
            concurrency, repeats, timeout, peer=lambda: st.encode(sentences, batch_size=32))
    return out


def format_table(r: dict) -> str:
    rows = [("rerank: cross-encoder (MiniLM-L6 shapes)", r["rerank_cross"], r["rerank_cross_peer"],
             "CrossEncoder.predict", "documents", r["rerank_cross_ratio"])]
    if "rerank_decoder" in r:
        rows.append(("rerank: SmolLM2, Qwen3-Reranker template", r["rerank_decoder"], r["rerank_cross_peer"],
                     "CrossEncoder.predict (MiniLM-L6 shapes)", "documents",
                     r["rerank_decoder"]["per_s"] / r["rerank_cross_peer"]["per_s"]))
    rows.append(("embeddings: BERT (all-MiniLM-L6 shapes)", r["embed"], r["embed_peer"], "SentenceTransformer.encode",
                 "sentences", r["embed_ratio"]))
    lines = ["| workload | sgl-jax /s | peer | peer /s | sgl-jax / peer | prompt tokens |", "|---|---|---|---|---|---|"]
    for name, ours, peer, peer_name, unit, ratio in rows:
        lines.append(f"| {name} | {ours['per_s']:.1f} {unit} | {peer_name} | {peer['per_s']:.1f} | "
                     f"{ratio:.2f}x | {ours['prompt_tokens']:,} |")
    lines.append(f"\n{r['docs']} documents of 270-330 words after one query of 28 words (a word is a token of the "
                 "encoders' vocabulary; the decoder row: its first 10 words, documents cut to 300 SmolLM2 tokens, "
                 f"{r['decoder_repeats']} timed run, its ratio against the cross-encoder peer's median); "
                 f"{r['sentences']} sentences of 10-60 words in requests of {r['embed_batch']}, {r['concurrency']} "
                 f"at once; {r['repeats']} timed pairs (ours, peer) after one untimed run each: medians, and the "
                 f"median of the pairs' ratios; extend buckets {r['rerank_buckets']} (cross-encoder: a pair a "
                 f"step), {r['embed_buckets']} with packs of {r['embed_pack']} tokens (embeddings); float32 on "
                 f"{r['cpu']}, torch on {r['torch_threads']} threads; goal: sgl-jax ahead of the peer "
                 "(ratio > 1).")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="small models and inputs (a smoke run)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--embed-batch", type=int, default=100, help="sentences per /v1/embeddings request")
    p.add_argument("--concurrency", type=int, default=4, help="embedding requests at once")
    p.add_argument("--rerank-buckets", type=int, nargs="+", default=list(RERANK_BUCKETS),
                   help="the cross-encoder server's extend buckets (tokens); its largest is the pack length")
    p.add_argument("--embed-buckets", type=int, nargs="+", default=list(EMBED_BUCKETS),
                   help="the embedding server's extend buckets (tokens)")
    p.add_argument("--embed-pack", type=int, default=512, help="the embedding server's packed sequence length")
    p.add_argument("--no-decoder", action="store_true", help="leave out the SmolLM2 decoder-reranker row")
    p.add_argument("--decoder-repeats", type=int, default=1, help="timed runs of the (slow) decoder row")
    p.add_argument("--output-file", default=None)
    p.add_argument("--report", default=None, metavar="NAME.md")
    args = p.parse_args(argv)
    result = run_benchmark(args.tiny, args.repeats, args.embed_batch, args.concurrency, args.rerank_buckets,
                           args.embed_buckets, args.embed_pack, not args.no_decoder, args.decoder_repeats)
    publish_result("sgl_jax.bench_retrieval", argv, result,
                   f"Rerank and embeddings against sentence-transformers ({result['date']})", format_table,
                   args.output_file, args.report)


if __name__ == "__main__":
    main()
