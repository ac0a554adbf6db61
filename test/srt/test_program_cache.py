"""The executable cache (model_executor/program_cache.py): serialized step programs loaded without tracing.

Real jitted programs on the CPU device, stored to and loaded from a temporary directory: a loaded executable serves
its static argument without the function being traced again and computes what jit computes; the key follows
everything a program is made from (the server flags but the listening ones, the environment, the step spec, the
argument shapes, dtypes and shardings); a damaged file is a miss that compiles; other static arguments go to jit.
The restart of a whole Engine (every step program loaded, the same tokens, no compile while serving) is in
test_warm_start.py.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax.srt.model_executor import program_cache
from sgl_jax.srt.model_executor.compile_stats import compile_counts
from sgl_jax.srt.model_executor.program_cache import CachedProgram, ProgramCache, ProgramCall, fingerprint
from sgl_jax.srt.model_executor.warmup import compile_programs
from sgl_jax.srt.server_args import ServerArgs

TRACES = []  # one entry per trace of `_step`


def _step(params, kv, x, scale):
    """A step program's shape: parameters, a donated cache, inputs, a static argument."""
    TRACES.append(scale)
    kv = kv.at[: x.shape[0]].add(x * scale)
    return kv, params["w"] @ kv[: x.shape[0]].T


def _program():
    return CachedProgram(jax.jit(_step, static_argnums=(3,), donate_argnums=(1,)), 3)


def _args(n=4, scale=2):
    return ({"w": jnp.arange(12.0).reshape(3, 4)}, jnp.zeros((8, 4)), jnp.ones((n, 4)), scale)




@pytest.fixture(autouse=True)
def no_jax_cache():
    """Every compile here is XLA's own: the worker may have JAX's persistent cache on (a server test's set-up ran in
    it), and an executable read back from it is not stored (test_only_what_xla_compiled_is_stored)."""
    from jax._src import compilation_cache  # (reset_cache: JAX decides once per process whether its cache is used)

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    jax.clear_caches()  # (nor from JAX's memory: another test compiled the same program)
    yield
    jax.config.update("jax_enable_compilation_cache", was)
    compilation_cache.reset_cache()


def _warm(cache, program, args, name="step S=4"):
    return compile_programs([(name, lambda: ProgramCall(program, args))], cache=cache)


def test_a_stored_executable_serves_its_layout_without_tracing(tmp_path):
    cache = ProgramCache(str(tmp_path), "f" * 64)
    first = _program()
    stats = _warm(cache, first, _args())
    assert stats["compiled"] == 1 and stats["executables_loaded"] == 0
    assert len(list(tmp_path.glob("*.exe"))) == 1
    kv_a, out_a = first(*_args())  # (the executable compiled at warm-up; jit itself traced once, for it)

    TRACES.clear()
    jax.clear_caches()  # a restart: JAX's in-memory traces and executables gone, a new jit function
    second = _program()
    warm_args, args = _args(), _args()  # (made first: array creation compiles small programs of its own)
    before = compile_counts()
    stats = _warm(cache, second, warm_args)
    assert stats["executables_loaded"] == 1 and stats["loaded_from_cache"] == 1 and stats["trace_seconds"] == 0
    kv_b, out_b = second(*args)
    assert TRACES == [] and (compile_counts() - before).programs == 0  # never traced, nothing compiled
    np.testing.assert_array_equal(np.asarray(out_b), np.asarray(out_a))
    np.testing.assert_array_equal(np.asarray(kv_b), np.asarray(kv_a))
    np.testing.assert_array_equal(np.asarray(out_b), np.asarray(jax.jit(_step, static_argnums=(3,))(*_args())[1]))

    # another static argument is not in the table, and an argument type the executable refuses goes to jit too:
    # each is traced and compiled as before
    TRACES.clear()
    second(*_args(scale=3))
    params, kv, x, scale = _args()
    out = second(params, kv, x.astype(jnp.bfloat16), scale)[1]
    assert TRACES == [3, 2] and out.dtype == jnp.float32


