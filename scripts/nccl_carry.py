#!/usr/bin/env python3
"""An NCCL >= 2.30 small enough to travel with a device call (issue 49), and its unpacking there.

The lent GPU machine has torch's NCCL 2.28.9, which refuses two ranks on one GPU; NCCL 2.30
accepts them with ``NCCL_MULTI_RANK_GPU_ENABLE=1``. The registry wheel nvidia-nccl-cu13 2.30.x
(the one this venv's torch uses) holds a 252 MB libnccl.so.2: device code for sm_75 to sm_120
plus PTX, twice (``.nv_fatbin``, the linked kernels, and ``__nv_relfatbin``, each translation
unit's; the runtime registers both: every fatbin wrapper in ``.nvFatBinSegment`` points at one
of them), and 45 MB of DWARF. A device call carries 64 MiB in all, so:

    python3 scripts/nccl_carry.py                 # here: build/nccl_carry/ (~25 MiB), then checks it
    python3 scripts/nccl_carry.py --check         # here: the checks alone, on the artifact already built
    python3 scripts/nccl_carry.py --unpack DIR    # on the GPU machine: DIR/nvidia/nccl/{lib/libnccl.so.2,include/nccl.h}
    LD_PRELOAD=DIR/nvidia/nccl/lib/libnccl.so.2 PYTHONPATH=DIR python3 scripts/nccl_carry.py --probe DIR
                                                  # there: torch runs it (one copy mapped), 2 ranks all-reduce on GPU 0

Building (stdlib only, plus binutils' objcopy):
1. ``objcopy --strip-debug``: the DWARF sections go (not loaded: no allocated section moves).
2. Every fatbin in ``.nv_fatbin`` and ``__nv_relfatbin`` is rewritten in place as the one a
   ``-gencode arch=compute_90,code=sm_90`` build would have made: its header, then only its
   entries for the kept arch (``--arch``, default 90), its ``fat_size`` the sum of theirs, the rest
   of its old extent zeros. No fatbin moves (each wrapper's pointer still finds its header), no
   section or offset changes, and the kept entries are the original bytes. A fatbin without an
   entry for the arch is left as it was.
3. ``xz`` of the result (the zeros cost nothing) -> ``libnccl.so.2.xz``, beside ``nccl.h`` and
   ``manifest.json`` (version, the unpacked file's sha256 and size, the kept arch).

Checks (``--check``; also after building), each printed, exit status 1 when one fails:
the size of the folder; the unpacked file's sha256 against the manifest; ``ncclGetVersion``
through ctypes in a fresh process (works without a GPU) equal to the original's; the defined
dynamic symbols equal to the original's; the structure (every fatbin wrapper's target is a
fatbin header, only the kept arch in each rewritten fatbin); and with cuobjdump (triton's copy
when /usr/local/cuda has none) the listed sm_90 cubins equal the original's, byte for byte
after extraction. The unpacked check copy goes to build/nccl_check/ (not carried).

Unpacked, DIR/nvidia/nccl is the wheel's layout on purpose: with DIR first on PYTHONPATH, torch's
import (which loads ``nvidia/nccl/lib/libnccl.so.*`` by path from the first sys.path entry that
has one) loads this file, the same one LD_PRELOAD names, so the process maps one NCCL, not two;
DIR/nvidia/nccl is also the NCCL_HOME that setup.py builds ``_C`` against (its nccl.h).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import lzma
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FATBIN_MAGIC = 0xBA55ED50
FATBIN_WRAPPER_MAGIC = 0x466243B1
FATBIN_SECTIONS = (".nv_fatbin", "__nv_relfatbin")
LIB = "libnccl.so.2"
R_X86_64_RELATIVE = 8


# ---- ELF (64-bit little-endian: what the wheel is) ---------------------------------------
def sections(data: bytes | bytearray) -> dict[str, tuple[int, int, int]]:
    """``{name: (file offset, size, virtual address)}`` of an ELF64 file's sections."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("nccl_carry: expected a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_off = headers[shstrndx][4]
    out = {}
    for name_idx, _type, _flags, addr, off, size, *_ in headers:
        end = data.index(b"\0", names_off + name_idx)
        out[data[names_off + name_idx : end].decode()] = (off, size, addr)
    return out


