"""Compiled programs kept on disk between starts, so that a restart skips tracing them.

JAX's persistent compilation cache saves XLA's compile, but its key is a hash of the lowered module, so every start
still traces and lowers each program in Python first (SmolLM2's 13 warm-up programs: 4-6 s of a 15-18 s restart on
2 cores). This module keeps each runner program's compiled executable (``jax.experimental.serialize_executable``)
under a key computed without tracing: a hash of everything the program is made from (`fingerprint`: this package's
sources (Python and C++) and built kernels' names, jax and jaxlib, the XLA and JAX environment, the devices and the
host CPU's features, the runner's step spec, model config and server flags; a model or tokenizer directory by its
files less the weights, not by its path) plus the program's name, its static argument and the shapes, dtypes and
shardings of its arguments (`ProgramCache.key`). A restart with the same key deserializes the executable
(~0.1-0.5 s on 2 cores, on the compile threads) and never traces it. An executable XLA compiled in this process is
stored as `jax.experimental.serialize_executable` writes it. One that JAX read back from its persistent cache is
not re-serialized (that copy lacks the functions XLA's CPU loader linked into it: once loaded again it fails or
computes wrong values, jax 0.10.2): it is stored with the bytes of JAX's own cache entry instead (`watch_cache_hits`
notes the entry's key per compiling thread), so that a start on a warm JAX cache stores its programs too.

`CachedProgram` wraps one jitted function: calls whose static argument (or key) has a loaded executable run it (the
same C++ dispatch as jit's); any other call, or one whose arguments' types the executable refuses, goes to the
jitted function as before, so a signature never seen at warm-up compiles as it always did, and counts as a compile
after warm-up (compile_stats).

A start also loads ahead (`start_prefetch`, called once the devices are known, before the weights load): each start
writes the keys it used (and its auto-sized KV pool) to a manifest named by what is known that early (`start_key`:
code, environment, devices, server flags); the next start with the same `start_key` deserializes those files on
threads of their own while its weights load, and warm-up then finds them loaded. The manifest is a hint: a key it
names that warm-up does not ask for is loaded for nothing and dropped, never used.

Off with ``SGL_JAX_EXECUTABLE_CACHE=0``, and with several JAX processes (--nnodes > 1), whose executables span
hosts. A file that fails to load is logged and treated as absent; the program is then traced and compiled.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import logging
import os
import pickle
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional

import jax

logger = logging.getLogger(__name__)

SWITCH_ENV = "SGL_JAX_EXECUTABLE_CACHE"  # "0": trace and compile (or load from JAX's cache) every start
FORMAT = 2  # the files' layout (in their names: a change makes every older file a miss); 2: zlib-compressed
DIR_NAME = "sgl_jax_executables"  # under --compilation-cache-dir
# the directory's size above which the least recently used executables are deleted (bytes; "0": never), checked at
# the end of each start's warm-up (`evict`)
MAX_BYTES_ENV = "SGL_JAX_EXECUTABLE_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 2 << 30
EVICT_TO_FRACTION = 0.75  # an eviction deletes down to this share of the limit, so that it runs seldom
STALE_TMP_SECONDS = 3600  # a temporary file this old is a write that died
# ServerArgs fields that cannot shape a program (where it listens, what it logs, the seed of request seeds): left
# out of the fingerprint so that restarts on another port or seed find their programs. Every other field is in it.
NOT_PROGRAM_FLAGS = frozenset({"host", "port", "random_seed", "log_level", "log_requests", "api_key",
                               "admin_api_key", "served_model_name", "watchdog_timeout"})
# environment variables that move only the KV pool's size (the pool's shape is in every key through the arguments),
# or this cache's size limit
NOT_PROGRAM_ENV = frozenset({"SGL_JAX_TEST_AVAILABLE_MEMORY_BYTES", "SGL_JAX_EXECUTABLE_CACHE_MAX_BYTES"})


def enabled() -> bool:
    """Whether the executable cache is on: ``SGL_JAX_EXECUTABLE_CACHE`` is not "0" and this is JAX's only
    process."""
    return os.environ.get(SWITCH_ENV, "1") != "0" and jax.process_count() == 1


SOURCE_SUFFIXES = (".py", ".cc", ".h")  # hashed by their bytes
BUILT_SUFFIXES = (".so",)  # hashed by their names alone


def tree_fingerprint(root: str) -> str:
    """sha256 (hex) of the source files under `root` (SOURCE_SUFFIXES: relative paths and bytes) and of the names
    of its built libraries (BUILT_SUFFIXES). A built kernel is named, not hashed: an executable calls it by its
    registered name at run time and holds none of its code, and its bytes differ between builds of the same source
    (the build directory is in its debug information), so hashing them made every fresh clone miss."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if name.endswith(SOURCE_SUFFIXES):
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
            elif name.endswith(BUILT_SUFFIXES):
                h.update(b"built " + os.path.relpath(path, root).encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """sha256 (hex) of jax's and jaxlib's versions and this package's `tree_fingerprint` (its Python and C++ sources,
    the names of its built kernels): a program's code. Computed once per process (~20 ms)."""
    import jaxlib

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the sgl_jax package
    return _sha256((f"jax {jax.__version__} jaxlib {jaxlib.__version__}", tree_fingerprint(root)))


def _host_cpu_flags() -> str:
    """The host CPU's feature flags (/proc/cpuinfo's first ``flags`` line; "" elsewhere): XLA's CPU code is compiled
    for the features of the machine it runs on."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


# flags that name a model or tokenizer directory (and --lora-paths' adapters): such a directory is named in the
# fingerprint by its contents less the weights (`_directory_digest`), not by its path, so that a copy elsewhere (a
# test's temporary directory, a moved checkpoint) finds the programs of the original. Weights are the programs'
# arguments (their shapes, dtypes and tree are in every key through `_arg_signature`), never part of a program.
MODEL_DIR_FLAGS = ("model_path", "tokenizer_path", "speculative_draft_model_path")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5", ".ckpt", ".pkl")
DIGEST_MAX_FILE_BYTES = 256 << 20  # a larger non-weight file is named by its size alone


def _directory_digest(path: str) -> str:
    """sha256 (hex) of directory `path`'s files but weights (WEIGHT_SUFFIXES): their relative paths and bytes (size
    alone above DIGEST_MAX_FILE_BYTES). Config, tokenizer and chat template files: ~5-60 ms for a 2-33 MB
    tokenizer."""
    h = hashlib.sha256(b"directory")
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(WEIGHT_SUFFIXES):
                continue
            full = os.path.join(dirpath, name)
            h.update(os.path.relpath(full, path).encode() + b"\0")
            try:
                st = os.stat(full)
                if st.st_size > DIGEST_MAX_FILE_BYTES:
                    h.update(f"size {st.st_size}".encode())
                    continue
                h.update(_file_digest(full, st.st_size, st.st_mtime_ns))
            except OSError:
                h.update(b"unreadable")
    return h.hexdigest()


@functools.lru_cache(maxsize=256)
def _file_digest(path: str, size: int, mtime_ns: int) -> bytes:
    """sha256 of file `path`'s bytes, remembered by (path, size, mtime): a start digests its model directory for
    both `start_key` and `fingerprint` (and a draft model's again); a rewritten file is read anew. Raises OSError."""
    del size, mtime_ns  # the cache key only
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).digest()


