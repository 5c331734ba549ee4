"""The overlap targets of ``bench.overlap``, judged on its rows: exposed communication at
most ``EXPOSED_LIMIT`` of the all-to-all time at long sequences, and ``chunks="auto"`` never
slower than chunks=1; each PASS, FAIL or "not evaluated" with the reason (``verdicts``), why
a run's timings cannot carry the claim (``claim_context``), and the summary printed under
the table (``print_verdicts``)."""

from __future__ import annotations

import os

import torch

EXPOSED_LIMIT = 0.10  # exposed communication at most 10% of the all-to-all time alone


def _groups(rows) -> dict:
    """Rows by (layout, seq, pass), in order."""
    out = {}
    for r in rows:
        out.setdefault((r["layout"], r["seq"], r["pass"]), []).append(r)
    return out


def _overall(groups: list[dict], none_reason: str, not_a_claim: str | None) -> tuple[str, str]:
    judged = [g for g in groups if g["measured"] in ("PASS", "FAIL")]
    if not judged:
        return "not evaluated", none_reason
    fails = sum(g["measured"] == "FAIL" for g in judged)
    status, counts = ("FAIL" if fails else "PASS"), f"{len(judged) - fails} of {len(judged)} groups pass"
    if not_a_claim:
        return "not evaluated", f"{not_a_claim} (this run's numbers would give {status}: {counts})"
    return status, counts


def verdicts(rows, long_from: int, slack: float | None = None, not_a_claim: str | None = None) -> dict:
    """The two overlap targets, judged on ``measure``'s rows, per (layout, seq, pass).

    ``exposed``: groups with ``seq >= long_from`` (the "long sequences") and at least one
    chunked row (chunks > 1): the fastest chunked row's ``exposed_frac <= EXPOSED_LIMIT``
    (the layer as best configured; the auto row's share is kept beside it). Shorter groups
    are not judged; a long group without a chunked row is listed as not evaluated.
    ``auto``: every group with an auto row: ``layer(auto) <= layer(chunks=1) * (1 +
    allowance)``. ``allowance`` = ``slack`` when given (0: strict), else the larger
    ``spread`` of the two rows: this run's own noise (half the range of the iteration times
    over their median), below which two medians of so few iterations do not differ. When
    auto picks 1 its row is the chunks=1 row: ratio 1, PASS.
    ``not_a_claim``: why this run cannot support the claim (CPU timings, a world of one,
    ranks sharing a GPU); every group's ``status`` is then "not evaluated" and ``measured``
    keeps what the numbers say.

    Returns ``{"exposed": {...}, "auto": {...}}``, each with ``status`` (PASS, FAIL or
    "not evaluated"), ``reason``, ``covers`` and ``groups`` (one dict per group judged).
    """
    exposed, auto = [], []
    for (lay, S, p), g in _groups(rows).items():
        key = dict(layout=lay, seq=S, **{"pass": p})
        one = next((r for r in g if r["chunks"] == 1), None)
        if long_from <= S:
            chunked = [r for r in g if r["chunks"] > 1 and r["exposed_frac"] is not None]
            if not chunked:
                exposed.append(dict(key, chunks=None, value=None, limit=EXPOSED_LIMIT, measured="not evaluated",
                                    status="not evaluated", reason="no chunked row (the plan cannot split, or --chunks 1)"))  # fmt: skip
            else:
                best = min(chunked, key=lambda r: r["layer_ms"])
                a = next((r for r in g if r["auto"]), None)
                ok = best["exposed_frac"] <= EXPOSED_LIMIT
                exposed.append(dict(key, chunks=best["chunks"], value=best["exposed_frac"], limit=EXPOSED_LIMIT,
                                    auto_value=a["exposed_frac"] if a else None, measured="PASS" if ok else "FAIL"))  # fmt: skip
        a = next((r for r in g if r["auto"]), None)
        if a is None or one is None:
            auto.append(dict(key, chunks=None, value=None, limit=None, measured="not evaluated", status="not evaluated",
                             reason="no auto row" if a is None else "no chunks=1 row"))  # fmt: skip
            continue
        allow = slack if slack is not None else max(one.get("spread") or 0.0, a.get("spread") or 0.0)
        ratio = 1.0 if a is one else a["layer_ms"] / one["layer_ms"]
        auto.append(dict(key, chunks=a["chunks"], value=ratio, limit=1.0 + allow, allowance=allow,
                         measured="PASS" if ratio <= 1.0 + allow else "FAIL"))  # fmt: skip
    for g in exposed + auto:
        if g["measured"] in ("PASS", "FAIL"):
            g["status"] = "not evaluated" if not_a_claim else g["measured"]
            g["reason"] = not_a_claim
    long_txt = f"groups with seq >= {long_from} (--long-from) and a chunked row, the fastest chunked row"
    allow_txt = "the run's spread (half the iteration range / median)" if slack is None else f"{slack:.1%} (--auto-slack)"
    out = {
        "exposed": dict(zip(("status", "reason"), _overall(exposed, f"no sequence >= {long_from} with a chunked row", not_a_claim)),
                        covers=long_txt, limit=EXPOSED_LIMIT, long_from=long_from, groups=exposed),
        "auto": dict(zip(("status", "reason"), _overall(auto, "no auto row", not_a_claim)),
                     covers=f"every group with an auto row; allowance {allow_txt}", slack=slack, groups=auto),
    }  # fmt: skip
    return out


def claim_context(device: torch.device, world: int) -> str | None:
    """Why this run's timings cannot judge the overlap targets, or None when they can
    (CUDA, two ranks or more, one GPU per rank)."""
    if device.type != "cuda":
        return "CPU run: timings are not GPU claims"
    if world < 2:
        return "world of one: no byte crosses a link"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local > torch.cuda.device_count():
        return f"{local} ranks share {torch.cuda.device_count()} GPU(s): not one GPU per rank"
    return None


def print_verdicts(v: dict) -> None:
    """The targets' summary under the table (rank 0): the overall verdict, then one line per
    judged group when the run can support the claim (else only the counts, in the reason)."""
    for name, label in (("exposed", f"exposed/a2a <= {EXPOSED_LIMIT:.0%}"), ("auto", "auto <= chunks=1")):
        t = v[name]
        print(f"# target {label}: {t['status']}: {t['reason']}", flush=True)
        print(f"#   covers {t['covers']}", flush=True)
        judged = any(g["value"] is not None for g in t["groups"])
        for g in t["groups"]:
            if g["status"] == "not evaluated" and (g["measured"] != "not evaluated" or not judged):
                continue  # not a claim, or nothing judged: the line above says why
            where = f"{g['layout']} S={g['seq']} {g['pass']}"
            if g["value"] is None:
                print(f"#   {where}: not evaluated: {g['reason']}", flush=True)
            elif name == "exposed":
                print(f"#   {where}: {g['status']}: {g['value']:.1%} at chunks={g['chunks']}", flush=True)
            else:
                print(f"#   {where}: {g['status']}: auto (chunks={g['chunks']}) / chunks=1 = {g['value']:.3f} "
                      f"(limit {g['limit']:.3f})", flush=True)  # fmt: skip
