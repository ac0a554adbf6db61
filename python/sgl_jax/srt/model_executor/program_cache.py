"""Compiled programs kept on disk between starts, so that a restart skips tracing them.

JAX's persistent compilation cache saves XLA's compile, but its key is a hash of the lowered module, so every start
still traces and lowers each program in Python first (SmolLM2's 13 warm-up programs: 4-6 s of a 15-18 s restart on
2 cores). This module keeps each runner program's compiled executable (``jax.experimental.serialize_executable``)
under a key computed without tracing: a hash of everything the program is made from (`fingerprint`: this package's
sources and built kernels, jax and jaxlib, the XLA and JAX environment, the devices and the host CPU's features, the
runner's step spec, model config and server flags) plus the program's name, its static argument and the shapes,
dtypes and shardings of its arguments (`ProgramCache.key`). A restart with the same key deserializes the executable
(~0.1-0.5 s on 2 cores, on the compile threads) and never traces it. Only executables XLA compiled in this process
are stored: one that JAX read back from its persistent cache serializes without the functions XLA's CPU loader
linked into it, and fails at its first run once loaded again (jax 0.10.2).

`CachedProgram` wraps one jitted function: calls whose static argument (or key) has a loaded executable run it (the
same C++ dispatch as jit's); any other call, or one whose arguments' types the executable refuses, goes to the
jitted function as before, so a signature never seen at warm-up compiles as it always did, and counts as a compile
after warm-up (compile_stats).

Off with ``SGL_JAX_EXECUTABLE_CACHE=0``, and with several JAX processes (--nnodes > 1), whose executables span
hosts. A file that fails to load is logged and treated as absent; the program is then traced and compiled.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import jax

logger = logging.getLogger(__name__)

SWITCH_ENV = "SGL_JAX_EXECUTABLE_CACHE"  # "0": trace and compile (or load from JAX's cache) every start
FORMAT = 2  # the files' layout (in their names: a change makes every older file a miss); 2: zlib-compressed
DIR_NAME = "sgl_jax_executables"  # under --compilation-cache-dir
# ServerArgs fields that cannot shape a program (where it listens, what it logs, the seed of request seeds): left
# out of the fingerprint so that restarts on another port or seed find their programs. Every other field is in it.
NOT_PROGRAM_FLAGS = frozenset({"host", "port", "random_seed", "log_level", "log_requests", "api_key",
                               "admin_api_key", "served_model_name", "watchdog_timeout"})
# environment variables that move only the KV pool's size (the pool's shape is in every key through the arguments)
NOT_PROGRAM_ENV = frozenset({"SGL_JAX_TEST_AVAILABLE_MEMORY_BYTES"})


def enabled() -> bool:
    """Whether the executable cache is on: ``SGL_JAX_EXECUTABLE_CACHE`` is not "0" and this is JAX's only
    process."""
    return os.environ.get(SWITCH_ENV, "1") != "0" and jax.process_count() == 1


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """sha256 (hex) of this package's source and built files (``*.py`` and the C++ kernels' shared libraries,
    relative paths and bytes), jax's and jaxlib's versions: a program's code. Computed once per process (~20 ms)."""
    import jaxlib

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the sgl_jax package
    h = hashlib.sha256(f"jax {jax.__version__} jaxlib {jaxlib.__version__}".encode())
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith((".py", ".so")):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def _host_cpu_flags() -> str:
    """The host CPU's feature flags (/proc/cpuinfo's first ``flags`` line; "" elsewhere): XLA's CPU code is compiled
    for the features of the machine it runs on."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def fingerprint(server_args, model_config, step_spec, devices: Iterable) -> str:
    """sha256 (hex) of what a runner's programs are made from besides their arguments: `code_fingerprint`, the
    environment variables that JAX, XLA and this package read (``JAX_*``, ``XLA_*``, ``SGL_JAX_*``, but
    NOT_PROGRAM_ENV), `devices` (platform, kind, id, process), the host CPU's flags, `step_spec` (the static part
    of every step program, the model's graph included), `model_config` and every ServerArgs field but
    NOT_PROGRAM_FLAGS. Each part is its repr; a part whose repr changed makes a miss, never a wrong program."""
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith(("JAX_", "XLA_", "SGL_JAX_")) and k not in NOT_PROGRAM_ENV)
    flags = sorted((k, repr(v)) for k, v in vars(server_args).items() if k not in NOT_PROGRAM_FLAGS)
    devs = [(d.platform, d.device_kind, d.id, d.process_index) for d in devices]
    h = hashlib.sha256()
    for part in (code_fingerprint(), repr(env), repr(devs), _host_cpu_flags(), repr(step_spec), repr(model_config),
                 repr(flags)):
        h.update(hashlib.sha256(part.encode()).digest())
    return h.hexdigest()


def _arg_signature(args: tuple) -> str:
    """The shapes, dtypes and shardings of `args`' leaves and their tree structure, as text."""
    leaves, tree = jax.tree.flatten(args)
    parts = [str(tree)]
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        parts.append(f"{getattr(leaf, 'shape', ())}|{getattr(leaf, 'dtype', type(leaf).__name__)}|{sharding}|"
                     f"{getattr(leaf, 'weak_type', False)}")
    return "\n".join(parts)


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

    def key(self, name: str, call: ProgramCall) -> str:
        """sha256 (hex) of the fingerprint, `name`, the static argument's repr and the arguments' signature."""
        h = hashlib.sha256(self.fingerprint.encode())
        for part in (name, repr(call.lookup_key), _arg_signature(call.args)):
            h.update(hashlib.sha256(part.encode()).digest())
        return h.hexdigest()

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, f"{key}.v{FORMAT}.exe")

    def has(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def load(self, key: str) -> Optional[Any]:
        """The executable stored under `key` as a ``jax.stages.Compiled`` on this cache's devices, or None (logged)
        when the file is unreadable, of another format, or names a device that is not one of them."""
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            with open(self._path(key), "rb") as f:
                entry = pickle.loads(zlib.decompress(f.read()))
            if entry.get("format") != FORMAT:
                return None
            exe_devices = [self.devices[i] for i in entry["devices"]]
            return deserialize_and_load(entry["executable"], entry["in_tree"], entry["out_tree"],
                                        backend=exe_devices[0].client, execution_devices=exe_devices)
        except Exception as e:  # (a damaged or foreign file is a miss: the program is traced and compiled instead)
            logger.warning("Executable cache: could not load %s (%s: %s); compiling instead", self._path(key),
                           type(e).__name__, e)
            return None

    def store(self, key: str, compiled) -> bool:
        """Write `compiled` under `key` (atomically: a temporary file renamed). Returns False (logged at debug) for an
        executable JAX cannot serialize (one with closed-over constants) or a directory that cannot be written."""
        from jax.experimental.serialize_executable import serialize

        try:
            blob, in_tree, out_tree = serialize(compiled)
            devices = [d.id for d in compiled.runtime_executable().local_devices()]
            # (zlib level 1: a 12.8 MB executable pickles to 2.2 MB in ~0.2 s and inflates in ~0.1 s)
            data = zlib.compress(pickle.dumps({"format": FORMAT, "executable": blob, "in_tree": in_tree,
                                               "out_tree": out_tree, "devices": devices}), 1)
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))
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

