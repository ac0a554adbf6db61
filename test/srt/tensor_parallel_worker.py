"""Run by test_tensor_parallel.py in a subprocess with 8 virtual CPU devices (the flag must be set before jax
is imported): greedy decoding of the same prompts through ModelRunners of several --tp-size values, the
sharding of every parameter and KV buffer, and per-device parameter bytes. Prints one JSON object.

    python test/srt/tensor_parallel_worker.py MODEL_PATH --tp 1 2 4 --prompts 16 --steps 32 [--ep]
        [--quantization int8 w8a8_int8 ...]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from sgl_jax.srt.configs.model_config import ModelConfig  # noqa: E402
from sgl_jax.srt.scheduler.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sgl_jax.srt.mem_cache.kv_memory import KVMemory, kv_spec_for  # noqa: E402
from sgl_jax.srt.model_executor.buckets import ShapeBuckets  # noqa: E402
from sgl_jax.srt.forward_batch import ForwardMode  # noqa: E402
from sgl_jax.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sgl_jax.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sgl_jax.srt.server_args import ServerArgs  # noqa: E402

MAX_TOTAL_TOKENS = 8192
CONTEXT = 512


def greedy(runner: ModelRunner, buckets: ShapeBuckets, prompts, steps: int, page_size: int):
    """Prefill all prompts in one batch, then `steps` - 1 decode steps: (tokens [steps][n], logprobs)."""
    memory = KVMemory.create(runner.kv_spec, num_request_slots=len(prompts), context_len=CONTEXT,
                             disable_radix_cache=True)
    reqs = [Req(f"r{i}", p, SamplingParams(max_new_tokens=steps, temperature=0.0), eos_token_ids=[], seed=0)
            for i, p in enumerate(prompts)]
    for r in reqs:
        r.extend_input_len = len(r.origin_input_ids)
    batch = ScheduleBatch(reqs, ForwardMode.EXTEND)
    batch.prepare_for_extend(memory)
    tokens, logprobs = [], []
    for step in range(steps):
        out = runner.forward(batch.build_model_worker_batch(buckets, memory))
        tokens.append(out.next_token_ids.tolist())
        logprobs.append(out.next_token_logprobs.tolist())
        if step == steps - 1:
            break
        for r, t in zip(reqs, out.next_token_ids):
            r.kv_committed_len = r.kv_allocated_len
            r.output_ids.append(int(t))
        batch = ScheduleBatch(reqs, ForwardMode.DECODE)
        assert batch.prepare_for_decode(memory)
    return tokens, logprobs


def describe(runner: ModelRunner) -> dict:
    """Every parameter's PartitionSpec and shape, its bytes on device 0 and in total; the KV buffers' spec."""
    params = {}
    for path, var in nnx.to_flat_state(runner.params):
        arr = var.get_value()
        params[".".join(str(p) for p in path)] = {
            "spec": [None if a is None else a for a in tuple(arr.sharding.spec)],
            "shape": list(arr.shape), "device_bytes": arr.addressable_shards[0].data.nbytes, "bytes": arr.nbytes}
    k = runner.kv_caches[0][0]
    return {"params": params, "kv_spec": list(tuple(k.sharding.spec)), "kv_shape": list(k.shape),
            "kv_device_shape": list(k.addressable_shards[0].data.shape),
            "devices": [d.id for d in runner.mesh.devices.flat]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_path")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--max-prompt-len", type=int, default=40)
    ap.add_argument("--ep", action="store_true", help="--ep-size equal to each --tp (expert parallelism)")
    ap.add_argument("--moe-backend", default="auto")
    ap.add_argument("--quantization", nargs="+", default=[None], help="--quantization methods: results keyed by "
                                                                      "METHOD/TP for more than one")
    args = ap.parse_args()
    results = {}
    for quantization, tp in [(q, tp) for q in args.quantization for tp in args.tp]:
        sa = ServerArgs(model_path=args.model_path, max_total_tokens=MAX_TOTAL_TOKENS, context_length=CONTEXT,
                        disable_precompile=True, tp_size=tp, page_size=args.page_size, random_seed=0,
                        ep_size=tp if args.ep else 1, moe_backend=args.moe_backend, quantization=quantization)
        mc = ModelConfig.from_server_args(sa, "cpu")
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, mc.vocab_size, int(n)).tolist()
                   for n in rng.integers(3, args.max_prompt_len + 1, args.prompts)]
        t_pad = 1 << (args.prompts * args.max_prompt_len - 1).bit_length()  # fits the prefill of every prompt
        buckets = ShapeBuckets((t_pad,), (args.prompts,))
        runner = ModelRunner(sa, mc, buckets=buckets, max_context_len=CONTEXT, num_request_slots=args.prompts,
                             kv_spec_fn=lambda _: kv_spec_for(sa, mc, MAX_TOTAL_TOKENS))
        runner.warmup()  # every shape compiled first: serving must not compile again
        tokens, logprobs = greedy(runner, buckets, prompts, args.steps, args.page_size)
        key = str(tp) if len(args.quantization) == 1 else f"{quantization}/{tp}"
        results[key] = {"tokens": tokens, "logprobs": logprobs, **describe(runner),
                            "num_compiles_after_warmup": runner.num_compiles_after_warmup}
        del runner
        jax.clear_caches()
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
