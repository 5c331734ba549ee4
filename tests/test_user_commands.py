"""What ships, run the way a user runs it.

The installed package from a directory outside the checkout (``python -I``, no
PYTHONPATH: the source tree is not on ``sys.path``, as it is under pytest), every command
line the docs show for ``examples/train_hf.py`` exactly as written (parsed from the docs,
so the two cannot drift), the torchrun demo, the build's refusal to install less than
asked, the import-time message without the extension, and a wheel: pinned to the torch it
was built against, with no path of the build machine in its RUNPATH.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from ulysses_kernels import extension
from ulysses_kernels.kernels import kernel_set_report

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's python, torchrun, pip
EXAMPLE = "examples/train_hf.py"
# Where the example's command lines are documented (the example's own docstring is its --help).
DOC_FILES = ("README.md", "docs/usage.md", "docs/hf.md", EXAMPLE)
# The site-packages that hold torch and the rest, for an interpreter started with -S: no
# .pth files run, so the editable install's import hook cannot put this checkout in front of
# a copy under test. The venv's own, and torch's where that is elsewhere (a venv made with
# ULYSSES_KERNELS_SYSTEM_TORCH=1 borrows the machine's packages through a .pth).
SITE_DIRS = list(dict.fromkeys([sysconfig.get_paths()["purelib"], str(Path(torch.__file__).resolve().parents[1])]))


def user_env(**extra) -> dict:
    """The environment of a user's shell: no PYTHONPATH, and not the interpreter switch conftest sets."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def run(argv, cwd, *, timeout=300, env=None, expect_rc=0) -> subprocess.CompletedProcess:
    argv = [str(a) for a in argv]
    try:
        r = subprocess.run(argv, cwd=cwd, env=env or user_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{shlex.join(argv)} (in {cwd}) did not finish in {timeout} s:\n{(e.stdout or '')[-2000:]}\n{(e.stderr or '')[-2000:]}")
    ok = r.returncode == 0 if expect_rc == 0 else r.returncode != 0
    assert ok, f"{shlex.join(argv)} (in {cwd}) exited {r.returncode}, expected {'0' if expect_rc == 0 else 'non-zero'}:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


# ---- the installed package, from outside the checkout -----------------------------------------
def test_import_from_outside_the_checkout(tmp_path):
    code = "import json, sys, ulysses_kernels; print(ulysses_kernels.__version__); print(json.dumps(sys.path)); print('torch._dynamo' in sys.modules)"
    version, path, dynamo = run([sys.executable, "-I", "-c", code], tmp_path).stdout.splitlines()[:3]
    assert version == importlib.import_module("ulysses_kernels").__version__
    # torch.compile's machinery is not imported with the package (2.9 s of a 6.6 s import here): kernels/__init__.py's _constant_in_traces.
    assert dynamo == "False", "import ulysses_kernels imported torch._dynamo"
    path = json.loads(path)
    assert str(ROOT) not in path and "" not in path and str(tmp_path) not in path, f"the checkout or the working directory is on sys.path: {path}"


def test_info_from_outside_the_checkout_lists_every_kernel_set(tmp_path):
    out = run([sys.executable, "-I", "-m", "ulysses_kernels.info"], tmp_path).stdout
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith(" ")}
    for entry in kernel_set_report():
        assert entry["name"] in lines, f"kernel set {entry['name']!r} missing from the report:\n{out}"
    assert re.search(r"^\s+torch\s+runs here", out, re.M), out
    if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
        # The user's shell has no TRITON_INTERPRET: Triton is installed but cannot run here, and says why.
        assert re.search(r"^\s+triton\s+not here\s+\S", out, re.M), out
    ext = next(line for line in out.splitlines() if line.startswith("_C extension"))
    assert ext.split(None, 2)[2].startswith("built" if extension.available() else "NOT BUILT"), ext
    # The integrations' libraries, by their installed metadata (the set-up installs transformers).
    assert re.search(r"^integrations\s+versions installed, not imported", out, re.M), out
    assert re.search(rf"^\s+transformers\s+{re.escape(importlib.metadata.version('transformers'))}", out, re.M), out


# The module paths users type (README, docs/performance.md, docs/gpu_validation.md): each must keep
# working from outside the checkout whatever the package's insides become (#40 split three of them).
USER_MODULES = (
    "selftest",
    "memory",
    "demo",
    *(f"bench.{name}" for name in ("alltoall", "attention", "host", "hybrid_step", "longctx", "overlap", "pack", "perf_model", "ring_balance", "summary")),
)


