"""The calculator's long-context terms as a user runs them: ``--max-seq`` with ``--gpu-gb`` (and
``--host-gb``), its JSON ``max_seq``, the input errors, docs/scaling.md's table of the longest
sequences for four models at sp 8/16/32 (every cell recomputed from the flags the page lists)
and its ablation, the goal (Llama-3-8B at sp 8 on 80 GB above ALST's 3.8M tokens), and the
benchmark's smoke run."""

from __future__ import annotations

import json
import re
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from test_user_commands import run, user_env  # noqa: E402

from ulysses_kernels import memory  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "scaling.md"
ALST_8B_SP8 = 3_800_000  # ArcticTraining projects/sequence-parallelism/run-h100-sp8-llama-8b.yml, max_length
LLAMA_8B = "--layers 32 --hidden 4096 --heads 32 --kv-heads 8 --intermediate 14336 --vocab 128256"
COMMON = "--untied-embeddings --zero 3 --offload-optimizer --checkpointing --tiled-loss --tiled-mlp --tiled-norms --offload-activations"


def setup_from(argv: str) -> memory.Setup:
    """The ``Setup`` the command line ``argv`` (flags only) describes, through the CLI's own parser."""
    args = vars(memory._parser().parse_args(shlex.split(argv)))
    for key in ("json", "max_seq", "gpu_gb", "host_gb", "mixer_parallel"):  # main's own (mixer_parallel: --mixer's)
        args.pop(key)
    args["tie_embeddings"] = not args.pop("untied_embeddings")
    args["seq"] = args["seq"] or args["sp"]
    return memory.Setup(**args)