def fatbins(data, off: int, size: int):
    """The fatbins laid end to end in a section: ``[(start, header size, [(entry start, entry end, kind, arch)])]``
    (file offsets), zeros between them skipped."""
    out, p, end = [], off, off + size
    while p + 16 <= end:
        magic, _version, hsize, fat_size = struct.unpack_from("<IHHQ", data, p)
        if magic != FATBIN_MAGIC:  # zeros: padding, or what a rewritten fatbin left of its old extent
            q = data.find(struct.pack("<I", FATBIN_MAGIC), p, end)
            q = end if q < 0 else q
            if bytes(data[p:q]).count(0) != q - p:
                raise ValueError(f"nccl_carry: no fatbin header at file offset {p:#x} and what follows is not zeros")
            if q == end:
                break
            p = q
            continue
        entries, e, fend = [], p + hsize, p + hsize + fat_size
        while e < fend:
            kind, _ev, ehsize, padded = struct.unpack_from("<HHIQ", data, e)
            (arch,) = struct.unpack_from("<I", data, e + 28)
            entries.append((e, e + ehsize + padded, kind, arch))
            e += ehsize + padded
        if e != fend:
            raise ValueError(f"nccl_carry: the fatbin at {p:#x} has entries running past its size")
        out.append((p, hsize, entries))
        p = fend
    return out


def wrapper_targets(data, secs) -> list[int]:
    """Virtual addresses the fatbin wrappers (``.nvFatBinSegment``: magic, version, data pointer,
    ...) point at: the relocations that write a pointer into that segment."""
    seg_off, seg_size, seg_addr = secs[".nvFatBinSegment"]
    rela_off, rela_size, _ = secs[".rela.dyn"]
    targets = []
    for i in range(0, rela_size, 24):
        where, info, addend = struct.unpack_from("<QQq", data, rela_off + i)
        if seg_addr <= where < seg_addr + seg_size and (info & 0xFFFFFFFF) == R_X86_64_RELATIVE:
            (magic,) = struct.unpack_from("<I", data, seg_off + (where - seg_addr) - 8)
            if magic == FATBIN_WRAPPER_MAGIC:
                targets.append(addend)
    return targets


def keep_arch(data: bytearray, arch: int) -> dict:
    """Rewrite every fatbin of ``data`` in place to its ``arch`` entries alone (module docstring, step 2)."""
    secs = sections(data)
    stats = {"fatbins": 0, "rewritten": 0, "left_without_arch": 0, "entries_left": 0, "entries_kept": 0, "entries_dropped": 0, "bytes_zeroed": 0}
    for name in FATBIN_SECTIONS:
        off, size, _ = secs[name]
        for start, hsize, entries in fatbins(data, off, size):
            stats["fatbins"] += 1
            kept = [(a, b) for a, b, _kind, e_arch in entries if e_arch == arch]
            if not kept:  # (on an sm_90 GPU its kernels never load: NCCL's Blackwell-only ones)
                stats["left_without_arch"] += 1
                stats["entries_left"] += len(entries)
                continue
            end = entries[-1][1]
            body = b"".join(bytes(data[a:b]) for a, b in kept)
            struct.pack_into("<Q", data, start + 8, len(body))
            data[start + hsize : start + hsize + len(body)] = body
            data[start + hsize + len(body) : end] = bytes(end - start - hsize - len(body))
            stats["rewritten"] += 1
            stats["entries_kept"] += len(kept)
            stats["entries_dropped"] += len(entries) - len(kept)
            stats["bytes_zeroed"] += end - start - hsize - len(body)
    return stats


def arch_entries(data, arch: int) -> list[bytes]:
    """Every ``arch`` entry (header and payload) of both fatbin sections, in order."""
    secs = sections(data)
    return [bytes(data[a:b]) for name in FATBIN_SECTIONS for _s, _h, entries in fatbins(data, *secs[name][:2])
            for a, b, _kind, e_arch in entries if e_arch == arch]  # fmt: skip