@pytest.mark.parametrize("module", USER_MODULES)
def test_user_module_paths_run_from_outside_the_checkout(module, tmp_path):
    out = run([sys.executable, "-I", "-m", f"ulysses_kernels.{module}", "--help"], tmp_path, timeout=120).stdout
    assert out.startswith("usage:"), out[:500]


def test_torchrun_demo_from_outside_the_checkout(tmp_path):
    run([BIN / "torchrun", "--standalone", "--nproc-per-node", "2", "-m", "ulysses_kernels.demo"], tmp_path, timeout=400)


def test_torchrun_without_a_process_group_fails_on_every_rank(tmp_path):
    """A script under torchrun that forgets init_process_group: every rank raises (before,
    each rank silently attended over its own shard only, as a world of one)."""
    script = tmp_path / "forgot_init.py"
    # Both ranks reach the call together (a barrier of files, not a process group): torchrun ends
    # the other workers at its first check after one fails, and a rank still importing torch was
    # SIGTERMed before it could raise (seen at load 8+, and again on session 16's idle fresh clone,
    # with --monitor-interval 10: rank 1's stderr empty).
    script.write_text(
        "import os, pathlib, time, torch, ulysses_kernels as uk\n"
        f"here = pathlib.Path({str(tmp_path)!r})\n"
        "(here / f\"ready.{os.environ['RANK']}\").touch()\n"
        "end = time.monotonic() + 240\n"
        "while len(list(here.glob('ready.*'))) < 2 and time.monotonic() < end:\n"
        "    time.sleep(0.05)\n"
        "q = torch.randn(1, 8, 4, 8)\nuk.ulysses_attention(q, q[:, :, :2], q[:, :, :2])\nprint('attended alone')\n"
    )
    # --monitor-interval 10: more time still between the first failure and the ending of the rest.
    # --redirects 3 --log-dir: each rank's stdout/stderr in files of its own (on one shared stderr the
    # two tracebacks interleave mid-line at load, and a count of the message over both undercounts).
    logs = tmp_path / "logs"
    cmd = [BIN / "torchrun", "--standalone", "--monitor-interval", "10", "--nproc-per-node", "2", "--redirects", "3", "--log-dir", logs, script]
    r = run(cmd, tmp_path, timeout=300, expect_rc=1)
    per_rank = {p.parent.name: p.read_text() for p in logs.rglob("stderr.log")}
    out = r.stdout + r.stderr + "".join(per_rank.values())
    assert "attended alone" not in out, out
    assert sorted(per_rank) == ["0", "1"], (sorted(per_rank), out)
    for rank, err in per_rank.items():
        assert "NoProcessGroupError: ulysses_kernels: WORLD_SIZE=2 in the environment" in err, (rank, err)


def test_readme_says_to_activate_the_venv_before_its_commands():
    """The commands after the first two run in the set-up's venv; the README says so before
    its first ``python -m`` (the system python has no torch)."""
    text = (ROOT / "README.md").read_text()
    assert "source .venv/bin/activate" in text[: text.index("python -m ")], "the README does not say to activate .venv before its commands"


# ---- the README's first example, as written ---------------------------------------------------
def readme_first_example() -> tuple[str, str]:
    """The README's first example (the python block after ``<!-- first-example -->``) and the
    command line it is run with (``torchrun ... first.py``, in the paragraph before it)."""
    text = (ROOT / "README.md").read_text()
    start = text.index("<!-- first-example -->")
    code = re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)
    intro = text[text.rindex("\n## ", 0, start) : start]
    cmd = re.search(r"`(torchrun [^`]*first\.py)`", intro).group(1)
    return code, cmd


def test_readme_first_example_runs_as_written(tmp_path):
    """The first example a newcomer copies: saved as the README says, run with the README's
    command from a directory outside the checkout; it checks itself against one process.
    NOTE: about 30 s on 2 loaded cores (two ranks importing transformers)."""
    pytest.importorskip("transformers")
    code, cmd = readme_first_example()
    assert len(code.splitlines()) <= 40, "the first example grew past a screenful"
    (tmp_path / "first.py").write_text(code)
    argv = shlex.split(cmd)
    argv[0] = str(BIN / "torchrun")
    out = run(argv, tmp_path, timeout=400).stdout
    assert "ulysses_attention and Qwen3_5ForCausalLM over 2 ranks match one process" in out, out