def millions(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def test_the_goal_llama3_8b_sp8_above_alst():
    setup = setup_from(f"{LLAMA_8B} {COMMON} --sp 8")
    for flash in (False, True):
        longest = memory.max_seq(replace(setup, flash_workspace=flash), 80e9)
        assert longest > ALST_8B_SP8, f"flash_workspace={flash}: {longest:,} tokens"
        # the boundary: one more step of sp tokens does not fit
        assert memory.total_gpu(replace(setup, seq=longest, flash_workspace=flash)) <= 80e9
        assert memory.total_gpu(replace(setup, seq=longest + 8, flash_workspace=flash)) > 80e9


def _doc_table() -> list[list[str]]:
    text = DOC.read_text()
    head = "| model | sp | ours | with flash-attn's workspace | host per rank | with the workspace, 237 GB host per rank | ALST published |"
    assert head in text, "docs/scaling.md has no table of the longest sequences"
    rows = []
    for line in text[text.index(head) :].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def _model_flags() -> dict[str, str]:
    text = DOC.read_text()
    flags = {}
    for name in ("Llama-3-8B", "Qwen2.5-14B", "Qwen3-32B", "Llama-3-70B"):
        m = re.search(re.escape(name) + r" `([^`]+)`", text)
        assert m, f"docs/scaling.md gives no flags for {name}"
        flags[name] = " ".join(m.group(1).split())
    return flags


def test_doc_table_of_the_longest_sequences_is_the_calculators():
    flags = _model_flags()
    rows = _doc_table()
    assert len(rows) == 12
    for name, sp, ours, flash, host, capped, _alst in rows:
        setup = setup_from(f"{flags[name]} {COMMON} --sp {sp}")
        longest = memory.max_seq(setup, 80e9)
        with_ws = replace(setup, flash_workspace=True)
        assert millions(longest) == ours, (name, sp)
        assert millions(memory.max_seq(with_ws, 80e9)) == flash, (name, sp)
        need = sum(r.host for r in memory.memory_rows(replace(setup, seq=longest)))
        assert f"{need / 1e9:.0f} GB" == host, (name, sp)
        assert millions(memory.max_seq(with_ws, 80e9, 237e9)) == capped, (name, sp)


def test_doc_ablation_is_the_calculators():
    text = DOC.read_text()
    setup = setup_from(f"{LLAMA_8B} --untied-embeddings --zero 3 --offload-optimizer --checkpointing --sp 8")
    steps = [
        ("| Ulysses, the loss over tiles", {"tiled_loss": True}),
        ("| + tiled MLP |", {"tiled_loss": True, "tiled_mlp": True}),
        ("| (Ulysses, loss, + checkpoint offload, no tiled MLP) |", {"tiled_loss": True, "offload_activations": True}),
        ("| + checkpoint offload |", {"tiled_loss": True, "tiled_mlp": True, "offload_activations": True}),
        ("| + tiled norms |", {"tiled_loss": True, "tiled_mlp": True, "offload_activations": True, "tiled_norms": True}),
    ]
    for prefix, pieces in steps:
        line = next((ln for ln in text.splitlines() if ln.startswith(prefix)), None)
        assert line is not None, f"docs/scaling.md's ablation has no row {prefix!r}"
        assert f"| {millions(memory.max_seq(replace(setup, **pieces), 80e9))} |" in line, line


def test_doc_max_seq_command_run_from_outside_the_checkout(tmp_path):
    text = DOC.read_text()
    m = re.search(r"^ {4}(python -m ulysses_kernels\.memory [^\n]*--max-seq[^\n]*)$", text, re.M)
    assert m, "docs/scaling.md shows no --max-seq command"
    argv = shlex.split(m.group(1))
    out = run([sys.executable, "-I", *argv[1:]], tmp_path, env=user_env()).stdout.strip()
    assert out in text, f"docs/scaling.md's --max-seq output differs from what the command prints:\n{out}"
    data = json.loads(run([sys.executable, "-I", *argv[1:], "--json"], tmp_path, env=user_env()).stdout)
    assert data["max_seq"] > ALST_8B_SP8 and data["gpu_gb"] == 80
    assert data["setup"]["seq"] == data["max_seq"] and data["total_gpu"] <= 80e9
    assert data["step"]["moment"] and data["total_host"] == sum(r["host"] for r in data["rows"])


@pytest.mark.parametrize(
    "extra, needle",
    [
        ("--max-seq", "--max-seq needs --gpu-gb"),
        ("--max-seq --gpu-gb 80 --seq 1024", "--max-seq finds --seq: give one of them"),
        ("", "the following arguments are required: --seq"),
        ("--max-seq --gpu-gb -1", "--gpu-gb expected a positive number of GB, got -1.0"),
        ("--max-seq --gpu-gb 1", "not even 8 tokens fit 1.0 GB per GPU"),
        ("--seq 1024 --offload-activations", "offload_activations expected checkpointing"),
    ],
)
def test_cli_errors(capsys, extra, needle):
    with pytest.raises(SystemExit) as exit_:
        memory.main(shlex.split(f"{LLAMA_8B} --sp 8 --zero 3 {extra}"))
    out = capsys.readouterr()
    assert exit_.value.code == 2 and needle in out.err and out.out == "", out.err


@pytest.mark.parametrize(
    "argv, gpu_gb, host_gb",
    [
        (f"{LLAMA_8B} {COMMON} --sp 8", 80, None),
        (f"{LLAMA_8B} {COMMON} --sp 8", 80, 100),  # the host binds
        (f"{LLAMA_8B} --zero 1 --sp 4", 80, None),  # no pieces: activations grow fastest
        (f"{LLAMA_8B} {COMMON} --sp 6", 80, None),  # 32 heads over 6 ranks: uneven heads
        ("--layers 8 --hidden 1024 --heads 8 --kv-heads 2 --vocab 32000 --mixer qwen3.5 --checkpointing --sp 4", 24, 30),
        (f"{LLAMA_8B} --sp 8", 1, None),  # not even sp tokens fit
    ],
)
def test_max_seq_is_the_last_fitting_multiple_of_sp(argv, gpu_gb, host_gb):
    """The search's answer by its definition: it fits, and sp tokens more do not."""
    setup = setup_from(argv)
    host = None if host_gb is None else host_gb * 1e9

    def fits(seq: int) -> bool:
        rows = memory.memory_rows(replace(setup, seq=seq))
        return sum(r.gpu for r in rows) <= gpu_gb * 1e9 and (host is None or sum(r.host for r in rows) <= host)

    longest = memory.max_seq(setup, gpu_gb * 1e9, host)
    assert longest % setup.sp == 0
    assert longest == 0 and not fits(setup.sp) or fits(longest) and not fits(longest + setup.sp), longest


def test_host_cap_shortens():
    setup = setup_from(f"{LLAMA_8B} {COMMON} --sp 8")
    free = memory.max_seq(setup, 80e9)
    capped = memory.max_seq(setup, 80e9, 100e9)
    assert capped < free
    assert sum(r.host for r in memory.memory_rows(replace(setup, seq=capped))) <= 100e9


def test_bench_smoke(tmp_path):
    """The benchmark as documented, tiny: every row's gradients equal the row without pieces,
    and the measured peak is the calculator's (or gloo's late frees above it)."""
    argv = [sys.executable, "-I", "-m", "ulysses_kernels.bench.longctx", "--spawn", "2", "--seqs", "256", "--tile", "32",
            "--out-dir", str(tmp_path / "out")]  # fmt: skip
    run(argv, tmp_path, env=user_env())
    data = json.loads((tmp_path / "out" / "bench_longctx_latest.json").read_text())
    rows = {r["pieces"]: r for r in data["rows"]}
    assert set(rows) == {"none", "loss", "mlp", "norms", "offload", "all"}
    for name, r in rows.items():
        assert r["wrong"] == 0, name
        # NOTE: the benchmark does not wait for gloo's worker thread to let go of a finished
        # collective's buffers (tests/test_memory.py's _settle does): measured, a row's peak is
        # then the calculator's or one [seq_local, hidden] buffer more (32 KB here, 3%).
        assert r["calc_mb"] <= r["peak_mb"] + 1e-6 and r["peak_mb"] <= 1.05 * r["calc_mb"], (name, r)
    assert rows["all"]["peak_mb"] < rows["none"]["peak_mb"] and rows["offload"]["host_mb"] > 0


def test_head_chunked_attention_projection_in_docs():
    """docs/longctx.md's projection for the attention backward in head chunks, recomputed."""
    setup = replace(setup_from(f"{LLAMA_8B} {COMMON} --sp 8"), flash_workspace=True)
    before, after = memory.max_seq(setup, 80e9), memory.max_seq(replace(setup, attention_head_chunk=1), 80e9)
    assert after > before
    text = (ROOT / "docs" / "longctx.md").read_text()
    assert f"goes from {millions(before)} to {millions(after)} tokens" in " ".join(text.split())