def test_the_least_recently_used_executables_are_evicted_over_the_limit(tmp_path, monkeypatch):
    """Over the limit, the oldest executables (by modification time, which a load renews) are deleted down to 3/4
    of it; dead temporary files go too; a fresh one, the manifests and anything under the limit stay."""
    now = 1_000_000.0
    for i in range(10):  # 10 executables of 100 bytes, used at now - 1000 + i
        path = tmp_path / f"{i:02d}.v{program_cache.FORMAT}.exe"
        path.write_bytes(b"x" * 100)
        os.utime(path, (now - 1000 + i, now - 1000 + i))
    for name, age in (("dead.tmp", 2 * program_cache.STALE_TMP_SECONDS), ("writing.tmp", 5), ("k.keys.json", 9e9)):
        (tmp_path / name).write_bytes(b"y")
        os.utime(tmp_path / name, (now - age, now - age))
    assert program_cache.evict(str(tmp_path), limit=1000, now=now) == 1  # at the limit: only the dead write
    monkeypatch.setenv(program_cache.MAX_BYTES_ENV, "800")
    assert program_cache.evict(str(tmp_path), now=now) == 400  # 1,000 > 800: down to 600
    assert sorted(p.name for p in tmp_path.iterdir()) == (
        [f"{i:02d}.v{program_cache.FORMAT}.exe" for i in range(4, 10)] + ["k.keys.json", "writing.tmp"])
    monkeypatch.setenv(program_cache.MAX_BYTES_ENV, "0")  # no limit
    assert program_cache.evict(str(tmp_path), now=now) == 0 and len(list(tmp_path.glob("*.exe"))) == 6

    # a load renews the file's time, so that what a start uses is the last to go
    cache = ProgramCache(str(tmp_path / "real"), "f" * 64)
    _warm(cache, _program(), _args())
    (path,) = (tmp_path / "real").glob("*.exe")
    os.utime(path, (now, now))
    assert cache.load(path.name.split(".")[0]) is not None and path.stat().st_mtime > now + 1e8


def test_a_damaged_file_is_a_miss_that_compiles(tmp_path, caplog):
    cache = ProgramCache(str(tmp_path), "f" * 64)
    _warm(cache, _program(), _args())
    (path,) = tmp_path.glob("*.exe")
    path.write_bytes(path.read_bytes()[:100])
    TRACES.clear()
    jax.clear_caches()
    program = _program()
    stats = _warm(cache, program, _args())
    assert stats["executables_loaded"] == 0 and TRACES == [2]
    assert "could not load" in caplog.text
    out = program(*_args())[1]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(_step, static_argnums=(3,))(*_args())[1]))
    assert program.executables  # the executable compiled instead serves it


def test_the_key_follows_the_arguments_name_and_static_argument(tmp_path):
    cache, program = ProgramCache(str(tmp_path), "f" * 64), _program()
    key = functools.partial(cache.key, "step S=4")
    base = key(ProgramCall(program, _args()))
    assert base == key(ProgramCall(program, _args()))
    params, kv, x, scale = _args()
    assert cache.key("step S=8", ProgramCall(program, _args())) != base
    assert key(ProgramCall(program, (params, kv, x, 3))) != base
    assert key(ProgramCall(program, (params, kv, jnp.ones((5, 4)), scale))) != base
    assert key(ProgramCall(program, (params, kv, jnp.ones((4, 4), jnp.bfloat16), scale))) != base
    assert key(ProgramCall(program, (params, jnp.zeros((16, 4)), x, scale))) != base
    assert key(ProgramCall(program, ({"w": params["w"], "b": x}, kv, x, scale))) != base
    assert ProgramCache(str(tmp_path), "e" * 64).key("step S=4", ProgramCall(program, _args())) != base


