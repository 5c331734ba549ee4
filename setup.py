"""Build of ulysses_kernels: the Python package and the ``ulysses_kernels._C`` extension.

What is built (``decide()``; a summary is printed):

* torch is a CUDA build and a CUDA toolkit is found (``CUDA_HOME``/``CUDA_PATH``, else
  ``/usr/local/cuda`` or the directory of ``nvcc`` on ``PATH``): the CUDA extension
  (pack/unpack ops with CUDA and CPU kernels, and the NCCL communicator when ``nccl.h`` is
  found). No GPU is needed to build it;
* torch is a CPU build, or ``ULYSSES_KERNELS_SKIP_CUDA_BUILD=1``: the CPU-only extension
  (the CPU twin of the pack/unpack ops);
* ``ULYSSES_KERNELS_SKIP_EXTENSION=1``: nothing; the package works through its Python paths.

Anything less than that is an error at build time, not a quieter install: torch not
importable (pip's build isolation: install with ``INSTALL_COMMANDS``; refused already by the
in-tree build backend, build_backend/ulysses_kernels_backend.py, when pip asks it for the build
requirements, before it fetches anything), setuptools
too old for pyproject.toml, or a CUDA torch with no CUDA toolkit. pip shows a build's output only when it fails, so a
warning would never reach the user (docs/build.md).

A wheel with the extension requires the exact torch it was built against (the binary
matches only that torch's ABI); NCCL is found at run time through torch (which loaded it
first) or ``$ORIGIN/../nvidia/nccl/lib`` (torch's own nvidia-nccl wheel), never through a
path of the build machine.

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
# The build backend pip calls (pyproject.toml) holds the messages a build that cannot see
# torch prints, so that it can print them before pip fetches anything.
sys.path.insert(0, os.path.join(ROOT, "build_backend"))
from ulysses_kernels_backend import INSTALL_COMMANDS, TORCH_MISSING  # noqa: E402

DEFAULT_ARCHS = "8.0;9.0"
# The dependency of a build without the extension; one with it pins the torch it was built against.
TORCH_REQUIREMENT = "torch>=2.8"  # the oldest torch the suite has run on (docs/build.md)
# torch.distributed's object collectives (the demo's and the self-test's all_gather_object)
# need numpy, which torch does not require.
OTHER_REQUIREMENTS = ["numpy"]
# pyproject.toml's SPDX license string (PEP 639): older setuptools stop at an opaque
# "invalid pyproject.toml config: project.license" before this file can say anything.
MIN_SETUPTOOLS = 77
# setup.py commands that compile or install (the others only write metadata or an sdist:
# pip runs those first, in the same environment, and they must not fail).
BUILD_COMMANDS = {"build", "build_ext", "bdist_wheel", "bdist_egg", "install", "develop", "editable_wheel"}
# The wheel's metadata (PEP 517 prepare_metadata_for_build_wheel/editable): pip asks for it
# before it resolves the dependencies, so refusing here refuses before torch is downloaded.
# (egg_info also serves sdists, which need no torch: it never refuses.)
WHEEL_METADATA_COMMANDS = {"dist_info"}
# Where torch's nvidia-nccl wheel puts libnccl.so.2, seen from site-packages/ulysses_kernels/_C*.so
# (what torch itself does for its nvidia libraries).
NCCL_WHEEL_RUNPATH = "$ORIGIN/../nvidia/nccl/lib"


class BuildError(Exception):
    """The build would give less than asked for; the message says what is missing and how to get it."""


def _truthy(name: str, env=None) -> bool:
    return (os.environ if env is None else env).get(name, "0").strip().lower() in ("1", "true", "yes", "on")


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
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")) and os.path.isfile(os.path.join(home, "include", "cuda_runtime.h")):
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


def nccl_runpath(libdir: str):
    """The RUNPATH entry for NCCL in ``libdir``: relative for torch's nvidia-nccl wheel, None for the system's.

    The loader matches ``libnccl.so.2`` to the copy torch already loaded (``ops.load``
    imports torch first), so the entry is only a fallback; it must not name the build
    machine: ``$ORIGIN/../nvidia/nccl/lib`` is that wheel's place next to an installed
    package. An in-place build (``$ORIGIN/..`` is the checkout) relies on torch's copy.
    An NCCL_HOME outside the system's library path keeps its absolute path (the user
    named it, and must have it where the package runs).
    """
    parts = os.path.normpath(libdir).split(os.sep)
    if parts[-3:] == ["nvidia", "nccl", "lib"]:
        return NCCL_WHEEL_RUNPATH
    if os.path.normpath(libdir) in ("/usr/lib", "/usr/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/local/lib", "/usr/local/lib64"):
        return None
    return libdir


def _nccl_header_version(inc: str) -> str:
    with open(os.path.join(inc, "nccl.h")) as f:
        for line in f:
            if line.startswith("#define NCCL_VERSION_CODE"):
                return line.split()[2]
    return "?"


def decide(env, torch_version, torch_cuda, cuda_home) -> str:
    """What to build: ``"cuda"``, ``"cpu"`` or ``"none"``; BuildError when it would be less than asked.

    ``torch_version``: ``torch.__version__``, or None when torch is not importable here;
    ``torch_cuda``: ``torch.version.cuda``; ``cuda_home``: the toolkit found, or None.
    The default asks for everything this torch can use; the switches ask for less.
    """
    if _truthy("ULYSSES_KERNELS_SKIP_EXTENSION", env):
        return "none"
    if torch_version is None:
        raise BuildError(TORCH_MISSING)
    if _truthy("ULYSSES_KERNELS_SKIP_CUDA_BUILD", env) or torch_cuda is None:
        return "cpu"
    if cuda_home is None:
        raise BuildError(
            f"torch {torch_version} is a CUDA {torch_cuda} build but no CUDA toolkit was found (CUDA_HOME, CUDA_PATH, "
            "/usr/local/cuda, nvcc on PATH), so the CUDA kernels and the NCCL communicator cannot be built. "
            "Point to one, e.g.\n"
            "    CUDA_HOME=/usr/local/cuda pip install --no-build-isolation .\n"
            "or ask for the CPU-only extension with ULYSSES_KERNELS_SKIP_CUDA_BUILD=1."
        )
    return "cuda"


def _building(argv) -> bool:
    """A command that builds, or the wheel metadata pip asks for before resolving dependencies."""
    return any(a in BUILD_COMMANDS or a in WHEEL_METADATA_COMMANDS for a in argv[1:])


def check_setuptools(version: str) -> None:
    """BuildError when ``version`` (setuptools') cannot read pyproject.toml."""
    try:
        major = int(version.split(".")[0])
    except ValueError:
        return
    if major < MIN_SETUPTOOLS:
        raise BuildError(
            f"setuptools {version} is too old to build ulysses_kernels (pyproject.toml's project.license needs >= {MIN_SETUPTOOLS}; "
            "a new venv of Python <= 3.11 comes with 65.5). Upgrade it, then build again:\n"
            f"    {INSTALL_COMMANDS}"
        )


def _torch_distribution_version():
    """The installed torch distribution's version (``2.14.1``; ``torch.__version__`` may add ``+cu130``)."""
    import importlib.metadata

    return importlib.metadata.version("torch")


def extensions():
    """``(ext_modules, cmdclass, install_requires)`` for setup(); BuildError (from ``decide``) when building less than asked."""
    skip_cuda = _truthy("ULYSSES_KERNELS_SKIP_CUDA_BUILD")
    cuda_home = None if skip_cuda else find_cuda_home()
    if cuda_home:
        # torch reads CUDA_HOME when cpp_extension is imported, and guesses wrong without it.
        os.environ["CUDA_HOME"] = cuda_home
    archs = os.environ.get("ULYSSES_KERNELS_CUDA_ARCHS", DEFAULT_ARCHS).strip() or DEFAULT_ARCHS
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs  # with no GPU visible, torch cannot detect one
    torch = None
    if not _truthy("ULYSSES_KERNELS_SKIP_EXTENSION"):
        try:
            import torch
            from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
        except ImportError as e:
            _log(f"torch is not importable here ({e})")
            torch = None
    try:
        what = decide(os.environ, torch and torch.__version__, torch and torch.version.cuda, cuda_home)
    except BuildError:
        if _building(sys.argv):
            raise
        # Metadata of an sdist (egg_info): no torch needed.
        return [], {}, [TORCH_REQUIREMENT, *OTHER_REQUIREMENTS]
    if what == "none":
        _log("ULYSSES_KERNELS_SKIP_EXTENSION=1: pure-Python install, no _C extension")
        return [], {}, [TORCH_REQUIREMENT, *OTHER_REQUIREMENTS]
    if what == "cpu":
        if cuda_home and torch.version.cuda is None:
            _log(f"torch {torch.__version__} is a CPU build: building the CPU-only extension")
        cuda_home = None
    csrc = os.path.join("csrc")
    sources = [os.path.join(csrc, "ops.cpp"), os.path.join(csrc, "module.cpp"), os.path.join(csrc, "kernels", "pack_cpu.cpp")]
    sources += [os.path.join(csrc, "fp8_ops.cpp"), os.path.join(csrc, "kernels", "fp8_cpu.cpp")]  # the FP8 wire
    macros, include_dirs, link_args = [], [os.path.join(ROOT, "csrc")], []
    # NOTE: -g0 against Python's default -g (sysconfig's CFLAGS): with debug info the torch headers
    # made each host object ~6 MB and _C 10.4 MB (arch 9.0; 2.4 MB without); a build took 57 CPU-s, 47 without.
    # ULYSSES_KERNELS_DEBUG_INFO=1 keeps -g.
    cxx = ["-O3"] + ([] if os.environ.get("ULYSSES_KERNELS_DEBUG_INFO") == "1" else ["-g0"])
    nccl = None
    if cuda_home:
        sources += [os.path.join(csrc, "kernels", "pack.cu"), os.path.join(csrc, "kernels", "fp8.cu")]
        macros += [("ULYSSES_KERNELS_WITH_CUDA", None), ("ULYSSES_KERNELS_ARCHS", archs.replace(";", "_").replace(" ", "_"))]
        include_dirs += _nvidia_dirs()
        nccl = find_nccl()
        if nccl:
            inc, libdir, name = nccl
            sources.append(os.path.join(csrc, "nccl_ops.cpp"))
            macros.append(("ULYSSES_KERNELS_WITH_NCCL", None))
            include_dirs.insert(1, inc)
            link_args += [f"-L{libdir}", f"-l:{name}"]
            runpath = nccl_runpath(libdir)
            if runpath:
                link_args.append(f"-Wl,-rpath,{runpath}")
        ext = CUDAExtension(
            "ulysses_kernels._C",
            sources,
            include_dirs=include_dirs,
            define_macros=macros,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--expt-relaxed-constexpr"]},
            extra_link_args=link_args,
        )
    else:
        ext = CppExtension("ulysses_kernels._C", sources, include_dirs=include_dirs, define_macros=macros, extra_compile_args={"cxx": cxx})
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
    pin = f"torch=={_torch_distribution_version()}"
    _log(f"requires {pin} (the extension matches only the torch it was built against)")
    return [ext], {"build_ext": _timed(BuildExtension)}, [pin, *OTHER_REQUIREMENTS]


def _toolchain():
    """ulysses_kernels/toolchain.py, loaded by its path (the package imports torch and _C; this module only the stdlib)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_ulysses_kernels_toolchain", os.path.join(ROOT, "ulysses_kernels", "toolchain.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_libstdcxx(path: str) -> None:
    """Say loudly when the compiler linked a private libstdc++ into the extension at ``path``.

    The first GPU run's g++ did (bench/results/2026-11-27_h200/README.md): error messages
    formatted through that copy's iostream crashed the process. csrc/message.h builds them
    without a stream now, but a private C++ runtime beside torch's stays a hazard (two
    allocators, two sets of exception and locale state), so the build names it and the fix.
    """
    toolchain = _toolchain()
    report = toolchain.libstdcxx_report(path)
    if report["private"]:
        bar = "!" * 78
        for line in (
            bar,
            f"WARNING: {os.path.basename(path)} carries {report['detail']}.",
            f"Your C++ compiler ({os.environ.get('CXX', 'g++')}) links libstdc++ statically into shared libraries.",
            "Torch's libraries use the shared one; a second copy inside _C has crashed error paths before.",
            f"Fix: {toolchain.fix_command()}",
            bar,
        ):
            _log(line)
    else:
        _log(f"C++ runtime of {os.path.basename(path)}: {report['detail']}")


def _timed(base):
    class TimedBuildExt(base):
        def run(self):
            start = time.time()
            super().run()
            _log(f"_C built in {time.time() - start:.1f} s")
            for ext in self.extensions:
                path = self.get_ext_fullpath(ext.name)
                if os.path.isfile(path):
                    check_libstdcxx(path)

    return TimedBuildExt


if __name__ == "__main__":
    try:
        import setuptools

        check_setuptools(setuptools.__version__)
        ext_modules, cmdclass, install_requires = extensions()
    except BuildError as e:
        sys.exit(f"\n[ulysses_kernels build] ERROR: {e}\n")
    setup(ext_modules=ext_modules, cmdclass=cmdclass, install_requires=install_requires)
