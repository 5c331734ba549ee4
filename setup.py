"""Build of ulysses_kernels: the Python package and the ``ulysses_kernels._C`` extension.

What is built (a summary is printed):

* a CUDA toolkit is found (``CUDA_HOME``/``CUDA_PATH``, else ``/usr/local/cuda`` or the
  directory of ``nvcc`` on ``PATH``) and torch is a CUDA build: the CUDA extension (pack/unpack
  ops with CUDA and CPU kernels, and the NCCL communicator when ``nccl.h`` is found). No GPU
  is needed to build it;
* otherwise, or with ``ULYSSES_KERNELS_SKIP_CUDA_BUILD=1``: the CPU-only extension (the CPU
  twin of the pack/unpack ops);
* torch not importable at build time (e.g. pip's build isolation) or
  ``ULYSSES_KERNELS_SKIP_EXTENSION=1``: nothing; the package works through its Python paths.

Switches: ``ULYSSES_KERNELS_CUDA_ARCHS`` (default ``"8.0;9.0"``; sets ``TORCH_CUDA_ARCH_LIST``),
``MAX_JOBS`` (parallel compile jobs), ``NCCL_HOME`` (an NCCL install with include/ and lib/;
default: the nvidia-nccl wheel torch uses). See docs/build.md.
"""

import glob
import os
import shutil
import sys
import time

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "8.0;9.0"


def _truthy(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _log(msg: str) -> None:
    print(f"[ulysses_kernels build] {msg}", file=sys.stderr, flush=True)


def find_cuda_home():
    """A CUDA toolkit directory with bin/nvcc, found without looking for a GPU."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for home in candidates:
        # /usr/local/bin/nvcc may be a wrapper script: require the toolkit headers too.
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")) and os.path.isfile(
            os.path.join(home, "include", "cuda_runtime.h")
        ):
            return home
    return None


def _nvidia_dirs():
    """Include directories of torch's nvidia-* wheels (cusparse.h etc. that ATen's CUDA headers use)."""
    try:
        import nvidia  # namespace package of the nvidia-* wheels
    except ImportError:
        return []
    dirs = []
    for base in list(nvidia.__path__):
        dirs += [d for d in sorted(glob.glob(os.path.join(base, "*", "include"))) if os.path.isdir(d)]
    return dirs


def find_nccl():
    """(include_dir, lib_dir, library file name) of the NCCL that torch loads, or None."""
    homes = [os.environ.get("NCCL_HOME")]
    try:
        import nvidia.nccl

        homes += list(nvidia.nccl.__path__)
    except ImportError:
        pass
    homes += ["/usr", "/usr/local"]
    for home in homes:
        if not home:
            continue
        inc = os.path.join(home, "include")
        for libdir in (os.path.join(home, "lib"), os.path.join(home, "lib64"), os.path.join(home, "lib", "x86_64-linux-gnu")):
            for name in ("libnccl.so.2", "libnccl.so"):
                if os.path.isfile(os.path.join(inc, "nccl.h")) and os.path.isfile(os.path.join(libdir, name)):
                    return inc, libdir, name
    return None


def _nccl_header_version(inc: str) -> str:
    with open(os.path.join(inc, "nccl.h")) as f:
        for line in f:
            if line.startswith("#define NCCL_VERSION_CODE"):
                return line.split()[2]
    return "?"


def extensions():
    if _truthy("ULYSSES_KERNELS_SKIP_EXTENSION"):
        _log("ULYSSES_KERNELS_SKIP_EXTENSION=1: pure-Python install, no _C extension")
        return [], {}
    skip_cuda = _truthy("ULYSSES_KERNELS_SKIP_CUDA_BUILD")
    cuda_home = None if skip_cuda else find_cuda_home()
    if cuda_home:
        # torch reads CUDA_HOME when cpp_extension is imported, and guesses wrong without it.
        os.environ["CUDA_HOME"] = cuda_home
    archs = os.environ.get("ULYSSES_KERNELS_CUDA_ARCHS", DEFAULT_ARCHS).strip() or DEFAULT_ARCHS
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs  # with no GPU visible, torch cannot detect one
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    except ImportError as e:
        _log(f"torch is not importable at build time ({e}): pure-Python install, no _C extension "
             "(install with `pip install --no-build-isolation -e .` to build it)")
        return [], {}
    if cuda_home and torch.version.cuda is None:
        _log(f"torch {torch.__version__} is a CPU build: building the CPU-only extension")
        cuda_home = None
    csrc = os.path.join("csrc")
    sources = [os.path.join(csrc, "ops.cpp"), os.path.join(csrc, "module.cpp"), os.path.join(csrc, "kernels", "pack_cpu.cpp")]
    macros, include_dirs, link_args = [], [os.path.join(ROOT, "csrc")], []
    cxx = ["-O3"]
    nccl = None
    if cuda_home:
        sources.append(os.path.join(csrc, "kernels", "pack.cu"))
        macros += [("ULYSSES_KERNELS_WITH_CUDA", None), ("ULYSSES_KERNELS_ARCHS", archs.replace(";", "_").replace(" ", "_"))]
        include_dirs += _nvidia_dirs()
        nccl = find_nccl()
        if nccl:
            inc, libdir, name = nccl
            sources.append(os.path.join(csrc, "nccl_ops.cpp"))
            macros.append(("ULYSSES_KERNELS_WITH_NCCL", None))
            include_dirs.insert(1, inc)
            link_args += [f"-L{libdir}", f"-l:{name}", f"-Wl,-rpath,{libdir}"]
        ext = CUDAExtension(
            "ulysses_kernels._C",
            sources,
            include_dirs=include_dirs,
            define_macros=macros,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--expt-relaxed-constexpr"]},
            extra_link_args=link_args,
        )
    else:
        ext = CppExtension("ulysses_kernels._C", sources, include_dirs=include_dirs, define_macros=macros,
                           extra_compile_args={"cxx": cxx})
    _log("---- build summary ----")
    _log(f"torch {torch.__version__} (CUDA {torch.version.cuda}), python {sys.version.split()[0]}")
    if skip_cuda:
        _log("ULYSSES_KERNELS_SKIP_CUDA_BUILD=1: CPU-only extension")
    _log(f"CUDA toolkit: {cuda_home or 'none (CPU-only extension)'}")
    if cuda_home:
        _log(f"TORCH_CUDA_ARCH_LIST={archs}")
        if nccl:
            _log(f"NCCL: {nccl[0]} (NCCL_VERSION_CODE {_nccl_header_version(nccl[0])}), linking {nccl[1]}/{nccl[2]}")
        else:
            _log("NCCL: nccl.h not found (set NCCL_HOME): no NCCL communicator")
    _log(f"sources: {', '.join(sources)}")
    _log(f"MAX_JOBS={os.environ.get('MAX_JOBS', '(torch default)')}")
    return [ext], {"build_ext": _timed(BuildExtension)}


def _timed(base):
    class TimedBuildExt(base):
        def run(self):
            start = time.time()
            super().run()
            _log(f"_C built in {time.time() - start:.1f} s")

    return TimedBuildExt


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