# ---- every documented command line of the example, as written ---------------------------------
def documented_example_commands() -> list[str]:
    """``python``/``torchrun`` command lines of ``examples/train_hf.py`` in the docs, comments dropped."""
    found = []
    for name in DOC_FILES:
        text = (ROOT / name).read_text()
        for m in re.finditer(r"(?:python|torchrun)\b[^`\n#]*?\bexamples/train_hf\.py\b[^`\n#]*", text):
            cmd = " ".join(m.group(0).split())
            if cmd not in found:
                found.append(cmd)
    return found


def test_the_docs_show_example_commands():
    cmds = documented_example_commands()
    assert "python examples/train_hf.py --spawn 2" in cmds, cmds
    assert any("--model llama" in c for c in cmds), cmds
    assert any(c.startswith("torchrun ") for c in cmds), cmds


@pytest.mark.parametrize("cmd", documented_example_commands())
def test_documented_example_command(cmd, tmp_path):
    # A copy of the example outside the checkout, run from its parent as the docs write it.
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / EXAMPLE, tmp_path / EXAMPLE)
    argv = shlex.split(cmd)
    argv[0] = {"python": sys.executable, "torchrun": str(BIN / "torchrun")}[argv[0]]
    out = run(argv, tmp_path, timeout=400).stdout
    assert "matches one process" in out, out  # step 0 checked against one process (the exit code checks the rest)