def test_the_fingerprint_follows_the_flags_environment_and_step_spec(monkeypatch):
    sa, devices = ServerArgs(random_seed=1, port=30000), jax.devices()
    base = fingerprint(sa, "model config", "step spec", devices)
    assert base == fingerprint(sa, "model config", "step spec", devices)
    # where it listens and the seed of request seeds shape no program
    assert fingerprint(dataclasses.replace(sa, port=31000, random_seed=7), "model config", "step spec",
                       devices) == base
    for change in (dict(page_size=16), dict(attention_backend="pallas"), dict(num_continuous_decode_steps=4),
                   dict(xla_compiler_options='{"xla_cpu_enable_fast_math": true}'), dict(dtype="bfloat16")):
        assert fingerprint(dataclasses.replace(sa, **change), "model config", "step spec", devices) != base, change
    assert fingerprint(sa, "another model config", "step spec", devices) != base
    assert fingerprint(sa, "model config", "another step spec", devices) != base
    assert fingerprint(sa, "model config", "step spec", devices[:0]) != base
    monkeypatch.setenv("SGL_JAX_CPU_EXTEND_KERNEL", "0")
    assert fingerprint(sa, "model config", "step spec", devices) != base
    monkeypatch.delenv("SGL_JAX_CPU_EXTEND_KERNEL")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert fingerprint(sa, "model config", "step spec", devices) != base


def test_a_model_directory_is_named_by_its_contents_less_the_weights(tmp_path):
    """A copy of a model directory elsewhere (a test's temporary directory, a moved checkpoint) has the fingerprint
    and start key of the original, and so does one whose weights alone differ (they are the programs' arguments);
    one whose config or tokenizer differs has others."""
    devices = jax.devices()

    def model_dir(where, tokenizer=b'{"vocab": 1}', weights=b"w1"):
        d = tmp_path / where
        (d / "sub").mkdir(parents=True)
        (d / "config.json").write_bytes(b'{"hidden_size": 64}')
        (d / "sub" / "tokenizer.json").write_bytes(tokenizer)
        (d / "model.safetensors").write_bytes(weights)
        return str(d)

    def keys(path, tokenizer_path=None):
        sa = ServerArgs(model_path=path, tokenizer_path=tokenizer_path or path)
        config = f"ModelConfig(resolved=ResolvedModel(model_path={path!r}))"  # the model config names its path
        return fingerprint(sa, config, "step spec", devices), program_cache.start_key(sa, devices)

    base = keys(model_dir("a"))
    assert keys(model_dir("b/elsewhere")) == base
    assert keys(model_dir("c", weights=b"other weights")) == base
    changed = keys(model_dir("d", tokenizer=b'{"vocab": 2}'))
    assert changed[0] != base[0] and changed[1] != base[1]
    assert keys(model_dir("e"), tokenizer_path=model_dir("f", tokenizer=b'{"vocab": 2}')) != base
    # a file's digest is remembered by path, size and mtime: one rewritten in place (same size) is read anew
    rewritten = tmp_path / "a" / "sub" / "tokenizer.json"
    rewritten.write_bytes(b'{"vocab": 3}')
    os.utime(rewritten, ns=(1, 1))
    assert keys(str(tmp_path / "a")) not in (base, changed)
    # a hub id or a file is named as given
    assert keys("org/model")[0] != keys("org/other")[0]

    # --lora-paths' adapter directories too, in each of the flag's three forms
    base_model = model_dir("m")

    def with_adapter(item):
        sa = ServerArgs(model_path=base_model, lora_paths=[item])
        return fingerprint(sa, "config", "step spec", devices), program_cache.start_key(sa, devices)

    for i, form in enumerate(("a={}", "{}", '{{"lora_name": "a", "lora_path": "{}"}}')):
        same = [with_adapter(form.format(model_dir(f"l{i}/{where}"))) for where in ("x", "y/z")]
        other = with_adapter(form.format(model_dir(f"l{i}/o", tokenizer=b"{}")))
        assert same[0] == same[1] != other, form