def structure_problems(data, arch: int) -> list[str]:
    """What is wrong with a rewritten file's fatbins (empty list: nothing)."""
    secs, problems, starts = sections(data), [], set()
    for name in FATBIN_SECTIONS:
        off, size, addr = secs[name]
        for start, _h, entries in fatbins(data, off, size):
            starts.add(addr + start - off)
            archs = {e[3] for e in entries}
            if arch in archs and archs != {arch}:
                problems.append(f"{name}: the fatbin at {start:#x} still has archs {sorted(archs)}")
    targets = wrapper_targets(data, secs)
    if not targets:
        problems.append("no fatbin wrapper found in .nvFatBinSegment")
    lost = [t for t in targets if t not in starts]
    if lost:
        problems.append(f"{len(lost)} of {len(targets)} fatbin wrappers point at no fatbin header (first {lost[0]:#x})")
    return problems


# ---- what the library says about itself --------------------------------------------------
def nccl_version(lib: Path) -> int:
    """``ncclGetVersion`` of ``lib``, loaded by ctypes in a fresh process (no other NCCL in it)."""
    code = "import ctypes, sys; v = ctypes.c_int(); lib = ctypes.CDLL(sys.argv[1]); " \
           "rc = lib.ncclGetVersion(ctypes.byref(v)); print(v.value if rc == 0 else -rc)"  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, str(lib)], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"loading {lib} failed: {out.stderr.strip()[-400:]}")
    return int(out.stdout)


def version_text(code: int) -> str:
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