def _lora_path_of(item: str) -> str:
    """The adapter path of one ``--lora-paths`` item: ``name=path``, a bare path, or JSON with ``lora_path``."""
    if item.lstrip().startswith("{"):
        try:
            return str(json.loads(item).get("lora_path", ""))
        except (ValueError, AttributeError):
            return ""
    return item.split("=", 1)[1] if "=" in item else item


def _model_directories(server_args) -> Dict[str, str]:
    """{path: "<directory sha256:..>"} for each MODEL_DIR_FLAGS value and ``--lora-paths`` adapter that is an
    existing directory, under both its given and its absolute spelling (the model config holds the absolute one)."""
    values = [getattr(server_args, flag_name, None) for flag_name in MODEL_DIR_FLAGS]
    values += [_lora_path_of(item) for item in (getattr(server_args, "lora_paths", None) or [])
               if isinstance(item, str)]
    names: Dict[str, str] = {}
    for value in values:
        if isinstance(value, str) and value and os.path.isdir(value):
            token = f"<directory sha256:{_directory_digest(value)}>"
            for spelling in (value, os.path.abspath(value)):
                names.setdefault(spelling, token)
    return names


def _without_model_paths(text: str, directories: Dict[str, str]) -> str:
    """`text` with each path of `directories` replaced by its contents' token (longest path first, so that a
    directory inside another is replaced whole)."""
    for path in sorted(directories, key=len, reverse=True):
        text = text.replace(path, directories[path])
    return text


