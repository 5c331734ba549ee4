"""Rank 0's output: a progress line per path (stderr), the table, the failures and what was
not tested (stdout), ``--json`` and the verdict file of a spawned run."""

from __future__ import annotations

import json
import pathlib

from .. import info, toolchain
from ..bench.record import CPU_LABEL
from .judge import FLOAT64_BOUND

__all__ = ["progress_line", "report"]


def progress_line(r: dict) -> str:
    """One path's result as its progress line."""
    if r["status"] == "PASS":
        return f"PASS {r['path']}: {r['tensor']} {r['max_error']:.2e} <= {r['bound']:.1e}, {r['time_ms']:.1f} ms"
    msg = r["message"] if len(r["message"]) <= 160 else r["message"][:157] + "..."
    return f"{r['status']} {r['path']}: {msg}"


def _table(results: list[dict]) -> str:
    """The result table: text columns left-aligned, numbers right-aligned."""
    cols = ("path", "heads", "batch x seq", "chunks run", "max error", "bound", "result", "ms")
    rows = []
    for r in results:
        heads = f"{r['q_heads']}q/{r['kv_heads']}kv"
        seq = f"{r['batch']}x{sum(r['seq_lens'])}" + ("" if len(set(r["seq_lens"])) == 1 else " uneven")
        seq += f" {len(r['cu_seqlens']) - 1} docs" if r["cu_seqlens"] else ""
        err = "" if r["max_error"] is None else f"{r['tensor']} {r['max_error']:.2e}"
        bound = "" if r["bound"] is None else f"{r['bound']:.1e}"
        ms = "" if r["time_ms"] is None else f"{r['time_ms']:.1f}"
        run = "" if r["chunks_run"] is None else str(r["chunks_run"])
        rows.append((r["path"], heads, seq, run, err, bound, r["status"], ms))
    widths = [max(len(x) for x in col) for col in zip(cols, *rows)]
    right = {3, 4, 5, 7}

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _install_lines(install: dict | None) -> list[str]:
    """What ``info`` found that a user of this run must know: the default kernel set (and
    where it was validated) and whether ``_C``'s error path survives this toolchain."""
    if not install:
        return []
    lines = [f"default kernels (kernels='auto'): {info.default_line(install)}"]
    if "nccl_libraries" in install:  # the NCCL that ran (a record before that key was written has none)
        lines.append(f"NCCL: {info.nccl_line(install)}")
    if install.get("extension_error_path") is not None:
        lines.append(f"_C error path: {toolchain.probe_line(install['extension_error_path'])}")
    return lines


def report(results: list[dict], env: dict, settings: dict, not_tested: dict, args, complete: bool = True) -> None:
    """Rank 0: the table and the failures (stdout), ``--json``, and the verdict file of a
    spawned run. ``complete=False``: the run was ended early (a hang)."""
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    ok = complete and counts["FAIL"] == 0
    where = env.get("gpu") if settings.get("device") == "cuda" else CPU_LABEL
    if settings.get("device") == "cuda" and 0 < settings.get("gpus", 0) < settings.get("world_size", 0):
        where += f" ({settings['world_size']} ranks on {settings['gpus']} GPU{'s' if settings['gpus'] > 1 else ''}: they share its HBM and SMs)"
    dtype = settings.get("dtype")
    rule = f"{FLOAT64_BOUND:g}" if dtype == "fp64" else f"2x PyTorch's own {dtype} error (SDPA, same device)"
    out = [
        f"ulysses_kernels self-test: {settings.get('world_size')} ranks ({settings.get('transport')}) on {where}, "
        f"{dtype}, head_dim {settings.get('head_dim')}, packed documents on {settings.get('packed_kernel')}; bound per tensor (out, dq, dk, dv): {rule}",
        *_install_lines(env.get("install")),
        _table(results),
    ]
    failed = [r for r in results if r["status"] == "FAIL"]
    if failed:
        out.append("failures:")
        out += [f"  {r['path']}: {r['message']}" for r in failed]
    if not_tested:
        out.append("not tested here:")
        out += [f"  {name}: {why}" for name, why in not_tested.items()]
    verdict = "every path matches the float64 reference" if ok else ("FAILED" if complete else "ENDED EARLY (a hang)")
    out.append(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped of {len(results)} paths: {verdict}")
    print("\n".join(out), flush=True)
    doc = {"ok": ok, "complete": complete, "counts": counts, "settings": settings, "environment": env, "not_tested": not_tested, "paths": results}
    for path in (args.json, getattr(args, "verdict_file", None)):
        if path:
            pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(path).write_text(json.dumps(doc, indent=2))
    if args.json:
        print(f"# wrote {args.json}", flush=True)