def test_every_model_builds_with_the_default_sizes():
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("train_hf_example", ROOT / EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for family in example.FAMILIES:
        args = example.parse_args(["--model", family])
        model = example.build_model(args)  # raises when the config rejects the default sizes
        assert model.config.hidden_size == args.hidden == args.heads * args.head_dim, family


# ---- the build: less than asked is an error, not a quieter install ----------------------------
def _load_setup():
    spec = importlib.util.spec_from_file_location("ulysses_kernels_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # setup() runs only as __main__
    return module


def test_build_decision():
    S = _load_setup()
    assert S.decide({}, "2.14.1+cu130", "13.0", "/usr/local/cuda") == "cuda"
    assert S.decide({}, "2.13.0+cpu", None, "/usr/local/cuda") == "cpu"
    assert S.decide({"ULYSSES_KERNELS_SKIP_CUDA_BUILD": "1"}, "2.14.1+cu130", "13.0", "/usr/local/cuda") == "cpu"
    assert S.decide({"ULYSSES_KERNELS_SKIP_EXTENSION": "1"}, None, None, None) == "none"
    with pytest.raises(S.BuildError, match=r"(?s)torch is not importable at build time.*pip install --no-build-isolation \..*ULYSSES_KERNELS_SKIP_EXTENSION=1"):
        S.decide({}, None, None, "/usr/local/cuda")
    with pytest.raises(S.BuildError, match=r"(?s)torch 2\.14\.1\+cu130 is a CUDA 13\.0 build but no CUDA toolkit.*ULYSSES_KERNELS_SKIP_CUDA_BUILD=1"):
        S.decide({}, "2.14.1+cu130", "13.0", None)
    assert S._building(["setup.py", "bdist_wheel", "--dist-info-dir", "x"]) and not S._building(["setup.py", "egg_info"])
    assert S._building(["setup.py", "dist_info", "--output-dir", "x"])  # the wheel's metadata: before pip downloads torch
    S.check_setuptools("77.0.3")
    with pytest.raises(S.BuildError, match=r"setuptools 65\.5\.0 is too old .*\n    pip install 'setuptools>=77' && pip install --no-build-isolation \.$"):
        S.check_setuptools("65.5.0")
    assert S.nccl_runpath("/a/venv/lib/python3.11/site-packages/nvidia/nccl/lib") == "$ORIGIN/../nvidia/nccl/lib"
    assert S.nccl_runpath("/usr/lib/x86_64-linux-gnu") is None


def _source_copy(dest: Path) -> Path:
    """The files a source distribution holds (no build outputs, no compiled extension)."""
    for name in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in"):
        shutil.copy(ROOT / name, dest / name)
    shutil.copytree(ROOT / "csrc", dest / "csrc")
    shutil.copytree(ROOT / "build_backend", dest / "build_backend", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "ulysses_kernels", dest / "ulysses_kernels", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return dest


def test_a_build_that_cannot_see_torch_fails_and_says_how(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _source_copy(src)
    hide = tmp_path / "hide" / "torch"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError('no torch in this build environment (as under pip build isolation)')\n")
    env = user_env(PYTHONPATH=str(tmp_path / "hide"))
    # An sdist's metadata needs no torch (and without the extension, requires torch>=2.8 and numpy) ...
    run([sys.executable, "setup.py", "egg_info"], src, env=env, timeout=120)
    requires = (src / "ulysses_kernels.egg-info" / "requires.txt").read_text().split("\n\n")[0].split()  # before the extras
    assert requires == ["torch>=2.8", "numpy"], requires
    # ... a wheel's metadata (what pip asks for before resolving dependencies) and the build refuse, saying what to run.
    for command in ("dist_info", "bdist_wheel"):
        r = run([sys.executable, "setup.py", command], src, env=env, timeout=120, expect_rc=1)
        assert "torch is not importable at build time" in r.stderr, r.stderr
        assert "pip install 'setuptools>=77' && pip install --no-build-isolation ." in r.stderr, r.stderr
    assert not list(src.glob("dist/*.whl"))


def test_plain_pip_install_says_what_to_run_before_it_fetches_anything(tmp_path):
    """``pip install .`` in a new venv whose pip can fetch nothing (no index, no links, no
    config): the in-tree build backend's message, where pip first asks for the build
    requirements. Before (``requires = ["setuptools>=77", "wheel"]``), pip fetched those
    first and, with no index, stopped at "Could not find a version that satisfies the
    requirement setuptools>=77" without the message. NOTE: about 15 s (most of it the venv)."""
    src = tmp_path / "src"
    src.mkdir()
    _source_copy(src)
    run([sys._base_executable, "-m", "venv", tmp_path / "venv"], tmp_path, timeout=300)
    env = user_env(PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS="", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("ULYSSES_KERNELS_SKIP_EXTENSION", None)
    r = run([tmp_path / "venv" / "bin" / "python", "-m", "pip", "install", "--no-index", src], tmp_path, env=env, timeout=300, expect_rc=1)
    out = r.stdout + r.stderr
    assert "[ulysses_kernels build] ERROR: torch is not importable at build time" in out, out
    assert "pip install 'setuptools>=77' && pip install --no-build-isolation ." in out, out
    assert "Installing build dependencies" not in out and "Could not find a version" not in out, out
    assert not list((tmp_path / "venv").glob("lib/python*/site-packages/ulysses_kernels*")), "installed anyway"


@pytest.mark.skipif(os.environ.get("ULYSSES_KERNELS_SYSTEM_TORCH") == "1", reason="an offline machine (system torch): pip cannot reach a package index")
def test_pip_install_in_a_new_venv_says_what_it_needs_before_downloading(tmp_path):
    """A user's first try, in a new venv with no torch: plain ``pip install .`` stops at the
    wheel's metadata with our message (before this it downloaded torch and its CUDA wheels,
    about 540 MB, and then refused); ``--no-build-isolation`` with the venv's own old
    setuptools (65.5 under Python 3.11) says to upgrade it (before: an opaque
    "invalid pyproject.toml config: project.license"); the commands it prints then get past
    setuptools to what is really missing, torch."""
    src = tmp_path / "src"
    src.mkdir()
    _source_copy(src)
    run([sys.executable, "-m", "venv", tmp_path / "venv"], tmp_path, timeout=120)
    py = tmp_path / "venv" / "bin" / "python"
    env = user_env(PIP_DISABLE_PIP_VERSION_CHECK="1")
    r = run([py, "-m", "pip", "install", src], tmp_path, env=env, timeout=600, expect_rc=1)
    out = r.stdout + r.stderr
    assert "torch is not importable at build time" in out and "pip install 'setuptools>=77' && pip install --no-build-isolation ." in out, out
    assert not re.search(r"(Collecting|Downloading) torch\b", out), out
    have = subprocess.run([py, "-c", "import setuptools; print(setuptools.__version__)"], capture_output=True, text=True).stdout.strip()
    if have and int(have.split(".")[0]) < 77:  # Python <= 3.11's venvs; 3.12's have no setuptools at all
        r = run([py, "-m", "pip", "install", "--no-build-isolation", src], tmp_path, env=env, timeout=600, expect_rc=1)
        out = r.stdout + r.stderr
        assert f"setuptools {have} is too old" in out and "project.license" in out, out
    # The printed commands, as printed (in the source directory, where "." is the package).
    upgrade, build = "pip install 'setuptools>=77'", "pip install --no-build-isolation ."
    run([py, "-m", *shlex.split(upgrade)], src, env=env, timeout=600)
    r = run([py, "-m", *shlex.split(build)], src, env=env, timeout=600, expect_rc=1)
    out = r.stdout + r.stderr
    assert "torch is not importable at build time" in out and "too old" not in out, out


def _constraints() -> dict[str, str]:
    """scripts/constraints.txt as ``{normalized name: version}``."""
    out = {}
    for line in (ROOT / "scripts" / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, want = line.split("==")
            out[_normalized(name)] = want
    return out


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def installed_versions(site_dir: str | Path) -> dict[str, str]:
    """``{normalized name: version}`` of the distributions installed in ``site_dir`` (its
    ``*.dist-info``), and nothing else: not what ``sys.path`` holds at the time. setuptools,
    once imported anywhere in the process, appends its ``_vendor`` directory to
    ``sys.path``, whose own importlib-metadata, zipp, platformdirs ... are not what the
    set-up installed (a fresh ``bash scripts/test.sh`` failed on them, measured 2026-11-27)."""
    return {_normalized(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=[str(site_dir)])}


def pin_drift(constraints: dict[str, str], installed: dict[str, str]) -> list[str]:
    """The installed distributions whose version is not the pinned one (a local version
    label, torch's ``+cu130``, is the pinned version); a pin that is not installed is a
    peer the set-up skipped (``ULYSSES_KERNELS_PEERS=0``, or no network), not drift."""
    drift = []
    for name, want in constraints.items():
        have = installed.get(name)
        if have is not None and have != want and not have.startswith(want + "+"):
            drift.append(f"{name} {have} (constraints: {want})")
    return drift


def test_setup_pins_every_package_it_installs():
    """scripts/setup.sh installs the base and (unless ULYSSES_KERNELS_PEERS=0) the peers at
    exact versions, every pip call under scripts/constraints.txt (transitive requirements
    too), and the venv it made holds those versions: an unpinned peer turned a fresh CI red
    (DeepSpeed 0.19.8's ZeRO-3 refused the float64 model the suite had passed with)."""
    text = (ROOT / "scripts" / "setup.sh").read_text()
    constraints = _constraints()
    arrays = re.findall(r"^([A-Z]+_PKGS)=\((.*?)\)$", text, re.M | re.S)
    assert {"BASE_PKGS", "PEER_PKGS", "VERL_PKGS"} <= {name for name, _ in arrays}, arrays
    torch_spec = re.search(r"TORCH_SPEC=\$\{ULYSSES_KERNELS_TORCH:-(.*)\}", text).group(1)
    specs = [torch_spec if s == "$TORCH_SPEC" else s for _, body in arrays for s in shlex.split(body, comments=True)]
    unpinned = [s for s in specs if not re.fullmatch(r"[A-Za-z0-9_.\-]+(\[[a-z,]+\])?==[0-9][A-Za-z0-9.+]*", s)]
    assert not unpinned, f"setup.sh installs {unpinned} without an exact version"
    for spec in specs:
        name, want = re.sub(r"\[.*\]", "", spec).split("==")
        assert constraints.get(_normalized(name)) == want, f"{spec}: scripts/constraints.txt has {constraints.get(_normalized(name))}"
    installs = [line for line in text.splitlines() if re.search(r'"\$\{PIP\[@\]\}" install', line) and "-e ." not in line]
    assert installs and all('"${PINNED[@]}"' in line for line in installs), installs
    if os.environ.get("ULYSSES_KERNELS_SYSTEM_TORCH") == "1":
        return  # a venv borrowing the machine's packages holds what that machine has
    # The venv's own site-packages: what the set-up installed, whatever this process imported.
    drift = pin_drift(constraints, installed_versions(sysconfig.get_paths()["purelib"]))
    assert not drift, f"installed versions differ from scripts/constraints.txt: {drift}"


def test_pin_check_judges_the_venv_not_what_setuptools_put_on_sys_path(tmp_path, monkeypatch):
    """After ``import setuptools`` (its ``_vendor`` directory on ``sys.path``, with its own
    zipp, importlib-metadata ...), the pin check still reads only the venv: in the real venv
    (the suite imports setuptools in this process first), and in a made-up one where a
    sys.path entry holds other versions of the pinned names."""
    import setuptools  # noqa: F401 - the import is the point: it extends sys.path

    site = sysconfig.get_paths()["purelib"]
    assert installed_versions(site).get("torch", "").split("+")[0] == torch.__version__.split("+")[0]
    if os.environ.get("ULYSSES_KERNELS_SYSTEM_TORCH") != "1":
        assert not pin_drift(_constraints(), installed_versions(site))
    fake_site, vendored = tmp_path / "site", tmp_path / "vendored"
    for where, version in ((fake_site, "3.23.0"), (vendored, "3.20.0")):
        info = where / f"zipp-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: zipp\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(vendored))  # what imports see first: not what was installed
    assert importlib.metadata.version("zipp") == "3.20.0"
    assert installed_versions(fake_site) == {"zipp": "3.23.0"}
    assert pin_drift({"zipp": "3.23.0", "deepspeed": "0.19.8"}, installed_versions(fake_site)) == []
    assert pin_drift({"zipp": "3.20.0"}, installed_versions(fake_site)) == ["zipp 3.23.0 (constraints: 3.20.0)"]


INTEGRATION_DISTS = ("deepspeed", "accelerate", "verl", "torchtitan")


@pytest.mark.skipif(os.environ.get("ULYSSES_KERNELS_SYSTEM_TORCH") == "1", reason="a venv borrowing the machine's packages: no pip index to take away")
def test_setup_without_network_goes_on_and_says_what_it_skipped(tmp_path):
    """scripts/setup.sh on a machine whose pip cannot download anything (no index, no
    links): the venv has the base packages but not the integrations, and the set-up says
    which it skipped and why, notes them for pytest's summary, prints no pip ERROR line and
    exits 0; ULYSSES_KERNELS_PEERS=0 leaves them out without trying. The venv borrows this
    one's packages (links to its site-packages, the integrations and this package left out),
    so nothing is downloaded and nothing of this venv is touched (pip installs only this
    package, editable, into the new venv). NOTE: about 15 s on 2 idle cores."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    _source_copy(repo)
    for name in ("setup.sh", "constraints.txt"):
        shutil.copy(ROOT / "scripts" / name, repo / "scripts" / name)
    site = tmp_path / "site"
    site.mkdir()
    leave_out = (*INTEGRATION_DISTS, "ulysses_kernels", "_ulysses_kernels", "__editable__", "distutils-precedence.pth", "__pycache__")
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(leave_out):
            (site / entry.name).symlink_to(entry)
    run([sys._base_executable, "-m", "venv", "--without-pip", repo / ".venv"], tmp_path, timeout=120)
    pth = next((repo / ".venv" / "lib").glob("python*/site-packages"))
    (pth / "_borrowed.pth").write_text(f"import site; site.addsitedir({str(site)!r})\n")
    offline = user_env(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS="", ULYSSES_KERNELS_SKIP_EXTENSION="1")
    offline.pop("ULYSSES_KERNELS_PEERS", None)
    r = run(["bash", "scripts/setup.sh"], repo, env=offline, timeout=600)
    out = r.stdout + r.stderr
    # The venv's own torch extension cache (DeepSpeed's shm_comm op is built once per venv, not in
    # turn by every checkout sharing ~/.cache/torch_extensions); a value in the environment wins.
    code = "import os; print(os.environ['TORCH_EXTENSIONS_DIR'])"
    no_ext = {k: v for k, v in offline.items() if k != "TORCH_EXTENSIONS_DIR"}
    assert run([repo / ".venv" / "bin" / "python", "-c", code], tmp_path, env=no_ext).stdout.strip() == str(repo / ".venv" / "torch_extensions")
    assert run([repo / ".venv" / "bin" / "python", "-c", code], tmp_path, env=dict(no_ext, TORCH_EXTENSIONS_DIR="/x")).stdout.strip() == "/x"
    assert re.search(r"^\[setup\] skipping deepspeed, accelerate: pip could not download the pinned versions \(no network\?\)", out, re.M), out
    assert re.search(r"^\[setup\] skipping verl: pip could not download", out, re.M), out
    assert re.search(r"^\[setup\] skipping torchtitan: pip could not download", out, re.M), out
    assert not re.search(r"^ERROR", out, re.M), out
    note = (repo / "build" / "setup_skipped_integrations.txt").read_text().splitlines()
    assert [line.split("\t")[0] for line in note] == list(INTEGRATION_DISTS), note
    assert all("could not download it (no network" in line for line in note), note
    assert f"ulysses_kernels at {repo / 'ulysses_kernels'}" in out, out
    r = run(["bash", "scripts/setup.sh"], repo, env=dict(offline, ULYSSES_KERNELS_PEERS="0"), timeout=600)
    assert "[setup] not installing deepspeed, accelerate, verl, torchtitan (ULYSSES_KERNELS_PEERS=0" in r.stdout and "skipping" not in r.stdout, r.stdout
    assert "ULYSSES_KERNELS_PEERS=0" in (repo / "build" / "setup_skipped_integrations.txt").read_text()


def test_summary_names_the_integrations_that_did_not_run(tmp_path):
    """A run whose integration tests skip says so in its last lines: which integrations,
    how many tests, and why (the set-up's note: no network, ULYSSES_KERNELS_PEERS=0)."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "build").mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    (tmp_path / "tests" / "test_fake.py").write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('i', range(2))\n"
        "def test_ds(i): pytest.skip('deepspeed is not installed (scripts/setup.sh installs it)')\n"
        "@pytest.mark.skipif(True, reason='verl is not installed (scripts/setup.sh installs it)')\n"
        "def test_verl(): pass\n"
        "def test_git(): pytest.skip('git is not installed')\n"
        "def test_runs(): pass\n"
    )
    (tmp_path / "build" / "setup_skipped_integrations.txt").write_text("deepspeed\tscripts/setup.sh could not download it (no network)\n")
    out = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], tmp_path, timeout=120).stdout
    tail = out[out.index("integrations not tested") :]
    assert "deepspeed: 2 tests skipped, not installed: scripts/setup.sh could not download it (no network)" in tail, out
    assert "verl: 1 test skipped, not installed: not in this environment" in tail, out
    assert "git" not in tail and "1 passed, 4 skipped" in tail, out
    # Nothing skipped for want of an integration: no such section.
    (tmp_path / "tests" / "test_fake.py").write_text("def test_runs(): pass\n")
    assert "integrations not tested" not in run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], tmp_path, timeout=120).stdout


# ---- without the extension: said at import and by info, with the command that builds it -------
def test_info_without_the_extension_says_how_to_build_it(tmp_path):
    site = tmp_path / "site"
    shutil.copytree(ROOT / "ulysses_kernels", site / "ulysses_kernels", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    code = f"import sys; sys.path[:0] = {[str(site), *SITE_DIRS]!r}; from ulysses_kernels import info; info.main([])"
    out = run([sys.executable, "-I", "-S", "-c", code], tmp_path).stdout
    ext = next(line for line in out.splitlines() if line.startswith("_C extension"))
    assert "NOT BUILT: ulysses_kernels._C is not built" in ext and "pip install --no-build-isolation" in ext, ext
    assert re.search(r"^\s+cuda\s+not here\s+.*not built", out, re.M), out


def test_rebuild_command_fits_the_installation():
    # This checkout (an in-place or editable build) is rebuilt in place.
    assert extension.rebuild_command("CUDA_HOME=/usr/local/cuda") == f"cd {ROOT} && CUDA_HOME=/usr/local/cuda python setup.py build_ext --inplace"


def test_missing_extension_warns_once_a_gpu_would_use_it(monkeypatch):
    real_import = extension.importlib.import_module

    def no_extension(name, *args):
        if name == "ulysses_kernels._C":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args)

    monkeypatch.setattr(extension.importlib, "import_module", no_extension)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("ULYSSES_KERNELS_SKIP_EXTENSION", raising=False)
    monkeypatch.setattr(extension, "_STATE", {})
    with pytest.warns(RuntimeWarning, match=r"ulysses_kernels._C is not built.*Build it: cd .* && python setup.py build_ext --inplace"):
        assert not extension.available()
    with pytest.raises(ImportError, match="is not built"):
        extension.load()  # the reason is kept; the warning came once
    monkeypatch.setattr(extension, "_STATE", {})
    monkeypatch.setenv("ULYSSES_KERNELS_SKIP_EXTENSION", "1")  # a pure-Python install on purpose: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not extension.available()


def test_an_extension_of_another_torch_says_how_to_rebuild(monkeypatch):
    real_import = extension.importlib.import_module

    def abi_mismatch(name, *args):
        if name == "ulysses_kernels._C":
            raise ImportError("ulysses_kernels/_C.so: undefined symbol: _ZN3c1017RegisterOperatorsD1Ev")
        return real_import(name, *args)

    monkeypatch.setattr(extension.importlib, "import_module", abi_mismatch)
    monkeypatch.setattr(extension, "_STATE", {})
    why = r"_C does not load here \(.*undefined symbol.*\); rebuild it against torch .*: cd .* && python setup.py build_ext --inplace"
    with pytest.raises(ImportError, match=why):
        extension.load()
    assert extension.build_info() == {"built": False, "error": extension._STATE["error"]}


# ---- a wheel, as pip builds it ----------------------------------------------------------------
def _cuda_toolkit():
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    return home if (Path(home) / "bin" / "nvcc").is_file() and torch.version.cuda else None


@pytest.mark.skipif(_cuda_toolkit() is None, reason="needs a CUDA toolkit and a CUDA build of torch to build the CUDA wheel")
def test_wheel_pins_its_torch_and_carries_no_build_path(tmp_path):
    """NOTE: about 70 s on 2 idle cores (one arch, MAX_JOBS=2); several minutes when the cores are shared."""
    src = tmp_path / "src"
    src.mkdir()
    _source_copy(src)
    env = user_env(ULYSSES_KERNELS_CUDA_ARCHS="9.0", MAX_JOBS="2", CUDA_HOME=_cuda_toolkit())
    run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w", tmp_path / "wheels", src], tmp_path, env=env, timeout=900)
    (wheel,) = (tmp_path / "wheels").glob("ulysses_kernels-*.whl")
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        (so,) = [n for n in z.namelist() if re.fullmatch(r"ulysses_kernels/_C[^/]*\.so", n)]
        z.extractall(tmp_path / "target")
    requires = [r for r in re.findall(r"^Requires-Dist: (.*)$", metadata, re.M) if "extra ==" not in r]
    assert requires == [f"torch=={importlib.metadata.version('torch')}", "numpy"], requires
    assert re.search(r"^License-Expression: Apache-2\.0$", metadata, re.M), metadata
    dyn = subprocess.run(["readelf", "-d", tmp_path / "target" / so], capture_output=True, text=True, check=True).stdout
    paths = re.findall(r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[(.*)\]", dyn)
    assert paths == ["$ORIGIN/../nvidia/nccl/lib"], dyn
    assert str(tmp_path) not in dyn and str(ROOT) not in dyn and sys.prefix not in dyn, dyn
    # The unpacked wheel (not a checkout, not site-packages) loads: NCCL is the one torch loaded.
    target = str(tmp_path / "target")
    code = (
        f"import sys; sys.path[:0] = {[target, *SITE_DIRS]!r}; "
        "from ulysses_kernels import extension; extension.load(); print(extension.__file__, extension.build_info()['nccl'])"
    )
    out = run([sys.executable, "-I", "-S", "-c", code], tmp_path).stdout.split()
    assert out == [str(tmp_path / "target" / "ulysses_kernels" / "extension.py"), "True"], out


# ---- the engine examples (FSDP2, DeepSpeed ZeRO-3), as their docs write them -------------------
ENGINE_EXAMPLES = [
    ("examples/train_fsdp2.py", "python examples/train_fsdp2.py --spawn 4 --sp-size 2", None),
    ("examples/deepspeed_zero3", "python examples/deepspeed_zero3/train.py --spawn 4 --sp-size 2", "deepspeed"),
]


@pytest.mark.parametrize(("path", "cmd", "needs"), ENGINE_EXAMPLES, ids=["fsdp2", "deepspeed_zero3"])
def test_engine_example_command(path, cmd, needs, tmp_path):
    if needs is not None and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} is not installed (scripts/setup.sh installs it)")
    docs = "".join((ROOT / name).read_text() for name in ("docs/scaling.md", "docs/usage.md", "README.md"))
    docs += (ROOT / path / "README.md").read_text() if (ROOT / path).is_dir() else (ROOT / path).read_text()
    assert cmd in " ".join(docs.split()), f"{cmd!r} is not documented as written"
    # A copy outside the checkout, run from its parent as the docs write it.
    (tmp_path / "examples").mkdir()
    src = ROOT / path
    if src.is_dir():
        shutil.copytree(src, tmp_path / path)
    else:
        shutil.copy(src, tmp_path / path)
    argv = shlex.split(cmd)
    argv[0] = sys.executable
    r = run(argv, tmp_path, timeout=600)
    assert "matches one process" in r.stdout, r.stdout  # step 0 against one process; the exit code checks the loss fell
    # Quiet: the peers' deprecation warnings (DeepSpeed's ZeRO-3 collectives: 68 lines before) filtered at the example's calls.
    assert "FutureWarning" not in r.stderr and "DeprecationWarning" not in r.stderr, r.stderr[-4000:]
    # Nothing but its steps: DeepSpeed's no-GPU warning, its shared-memory op's "built successfully" and torch's
    # "No CUDA runtime" were three lines per rank before (12 at 4 ranks), printed whether the op was built or not.
    noise = [line for line in (r.stdout + r.stderr).splitlines() if line.strip() and not line.startswith("step ")]
    assert not noise, "\n".join(noise[:20])