def _program_env() -> str:
    return repr(sorted((k, v) for k, v in os.environ.items()
                       if k.startswith(("JAX_", "XLA_", "SGL_JAX_")) and k not in NOT_PROGRAM_ENV))


def _program_flags(server_args) -> str:
    return repr(sorted((k, repr(v)) for k, v in vars(server_args).items() if k not in NOT_PROGRAM_FLAGS))


def _devices(devices: Iterable) -> str:
    return repr([(d.platform, d.device_kind, d.id, d.process_index) for d in devices])


def _sha256(parts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part.encode()).digest())
    return h.hexdigest()


def fingerprint(server_args, model_config, step_spec, devices: Iterable) -> str:
    """sha256 (hex) of what a runner's programs are made from besides their arguments: `code_fingerprint`, the
    environment variables that JAX, XLA and this package read (``JAX_*``, ``XLA_*``, ``SGL_JAX_*``, but
    NOT_PROGRAM_ENV), `devices` (platform, kind, id, process), the host CPU's flags, `step_spec` (the static part
    of every step program, the model's graph included), `model_config` and every ServerArgs field but
    NOT_PROGRAM_FLAGS. Each part is its repr, with the model and tokenizer directories (MODEL_DIR_FLAGS) named by
    their contents less the weights instead of their paths; a part whose repr changed makes a miss, never a wrong
    program."""
    directories = _model_directories(server_args)
    return _sha256((code_fingerprint(), _program_env(), _devices(devices), _host_cpu_flags(),
                    _without_model_paths(repr(step_spec), directories),
                    _without_model_paths(repr(model_config), directories),
                    _without_model_paths(_program_flags(server_args), directories)))


def start_key(server_args, devices: Iterable) -> str:
    """sha256 (hex) of what is known of a start before its model is read: `fingerprint`'s parts less the step spec
    and the model config (the model is named by the flags). It names the manifest of keys `start_prefetch` loads."""
    return _sha256(("start", code_fingerprint(), _program_env(), _devices(devices), _host_cpu_flags(),
                    _without_model_paths(_program_flags(server_args), _model_directories(server_args))))


def _arg_signature(args: tuple) -> str:
    """The shapes, dtypes and shardings of `args`' leaves and their tree structure, as text."""
    leaves, tree = jax.tree.flatten(args)
    parts = [str(tree)]
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        parts.append(f"{getattr(leaf, 'shape', ())}|{getattr(leaf, 'dtype', type(leaf).__name__)}|{sharding}|"
                     f"{getattr(leaf, 'weak_type', False)}")
    return "\n".join(parts)


def executable_path(directory: str, key: str) -> str:
    """Where the executable stored under `key` lies in `directory` (the layout FORMAT is in the name)."""
    return os.path.join(directory, f"{key}.v{FORMAT}.exe")