def defined_symbols(lib: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    return {" ".join(line.split()[1:]) for line in out.stdout.splitlines() if line.strip()}


def find_cuobjdump() -> str | None:
    candidates = [shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump"]
    try:
        import triton

        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    except ImportError:
        pass
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def cubins(cuobjdump: str, lib: Path, arch: int) -> list[str]:
    """The sorted sha256s of the sm_<arch> cubins cuobjdump extracts from ``lib`` (its file names
    number every entry, so they shift when others go: the contents are compared)."""
    with tempfile.TemporaryDirectory(prefix="nccl_carry_") as tmp:
        subprocess.run([cuobjdump, "-xelf", "all", str(lib)], cwd=tmp, capture_output=True, check=True, timeout=600)
        return sorted(hashlib.sha256(Path(tmp, f).read_bytes()).hexdigest() for f in os.listdir(tmp) if f".sm_{arch}." in f)


def listed_archs(cuobjdump: str, lib: Path) -> dict[str, int]:
    out = subprocess.run([cuobjdump, "-lelf", "-lptx", str(lib)], capture_output=True, text=True, check=True, timeout=600)
    counts: dict[str, int] = {}
    for line in out.stdout.splitlines():
        arch = line.rsplit(".", 2)[-2] if line.count(".") >= 2 else "?"
        kind = "PTX" if line.startswith("PTX") else "ELF"
        counts[f"{kind} {arch}"] = counts.get(f"{kind} {arch}", 0) + 1
    return counts


# ---- build, check, unpack -----------------------------------------------------------------
def wheel_library() -> Path:
    try:
        import nvidia.nccl
    except ImportError as e:
        raise SystemExit(f"nccl_carry: no nvidia-nccl wheel in {sys.executable}'s environment ({e}); pass --src PATH/{LIB}") from e
    for base in nvidia.nccl.__path__:
        if Path(base, "lib", LIB).is_file():
            return Path(base, "lib", LIB)
    raise SystemExit(f"nccl_carry: the nvidia-nccl wheel has no lib/{LIB}; pass --src")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build(src: Path, out: Path, arch: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    work = ROOT / "build" / "nccl_check"
    work.mkdir(parents=True, exist_ok=True)
    reduced = work / LIB
    subprocess.run(["objcopy", "--strip-debug", str(src), str(reduced)], check=True)
    data = bytearray(reduced.read_bytes())
    stats = keep_arch(data, arch)
    reduced.write_bytes(data)
    print(f"[nccl_carry] {src} ({src.stat().st_size / 2**20:.1f} MiB) -> stripped, sm_{arch} only: {stats}")
    with open(reduced, "rb") as f, lzma.open(out / f"{LIB}.xz", "wb", preset=6) as z:
        shutil.copyfileobj(f, z, 1 << 20)
    shutil.copy(src.parent.parent / "include" / "nccl.h", out / "nccl.h")
    version = nccl_version(src)
    manifest = {
        "nccl": version_text(version),
        "nccl_version_code": version,
        "source": str(src),
        "source_sha256": sha256(src),
        "arch": f"sm_{arch}",
        "library": LIB,
        "unpacked_sha256": sha256(reduced),
        "unpacked_bytes": reduced.stat().st_size,
        "rewrite": stats,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def unpack(carry: Path, dest: Path) -> Path:
    """``carry``'s library into ``dest/nvidia/nccl/lib`` and ``nccl.h`` into ``dest/nvidia/nccl/include``
    (an NCCL_HOME in the wheel's layout), checked against the manifest's sha256; returns the library's path."""
    manifest = json.loads((carry / "manifest.json").read_text())
    home = dest / "nvidia" / "nccl"
    (home / "lib").mkdir(parents=True, exist_ok=True)
    (home / "include").mkdir(parents=True, exist_ok=True)
    lib = home / "lib" / manifest["library"]
    with lzma.open(carry / f"{manifest['library']}.xz", "rb") as z, open(lib, "wb") as f:
        shutil.copyfileobj(z, f, 1 << 20)
    if sha256(lib) != manifest["unpacked_sha256"]:
        raise SystemExit(f"nccl_carry: {lib} sha256 {sha256(lib)} expected {manifest['unpacked_sha256']} (a damaged carry)")
    shutil.copy(carry / "nccl.h", home / "include" / "nccl.h")
    return lib


def check(carry: Path, arch: int, max_mib: float) -> bool:
    ok = True

    def verdict(good: bool, what: str) -> None:
        nonlocal ok
        ok &= good
        print(f"[nccl_carry] {'OK  ' if good else 'FAIL'} {what}")

    manifest = json.loads((carry / "manifest.json").read_text())
    size = sum(f.stat().st_size for f in carry.iterdir())
    verdict(size <= max_mib * 2**20, f"size of {carry}: {size / 2**20:.1f} MiB ({size} bytes; limit {max_mib} MiB)")
    lib = unpack(carry, ROOT / "build" / "nccl_check")
    verdict(True, f"unpacked {lib} ({lib.stat().st_size / 2**20:.1f} MiB), sha256 as in the manifest")
    src = Path(manifest["source"])
    original = nccl_version(src) if src.is_file() else manifest["nccl_version_code"]
    got = nccl_version(lib)
    data = lib.read_bytes()
    verdict(got == original and got >= 23000,
            f"ncclGetVersion of the unpacked library: {version_text(got)} (the original's {version_text(original)}, need >= 2.30)")  # fmt: skip
    if src.is_file():
        mine, theirs = arch_entries(data, arch), arch_entries(src.read_bytes(), arch)
        verdict(mine == theirs, f"sm_{arch} entries of .nv_fatbin and __nv_relfatbin: {len(mine)} "
                                f"({sum(map(len, mine)) / 2**20:.1f} MiB), byte-equal to the original's {len(theirs)}: {mine == theirs}")  # fmt: skip
        a, b = defined_symbols(src), defined_symbols(lib)
        verdict(a == b, f"defined dynamic symbols: {len(b)}, the original's {len(a)}, differing {len(a ^ b)}")
    problems = structure_problems(data, arch)
    verdict(not problems, f"structure: every fatbin wrapper points at a fatbin header; rewritten fatbins hold sm_{arch} alone"
            + "".join(f"\n    {p}" for p in problems))  # fmt: skip
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        verdict(False, "cuobjdump: not found (/usr/local/cuda/bin, PATH, triton's backends/nvidia/bin)")
    elif src.is_file():
        listed, before = listed_archs(cuobjdump, lib), listed_archs(cuobjdump, src)
        key = f"ELF sm_{arch}"
        others = sum(n for k, n in listed.items() if k != key)
        good = listed.get(key) == before.get(key) and others <= manifest["rewrite"]["entries_left"]
        verdict(good, f"cuobjdump -lelf -lptx lists {listed} (the original {before}; other archs only in the "
                      f"{manifest['rewrite']['left_without_arch']} fatbins that had no sm_{arch} code, left as they were)")  # fmt: skip
        mine, theirs = cubins(cuobjdump, lib, arch), cubins(cuobjdump, src, arch)
        same = mine == theirs and len(mine) > 0
        verdict(same, f"cuobjdump -xelf: {len(mine)} sm_{arch} cubins extracted, byte-equal to the original's {len(theirs)}: {same}")
    return ok


def _probe_rank(rank: int, store: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2)
    t = torch.full((1 << 20,), float(rank + 1), device="cuda")
    dist.all_reduce(t)  # NCCL's sm_90 kernels from the rewritten fatbins, two ranks on one GPU
    torch.cuda.synchronize()
    if not bool((t == 3).all()):
        raise RuntimeError(f"rank {rank}: all_reduce of 1 and 2 gave {t.unique().tolist()}, expected [3.0]")
    dist.destroy_process_group()


def nccl_version_in_process(path: str) -> int:
    """ncclGetVersion of a libnccl already mapped into this process (dlopen of the same path returns its handle)."""
    code = ctypes.c_int()
    if ctypes.CDLL(path).ncclGetVersion(ctypes.byref(code)) != 0:
        raise RuntimeError(f"ncclGetVersion failed in {path}")
    return code.value


def probe(dest: Path) -> bool:
    """In a process started with this NCCL ahead of torch's (LD_PRELOAD, ``dest`` first on
    PYTHONPATH): torch runs it, one copy is mapped, and with a GPU two ranks on GPU 0 all-reduce
    (NCCL_MULTI_RANK_GPU_ENABLE=1) through its kernels."""
    import torch
    import torch.multiprocessing as mp

    lib = (dest / "nvidia" / "nccl" / "lib" / LIB).resolve()
    with open("/proc/self/maps") as f:
        mapped = sorted({line.split(None, 5)[5].strip() for line in f if "libnccl" in line and len(line.split(None, 5)) == 6})
    # torch.cuda.nccl.version() is the header torch was built with (2.28.9 on the GPU machine), not the library it
    # runs: the version that counts is ncclGetVersion of the one file mapped (the process's handle, not a new load)
    code = nccl_version_in_process(mapped[0]) if len(mapped) == 1 else 0
    header = ".".join(map(str, tuple(torch.cuda.nccl.version())[:3]))
    ok = mapped == [str(lib)] and code >= 23000
    version = version_text(code) if code else "?"
    print(f"[nccl_carry] torch {torch.__version__} (built with NCCL {header}) runs NCCL {version}; mapped: {mapped}: {'OK' if ok else 'FAIL'}")
    if ok and torch.cuda.is_available():
        os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
        with tempfile.TemporaryDirectory(prefix="nccl_probe_") as tmp:
            mp.spawn(_probe_rank, args=(os.path.join(tmp, "store"),), nprocs=2)
        print(f"[nccl_carry] OK   2 NCCL ranks on {torch.cuda.get_device_name(0)} all-reduced 4 MiB")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", type=Path, help=f"the {LIB} to reduce (default: the nvidia-nccl wheel of this python)")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "nccl_carry", help="the carry folder (default build/nccl_carry)")
    p.add_argument("--arch", type=int, default=90, help="the SM arch whose code is kept (default 90: H100/H200)")
    p.add_argument("--max-mib", type=float, default=32.0, help="the carry folder's size limit checked (default 32)")
    p.add_argument("--check", action="store_true", help="only check the carry folder already built")
    p.add_argument("--unpack", type=Path, metavar="DIR", help="unpack the carry folder into DIR/nvidia/nccl/{lib,include}, print the version")
    p.add_argument("--probe", type=Path, metavar="DIR", help="check that torch runs DIR's NCCL (started with it ahead: see above)")
    args = p.parse_args(argv)
    if args.probe:
        return 0 if probe(args.probe) else 1
    if args.unpack:
        lib = unpack(args.out, args.unpack)
        print(f"[nccl_carry] {lib}: NCCL {version_text(nccl_version(lib))} (sha256 as in the manifest)")
        return 0
    if not args.check:
        build(args.src or wheel_library(), args.out, args.arch)
    return 0 if check(args.out, args.arch, args.max_mib) else 1


if __name__ == "__main__":
    sys.exit(main())