def test_the_switch_and_the_code_fingerprint(monkeypatch, tmp_path):
    sa = ServerArgs(compilation_cache_dir=str(tmp_path))
    cache = program_cache.program_cache_for(sa, "model config", "step spec", jax.devices())
    assert cache is not None and cache.directory == str(tmp_path / program_cache.DIR_NAME)
    monkeypatch.setenv(program_cache.SWITCH_ENV, "0")
    assert program_cache.program_cache_for(sa, "model config", "step spec", jax.devices()) is None
    code = program_cache.code_fingerprint()
    assert len(code) == 64 and code == program_cache.code_fingerprint()


def test_the_code_fingerprint_names_built_kernels_and_hashes_sources(tmp_path):
    """Two builds of the same sources share the code fingerprint (a fresh clone's kernel library differs in bytes:
    its build directory is in the debug information); a changed source, or a kernel built or not, does not."""
    def tree(where, so=b"build 1", cc=b"int f();", built=True):
        root = tmp_path / where
        (root / "kernels" / "csrc").mkdir(parents=True)
        (root / "kernels" / "cpu.py").write_bytes(b"TARGET = 'f'")
        (root / "kernels" / "csrc" / "f.cc").write_bytes(cc)
        if built:
            (root / "kernels" / "_f.ffi.cpython-311-x86_64-linux-gnu.so").write_bytes(so)
        return program_cache.tree_fingerprint(str(root))

    base = tree("a")
    assert tree("b", so=b"build 2 elsewhere") == base
    assert tree("c", cc=b"int f(int);") != base
    assert tree("d", built=False) != base


# A program with fusions XLA's CPU loader links by name (a gather feeding a matmul): stored when XLA compiles it here
# (in "a"), and when JAX's cache answers it (in "b", from JAX's own entry); each runs when loaded again.
FROM_JAX_CACHE = r"""
import os, sys, jax, jax.numpy as jnp, numpy as np
root = sys.argv[1]
jax.config.update("jax_compilation_cache_dir", os.path.join(root, "jax"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from sgl_jax.srt.model_executor.program_cache import CachedProgram, ProgramCache, ProgramCall
from sgl_jax.srt.model_executor.warmup import compile_programs

def f(tab, idx, w, n):
    return jnp.tanh(tab[idx].reshape(-1, 16) @ w).sum(0) * n, jnp.take_along_axis(tab[:64], idx[:, None] % 8, axis=1)

args = (jnp.arange(4096.0).reshape(256, 16), jnp.arange(64) % 256, jnp.ones((16, 16)), 2)
def warm(where):
    program = CachedProgram(jax.jit(f, static_argnums=(3,)), 3)
    stats = compile_programs([("p", lambda: ProgramCall(program, args))], cache=ProgramCache(where, "f" * 64))
    return program, stats
program, first = warm(os.path.join(root, "a"))  # XLA compiles: stored
expected = [np.asarray(o) for o in program(*args)]
jax.clear_caches()
_, hit = warm(os.path.join(root, "b"))  # JAX's cache has it: read back, stored from JAX's entry
jax.clear_caches()
program, loaded = warm(os.path.join(root, "a"))
out = [np.asarray(o) for o in program(*args)]
jax.clear_caches()
program, loaded_b = warm(os.path.join(root, "b"))
out_b = [np.asarray(o) for o in program(*args)]
print("RESULT", first["compiled"], first["loaded_from_cache"], hit["compiled"], hit["loaded_from_cache"],
      sorted(os.listdir(root)), len(os.listdir(os.path.join(root, "a"))), len(os.listdir(os.path.join(root, "b"))),
      loaded["executables_loaded"], loaded_b["executables_loaded"], all((a == b).all() for a, b in zip(out, expected)),
      all((a == b).all() for a, b in zip(out_b, expected)))
"""


def test_what_jax_cache_answered_is_stored_from_its_entry(tmp_path):
    """An executable XLA compiled is stored, and so is one JAX read back from its persistent cache, from the bytes of
    JAX's own entry: both run when loaded again and give the first run's values. (Re-serialized instead, the second
    lacks the functions XLA's CPU loader linked: loaded again, it failed with "Function gather_bitcast_fusion not
    found" or gave other values.)"""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", FROM_JAX_CACHE, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    assert line == "RESULT 1 0 0 1 ['a', 'b', 'jax'] 1 1 1 1 True True", line


