"""Time XLA's deserialization of one persistent-compilation-cache entry (what a restart pays per program).

    JAX_PLATFORMS=cpu python deserialize_probe.py ~/.cache/sgl_jax/jax_compilation_cache/jit_forward_only-<key>-cache 3
    perf record -g -o perf.data python deserialize_probe.py <the same entry> 3 && perf report -i perf.data --children

A forward_only entry needs no custom call handler; decode entries need sgl_jax's CPU decode kernel registered first.
Uses JAX internals (jax._src.compilation_cache): a probe for an investigation, not part of the package.
"""
import sys
import time

import jax
from jax._src import compilation_cache as cc
from jax._src.lib import xla_client

backend = jax.devices()[0].client
devices = xla_client.DeviceList(tuple(jax.devices()[:1]))
with open(sys.argv[1], "rb") as f:
    serialized, compile_time = cc.extract_executable_and_time(cc.decompress_executable(f.read()))
print(f"serialized executable: {len(serialized)} bytes (compiled in {compile_time} s)")
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 1):
    t0 = time.perf_counter()
    backend.deserialize_executable(serialized, devices, xla_client.CompileOptions())
    print(f"deserialize {time.perf_counter() - t0:.2f} s", flush=True)