def _write_atomically(path: str, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in its directory (created if absent), renamed over it:
    a reader sees the old file or the new one, never part of one. Raises OSError."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


_hits = threading.local()  # the JAX cache key of the last compile of this thread that JAX's cache answered


def watch_cache_hits() -> None:
    """Note, per thread, the key of each compile JAX's persistent cache answers (`last_cache_hit`), by wrapping
    ``jax._src.compiler.log_persistent_cache_hit`` (called with it on every hit). Idempotent; does nothing where
    that function is absent (another jax): such executables are then simply not stored."""
    try:
        from jax._src import compiler
    except ImportError:
        return
    logged = getattr(compiler, "log_persistent_cache_hit", None)
    if logged is None or getattr(logged, "_notes_hits", False):
        return

    def log_persistent_cache_hit(module_name, cache_key, *args, **kwargs):
        _hits.key = cache_key
        return logged(module_name, cache_key, *args, **kwargs)

    log_persistent_cache_hit._notes_hits = True
    compiler.log_persistent_cache_hit = log_persistent_cache_hit


def forget_cache_hit() -> None:
    """Clear this thread's `last_cache_hit` (before a compile)."""
    _hits.key = None


def last_cache_hit() -> Optional[str]:
    """The JAX cache key of this thread's last compile that JAX's persistent cache answered since
    `forget_cache_hit` (None: none, or `watch_cache_hits` not in place)."""
    return getattr(_hits, "key", None)


def _jax_cache_entry(compiled, jax_cache_key: str) -> Optional[bytes]:
    """The serialized XLA executable JAX's persistent cache holds under `jax_cache_key` (the bytes JAX itself
    deserializes on a hit), or None when the entry is gone."""
    from jax._src import compilation_cache

    cache = compilation_cache._get_cache(compiled.runtime_executable().client)
    raw = cache.get(jax_cache_key) if cache is not None else None
    if raw is None:
        return None
    return compilation_cache.extract_executable_and_time(compilation_cache.decompress_executable(raw))[0]


def _serialize(compiled, executable_bytes: Optional[bytes] = None) -> tuple:
    """(blob, in_tree, out_tree) as ``jax.experimental.serialize_executable.serialize`` gives them, with the XLA
    executable written as `executable_bytes` when given (JAX's cache entry) instead of serialized from `compiled`.
    Raises what serialize raises for an executable it cannot write (closed-over constants)."""
    import io

    from jax._src.lib import _jax, xla_client
    from jax.experimental.serialize_executable import _JaxPjrtPickler, serialize

    if executable_bytes is None:
        return serialize(compiled)
    if compiled._params.const_args:
        raise NotImplementedError("serialize_executables with const_args")

    class FromJaxCache(_JaxPjrtPickler):
        def persistent_id(self, obj):
            if isinstance(obj, (xla_client.LoadedExecutable, _jax.Executable)):
                return ("exec", executable_bytes)
            return super().persistent_id(obj)

    args_info_flat, in_tree = jax.tree_util.tree_flatten(compiled.args_info)
    with io.BytesIO() as f:
        FromJaxCache(f).dump((compiled._executable._unloaded_executable, args_info_flat, compiled._no_kwargs))
        return f.getvalue(), in_tree, compiled.out_tree


def read_executable(path: str, devices: Dict[int, Any]) -> Optional[Any]:
    """The ``jax.stages.Compiled`` stored at `path` (`ProgramCache.store`), loaded onto `devices` (id -> device),
    or None (logged) when the file is unreadable, of another format, or names a device not in `devices`."""
    from jax.experimental.serialize_executable import deserialize_and_load

    try:
        with open(path, "rb") as f:
            entry = pickle.loads(zlib.decompress(f.read()))
        if entry.get("format") != FORMAT:
            return None
        exe_devices = [devices[i] for i in entry["devices"]]
        compiled = deserialize_and_load(entry["executable"], entry["in_tree"], entry["out_tree"],
                                        backend=exe_devices[0].client, execution_devices=exe_devices)
        try:
            os.utime(path)  # (its modification time is its last use: `evict` deletes the least recently used)
        except OSError:
            pass
        return compiled
    except FileNotFoundError:  # (evicted since a manifest named it: a plain miss)
        logger.debug("Executable cache: %s is gone; compiling instead", path)
        return None
    except Exception as e:  # (a damaged or foreign file is a miss: the program is traced and compiled instead)
        logger.warning("Executable cache: could not load %s (%s: %s); compiling instead", path, type(e).__name__, e)
        return None


def max_bytes() -> int:
    """``SGL_JAX_EXECUTABLE_CACHE_MAX_BYTES`` (bytes; 0: no limit), else DEFAULT_MAX_BYTES (2 GiB). Raises
    ValueError for a value that is not an integer."""
    return int(os.environ.get(MAX_BYTES_ENV, DEFAULT_MAX_BYTES))


def evict(directory: str, limit: Optional[int] = None, now: Optional[float] = None) -> int:
    """Keep `directory`'s executables under `limit` bytes (None: `max_bytes`; 0: no limit): when they exceed it,
    delete the least recently used (oldest modification time: a load renews it) until they fill EVICT_TO_FRACTION
    of it. Temporary files of writes older than STALE_TMP_SECONDS are deleted too. Another process may delete or
    write files meanwhile: a file gone is skipped. Returns the bytes deleted."""
    limit = max_bytes() if limit is None else limit
    now = time.time() if now is None else now
    files, freed = [], 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        try:
            st = entry.stat()
            if entry.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_SECONDS:
                os.unlink(entry.path)
                freed += st.st_size
            elif entry.name.endswith(".exe"):
                files.append((st.st_mtime, st.st_size, entry.path))
        except OSError:
            continue
    total = sum(size for _, size, _ in files)
    if limit <= 0 or total <= limit:
        return freed
    target, evicted = int(limit * EVICT_TO_FRACTION), 0
    for _, size, path in sorted(files):
        if total <= target:
            break
        try:
            os.unlink(path)
        except OSError:
            continue
        total, freed, evicted = total - size, freed + size, evicted + 1
    logger.info("Executable cache: deleted the %d least recently used executables (%.0f MB) to stay under %.0f MB",
                evicted, freed / 1e6, limit / 1e6)
    return freed


class CachedProgram:
    """A jitted function plus the executables warm-up loaded or compiled for it, looked up by its static argument
    (at `static_index`: the step programs' layout, left out of the executable's call) or, for a function without
    one, by `key_of(args)` (e.g. the row count of its input). Calls take the jitted function's own arguments.

    Attributes:
        fn: the ``jax.jit`` function (its `lower` is this object's `lower`).
        executables: lookup key -> ``jax.stages.Compiled``.
    """

    __slots__ = ("fn", "static_index", "key_of", "executables")

    def __init__(self, fn, static_index: Optional[int] = None, key_of: Optional[Callable[[tuple], Any]] = None):
        if (static_index is None) == (key_of is None):
            raise ValueError("give exactly one of static_index and key_of")
        self.fn, self.static_index, self.key_of, self.executables = fn, static_index, key_of, {}

    def lookup(self, args: tuple):
        """The table key of a call with `args`."""
        return args[self.static_index] if self.key_of is None else self.key_of(args)

    def __call__(self, *args):
        i = self.static_index
        exe = self.executables.get(args[i] if i is not None else self.key_of(args))
        if exe is None:
            return self.fn(*args)
        try:
            return exe(*args[:i], *args[i + 1:]) if i is not None else exe(*args)
        except TypeError:  # (checked before it runs: an argument type warm-up did not see goes to jit, as before)
            return self.fn(*args)

    def lower(self, *args):
        return self.fn.lower(*args)


@dataclass
class ProgramCall:
    """One warm-up program of a `CachedProgram`: its arguments as serving passes them (arrays or
    ``jax.ShapeDtypeStruct``; a static one in place)."""

    program: CachedProgram
    args: tuple

    @property
    def lookup_key(self):
        """The call's table key (`CachedProgram.lookup`)."""
        return self.program.lookup(self.args)

    def lower(self):
        return self.program.fn.lower(*self.args)

    def use(self, compiled) -> None:
        """Serve this call's signature with `compiled` from now on."""
        self.program.executables[self.lookup_key] = compiled


class ProgramCache:
    """Serialized executables in `directory` (created on first store), keyed by `fingerprint` plus each program's
    name and `ProgramCall` signature, loaded onto `devices` (the runner's mesh; None: all of JAX's devices).

    Files are zlib-compressed pickles: load only a directory you write yourself (as JAX's own cache)."""

    def __init__(self, directory: str, fingerprint_hex: str, devices: Optional[Iterable] = None):
        self.directory, self.fingerprint = directory, fingerprint_hex
        self.devices = {d.id: d for d in (jax.devices() if devices is None else devices)}
        self.loaded_ahead = 0  # `load`s answered by an executable `start_prefetch` had loaded
        watch_cache_hits()  # (so that warm-up can store what JAX's cache answers)

    def key(self, name: str, call: ProgramCall) -> str:
        """sha256 (hex) of the fingerprint, `name`, the static argument's repr and the arguments' signature."""
        h = hashlib.sha256(self.fingerprint.encode())
        for part in (name, repr(call.lookup_key), _arg_signature(call.args)):
            h.update(hashlib.sha256(part.encode()).digest())
        return h.hexdigest()

    def _path(self, key: str) -> str:
        return executable_path(self.directory, key)

    def has(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def load(self, key: str) -> Optional[Any]:
        """The executable stored under `key` as a ``jax.stages.Compiled`` on this cache's devices (the one
        `start_prefetch` loaded ahead, when it did), or None (logged) when the file is unreadable, of another format,
        or names a device that is not one of them."""
        ahead = _prefetch.take(self.directory, key) if _prefetch is not None else None
        compiled = ahead.result() if ahead is not None else None  # (None: it failed there too, and was logged)
        if compiled is not None and {d.id for d in compiled.runtime_executable().local_devices()} <= set(self.devices):
            self.loaded_ahead += 1
        else:
            compiled = read_executable(self._path(key), self.devices)
        if compiled is not None and _prefetch is not None:
            _prefetch.used(self.directory, key)
        return compiled

    def store(self, key: str, compiled, jax_cache_key: Optional[str] = None) -> bool:
        """Write `compiled` under `key` (atomically: a temporary file renamed): XLA's executable serialized from
        `compiled`, or, for one JAX's persistent cache answered, the bytes of that cache's entry `jax_cache_key`.
        Returns False (logged at debug) for an executable JAX cannot serialize (one with closed-over constants), a
        cache entry that is gone, or a directory that cannot be written."""
        try:
            executable_bytes = None if jax_cache_key is None else _jax_cache_entry(compiled, jax_cache_key)
            if jax_cache_key is not None and executable_bytes is None:
                return False
            blob, in_tree, out_tree = _serialize(compiled, executable_bytes)
            devices = [d.id for d in compiled.runtime_executable().local_devices()]
            # (zlib level 1: a 12.8 MB executable pickles to 2.2 MB in ~0.2 s and inflates in ~0.1 s)
            data = zlib.compress(pickle.dumps({"format": FORMAT, "executable": blob, "in_tree": in_tree,
                                               "out_tree": out_tree, "devices": devices}), 1)
            _write_atomically(self._path(key), data)
            if _prefetch is not None:
                _prefetch.used(self.directory, key)
            return True
        except Exception as e:
            logger.debug("Executable cache: not stored (%s: %s)", type(e).__name__, e)
            return False


def program_cache_for(server_args, model_config, step_spec, devices) -> Optional[ProgramCache]:
    """The runner's `ProgramCache` under ``<--compilation-cache-dir>/sgl_jax_executables``, or None when `enabled`
    says no or there is no compilation cache directory."""
    if not enabled() or not getattr(server_args, "compilation_cache_dir", None):
        return None
    devices = list(devices)
    return ProgramCache(os.path.join(server_args.compilation_cache_dir, DIR_NAME),
                        fingerprint(server_args, model_config, step_spec, devices), devices)


@dataclass
class Prefetch:
    """Executables loaded ahead of warm-up (`start_prefetch`), and the keys this start used (`end_prefetch`
    writes them for the next start).

    Attributes:
        directory: the executables' directory.
        manifest: the path of the key list this start reads and rewrites (``<start_key>.keys.json``).
        listed: the keys the manifest named, in its order.
        futures: key -> its load (a Future of a ``jax.stages.Compiled`` or None) not yet taken.
        keys_used: the keys warm-up loaded or stored this start, in its order.
        pool_tokens_before, pool_tokens: the auto-sized KV pool (tokens) of the last start and of this one
            (`remember_pool_tokens`), kept in the manifest beside the keys.
    """

    directory: str
    manifest: str
    listed: List[str]
    pool_tokens_before: Optional[int] = None  # the KV pool the last start chose (memory_budget: kept when it fits)
    futures: Dict[str, concurrent.futures.Future] = field(default_factory=dict)
    keys_used: List[str] = field(default_factory=list)
    pool_tokens: Optional[int] = None  # this start's

    def take(self, directory: str, key: str) -> Optional[concurrent.futures.Future]:
        """The load of `key` begun ahead (removed from `futures`), or None."""
        return self.futures.pop(key, None) if directory == self.directory else None

    def used(self, directory: str, key: str) -> None:
        if directory == self.directory and key not in self.keys_used:
            self.keys_used.append(key)


_prefetch: Optional[Prefetch] = None  # this process's start, between start_ and end_prefetch (its runner's)


def start_prefetch(server_args, register_kernels: Callable[[], object] = lambda: None) -> int:
    """Begin loading, on threads of their own, the executables the last start with this
    `start_key` used (its manifest): warm-up's `ProgramCache.load` then takes them instead of reading the files.
    Call it once the devices are known and before the weights load, with `register_kernels` registering the
    custom-call kernels the executables name (an executable that calls one loads only once it is registered).
    Loading holds the GIL for part of its time: begun during the model config's imports it made them about 2x
    slower; beside the weights' reading and the KV pool's zeroing (numpy, XLA) it costs less. Returns how many loads
    began (0: no manifest, cache off, no compilation cache directory, or a start already prefetching)."""
    global _prefetch
    if _prefetch is not None or not enabled() or not getattr(server_args, "compilation_cache_dir", None):
        return 0  # (a second runner of the process, e.g. a draft model's, shares the first one's)
    devices = jax.devices()
    directory = os.path.join(server_args.compilation_cache_dir, DIR_NAME)
    manifest = os.path.join(directory, f"{start_key(server_args, devices)}.keys.json")
    try:
        with open(manifest) as f:
            record = json.load(f)
        listed = [k for k in record["keys"] if isinstance(k, str)]
        before = record.get("kv_pool_tokens")
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        listed, before = [], None
    _prefetch = session = Prefetch(directory, manifest, listed, before if isinstance(before, int) else None)
    if not listed:
        return 0
    register_kernels()
    by_id = {d.id: d for d in devices}
    # (not at a lower priority: warm-up waits for these loads, and a lowered thread starves on a busy host)
    pool = concurrent.futures.ThreadPoolExecutor(max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="prefetch")
    for key in listed:
        session.futures[key] = pool.submit(read_executable, executable_path(directory, key), by_id)
    pool.shutdown(wait=False)  # (its threads end with the last load)
    logger.info("Executable cache: loading %d executables ahead (the last start's with these flags)", len(listed))
    return len(listed)


def prefetching() -> bool:
    """Whether a `start_prefetch` of this process has not ended yet (its runner's warm-up ends it)."""
    return _prefetch is not None


def end_prefetch(record: bool = True) -> Optional[dict]:
    """End this process's `start_prefetch`: drop the loads warm-up did not take (cancelled where not begun), write
    the keys warm-up used and the KV pool's size as the manifest when they differ from it (unless `record` is
    False: a start that failed), and return {"listed", "taken", "unused", "used"} (None without a
    `start_prefetch`)."""
    global _prefetch
    session, _prefetch = _prefetch, None
    if session is None:
        return None
    for f in session.futures.values():
        f.cancel()
    unused = len(session.futures)
    changed = (session.keys_used, session.pool_tokens) != (session.listed, session.pool_tokens_before)
    if record and session.keys_used and changed:
        try:
            _write_atomically(session.manifest, json.dumps(
                {"keys": session.keys_used, "kv_pool_tokens": session.pool_tokens}).encode())
        except OSError as e:
            logger.debug("Executable cache: manifest not written (%s)", e)
    if record and session.keys_used:
        try:
            evict(session.directory)
        except ValueError as e:
            logger.warning("Executable cache: %s is not a number of bytes (%s); nothing evicted", MAX_BYTES_ENV, e)
    stats = {"listed": len(session.listed), "taken": len(session.listed) - unused, "unused": unused,
             "used": len(session.keys_used)}
    if session.listed:
        logger.info("Executable cache: %d of %d executables loaded ahead were used", stats["taken"], stats["listed"])
    return stats


def pool_tokens_before() -> Optional[int]:
    """The auto-sized KV pool (tokens) the last start with this `start_key` chose (None: none noted, or no
    `start_prefetch` in this process)."""
    return _prefetch.pool_tokens_before if _prefetch is not None else None


def remember_pool_tokens(tokens: int) -> int:
    """Note this start's KV pool size (tokens) for `end_prefetch`'s manifest (no-op without a `start_prefetch`);
    returns `tokens`."""
    if _prefetch is not None:
        _prefetch.pool_tokens = tokens
    return tokens