def test_a_program_without_static_argument_is_looked_up_by_its_key(tmp_path):
    """The logprob-style programs: looked up by their input's rows (`key_of`), called with every argument."""
    def head(params, rows):
        TRACES.append(rows.shape[0])
        return rows @ params["w"].T

    def program():
        return CachedProgram(jax.jit(head), key_of=lambda args: args[1].shape[0])

    params, rows = {"w": jnp.arange(12.0).reshape(3, 4)}, jnp.ones((16, 4))
    cache = ProgramCache(str(tmp_path), "f" * 64)
    compile_programs([("head R=16", lambda: ProgramCall(program(), (params, rows)))], cache=cache)
    TRACES.clear()
    jax.clear_caches()
    loaded = program()
    stats = compile_programs([("head R=16", lambda: ProgramCall(loaded, (params, rows)))], cache=cache)
    assert stats["executables_loaded"] == 1 and list(loaded.executables) == [16]
    np.testing.assert_array_equal(np.asarray(loaded(params, rows)), np.asarray(rows @ params["w"].T))
    assert TRACES == []
    loaded(params, jnp.ones((8, 4)))  # another row count: jit
    assert TRACES == [8]


def test_a_restart_loads_the_last_starts_executables_ahead(tmp_path):
    """start_prefetch / end_prefetch: a start notes the keys warm-up used in a manifest named by its flags; the next
    start with those flags loads them on threads of its own before warm-up asks, and warm-up takes them. Another
    flag names another manifest; a listed key warm-up does not ask for is loaded for nothing, dropped, and
    left out of the rewritten manifest."""
    args = ServerArgs(compilation_cache_dir=str(tmp_path))
    directory = tmp_path / program_cache.DIR_NAME
    cache = ProgramCache(str(directory), "f" * 64)
    assert not program_cache.prefetching()  # (no runner of this process left one begun)
    assert program_cache.start_prefetch(args) == 0  # no manifest yet
    assert _warm(cache, _program(), _args())["compiled"] == 1
    assert program_cache.end_prefetch() == {"listed": 0, "taken": 0, "unused": 0, "used": 1}
    (manifest,) = directory.glob("*.keys.json")

    TRACES.clear()
    jax.clear_caches()  # a restart
    assert program_cache.start_prefetch(args) == 1
    program = _program()
    warm_args, args_ = _args(), _args()
    stats = _warm(cache, program, warm_args)
    assert stats["executables_loaded"] == 1 and stats["executables_loaded_ahead"] == 1 and TRACES == []
    assert program_cache.end_prefetch() == {"listed": 1, "taken": 1, "unused": 0, "used": 1}
    np.testing.assert_array_equal(np.asarray(program(*args_)[1]),
                                  np.asarray(jax.jit(_step, static_argnums=(3,))(*_args())[1]))

    # other flags: another manifest (none yet), nothing loaded ahead
    assert program_cache.start_prefetch(ServerArgs(compilation_cache_dir=str(tmp_path), max_running_requests=7)) == 0
    assert program_cache.end_prefetch()["listed"] == 0

    # the same flags, but warm-up asks for another program: the listed one is dropped, the manifest now names the
    # new one
    old_keys = manifest.read_text()
    assert program_cache.start_prefetch(args) == 1
    stats = _warm(cache, _program(), _args(scale=3))
    assert stats["compiled"] == 1 and stats["executables_loaded_ahead"] == 0
    assert program_cache.end_prefetch() == {"listed": 1, "taken": 0, "unused": 1, "used": 1}
    assert manifest.read_text() != old_keys and len(list(directory.glob("*.exe"))) == 2

    # a start that failed notes nothing: the manifest stays as the last good start wrote it
    new_keys = manifest.read_text()
    assert program_cache.start_prefetch(args) == 1
    _warm(cache, _program(), _args(scale=5))
    assert program_cache.end_prefetch(record=False)["used"] == 1 and manifest.read_text() == new_keys
