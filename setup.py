"""Builds the optional C++ part of sgl-jax (the rest of the packaging is in pyproject.toml).

One extension: the CPU attention kernels (decode, extend, the bfloat16 KV write) and the KV pool's unwritten
buffers that XLA calls through JAX's FFI (python/sgl_jax/srt/kernels/ragged_paged_attention/csrc/
paged_{decode,extend}_cpu.cc, fresh_buffer_cpu.cc, loaded by
`sgl_jax.srt.kernels.ragged_paged_attention.cpu`). It is a plain shared library (no Python C API; named
``_paged_decode_cpu.ffi.<EXT_SUFFIX>`` so that nothing mistakes it for a module), compiled
against the XLA FFI headers that jaxlib ships (a build requirement in pyproject.toml). It is optional: where it
fails to build (no C++ compiler), the install still succeeds and attention on CPU runs in pure JAX.
"""

import importlib.util
import os
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNEL_DIR = "python/sgl_jax/srt/kernels/ragged_paged_attention"


def xla_ffi_include_dir() -> str:
    """jaxlib's include directory (what `jax.ffi.include_dir()` returns), found without importing jaxlib."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("jaxlib is not installed in the build environment; it provides the XLA FFI headers")
    return os.path.join(list(spec.submodule_search_locations)[0], "include")


class BuildExt(build_ext):
    """build_ext with the XLA FFI include directory, and an atomic copy of the result into the source tree."""

    def build_extensions(self):
        for ext in self.extensions:
            ext.include_dirs.append(xla_ffi_include_dir())
        super().build_extensions()

    def get_ext_filename(self, fullname):
        """``_paged_decode_cpu.ffi.<EXT_SUFFIX>``: the dot in the stem keeps the library from looking like an
        importable module (pkgutil skips dotted names, so walking sgl_jax's modules does not try to import it)."""
        name = super().get_ext_filename(fullname)
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        return name[: -len(suffix)] + ".ffi" + suffix if name.endswith(suffix) else name

    def copy_file(self, infile, outfile, *args, **kwargs):
        """Put the built library in place by rename, never by writing over the old file: a process that has
        the old one loaded (a running server, the test session) keeps its copy intact."""
        tmp = f"{outfile}.tmp-{os.getpid()}"
        _, copied = super().copy_file(infile, tmp, *args, **kwargs)
        os.replace(tmp, outfile)
        return outfile, copied


setup(
    ext_modules=[
        Extension(
            "sgl_jax.srt.kernels.ragged_paged_attention._paged_decode_cpu",
            sources=[f"{KERNEL_DIR}/csrc/paged_decode_cpu.cc", f"{KERNEL_DIR}/csrc/paged_extend_cpu.cc",
                     f"{KERNEL_DIR}/csrc/fresh_buffer_cpu.cc"],
            depends=[f"{KERNEL_DIR}/csrc/{h}" for h in ("paged_decode_cpu_core.h", "paged_extend_cpu_core.h",
                                                         "cpu_kernel_common.h", "fast_exp.h", "isa_clones.h")],
            language="c++",
            extra_compile_args=["-std=c++17", "-O3", "-fopenmp-simd", "-w"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
