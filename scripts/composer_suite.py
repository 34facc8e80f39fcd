"""How much of Composer 0.32.1's own test suite passes when every ``composer`` reads ``lockstep``.

    python scripts/composer_suite.py                       # both sides, then the report
    python scripts/composer_suite.py --side composer       # Composer once; its results are kept
    python scripts/composer_suite.py --side lockstep       # lockstep again, against the kept Composer results
    python scripts/composer_suite.py --side lockstep --files test_time.py trainer/test_trainer.py
    python scripts/composer_suite.py --report-only         # print the report of what is in --scratch

It needs a Composer venv (``bash scripts/composer_reference/setup.sh /tmp/composer-venv``, which also
installs what Composer's tests need there) and lockstep's ``.venv`` (``make setup``). Composer's tests are
never copied into this repository: ``git archive`` of ``--ref`` in ``--composer-git`` unpacks them under
``--scratch`` twice:

* ``SCRATCH/composer/tests``: as released, run with the Composer venv and its ``composer`` launcher;
* ``SCRATCH/lockstep/tests``: every file with the word ``composer`` (regex ``\\bcomposer\\b``, in text and
  in path names) replaced by ``lockstep``, run with lockstep's venv and its ``lockstep`` launcher.

Both trees get the same two patches, because this machine has no internet: ``tests/conftest.py`` no
longer builds the Hugging Face tokenizers in ``pytest_configure`` (that downloads them), and
``tests/fixtures/fixtures.py``'s ``download_tokenizers_files`` skips the test that asks for them. Each
root gets a ``pyproject.toml`` holding Composer's ``[tool.pytest.ini_options]`` without
``--codeblocks`` (a plugin the suite does not need; in the lockstep tree its filterwarnings read
``lockstep`` too).

Each file of ``DEFAULT_FILES`` is one single-process pytest run (``--jobs`` at a time, CPU only, Composer's
marker expression, ``-p no:cacheprovider``, ``--timeout`` when both venvs have pytest-timeout), and
``utils/test_dist.py`` runs again under each launcher with ``-n 2``. Runs start in ``SCRATCH/<side>``
(also on ``PYTHONPATH``, for tests that start ``python -c "from tests..."``) with ``OMP_NUM_THREADS=1``,
Hugging Face offline and no inherited rank variables. Every run writes a junit xml under
``SCRATCH/<side>/results``. A test counts when it passed on Composer; the report gives, per file, how many
of those pass on lockstep, and ``SCRATCH/report.json`` holds every test's two outcomes and, for lockstep
failures, the first line of the error, so that failures group by cause.

Placeholders (lockstep side, on unless ``--no-placeholders``): a missing name kills a whole file at
collection. This file is also the pytest plugin that every run loads (``-p composer_suite``); on the
lockstep side it replaces ``builtins.__import__`` so that, for an import written in the test tree,
``from lockstep.x import Name`` with ``Name`` missing (or refused with an ImportError, as lockstep does for
Composer's algorithms), or a missing ``lockstep.x`` module, yields a placeholder: a class whose call raises
``ImportError('placeholder: lockstep.x.Name missing (why)')``. Only names under ``lockstep`` are replaced;
a missing third-party package stays a real error. Each placeholder made is logged to
``results/<run>.placeholders.txt``. A filterwarnings entry whose ``lockstep`` warning category does not
import is left out of the lockstep config (pytest refuses to start on it, and lockstep cannot emit a
warning it lacks); the report lists those with the placeholders.

Counting rule: a test whose first lockstep failure is a private name (a dotted part with a leading
underscore) or a patch (monkeypatch, mock.patch) of a lockstep module that has no such attribute is
flagged and shown apart; the adjusted percentage leaves the flagged tests out.

Test-only packages that Composer's helpers import at module level (torchvision, coolname) are not
lockstep dependencies; where lockstep's venv lacks one, the lockstep runs borrow the Composer venv's copy
(same Python, same torch) through ``PYTHONPATH`` rather than installing into the shared ``.venv``.
"""

from __future__ import annotations

import argparse
import builtins
import concurrent.futures
import dataclasses
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
import types
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parent.parent
DEFAULT_GIT = Path("/work/.mirror/mosaicml+composer/repo")
DEFAULT_REF = "v0.32.1"
DEFAULT_SCRATCH = Path("/tmp/composer-suite")
DEFAULT_COMPOSER_VENV = Path(os.environ.get("COMPOSER_VENV", "/tmp/composer-venv"))
DEFAULT_LOCKSTEP_VENV = REPO / ".venv"

DEFAULT_FILES = (
    "test_time.py", "test_events.py", "test_state.py", "test_engine.py", "test_precision.py",
    "optim/test_scheduler.py", "trainer/test_trainer.py", "trainer/test_checkpoint.py",
    "trainer/test_ddp.py", "trainer/test_fsdp.py", "trainer/test_fsdp_checkpoint.py",
    "callbacks/test_callbacks.py", "callbacks/test_checkpoint_saver.py",
    "callbacks/test_load_checkpoint.py", "loggers/test_in_memory_logger.py", "loggers/test_logger.py",
    "loggers/test_file_logger.py", "checkpoint/test_save.py", "checkpoint/test_load.py",
    "checkpoint/test_state_dict.py", "utils/test_dist.py",
)  # fmt: skip
TWO_PROCESS_FILES = ("utils/test_dist.py",)
MARKERS = "not gpu and not doctest and not daily and not remote"
# Packages Composer's test helpers import at module level that lockstep itself does not need.
BORROWED = ("torchvision", "coolname")
WORD = re.compile(r"\bcomposer\b")

# Set by the harness for the pytest processes that load this file as a plugin.
ENV_PLACEHOLDER_LOG = "COMPOSER_SUITE_PLACEHOLDER_LOG"
ENV_TESTS_DIR = "COMPOSER_SUITE_TESTS_DIR"
DROPPED_FILTERS = "dropped-filterwarnings.txt"  # in SCRATCH/lockstep

# (file, text that must occur exactly once, replacement): the same on both sides, before renaming.
NETWORK_PATCHES = (
    (
        "conftest.py",
        "TRANSFORMERS_INSTALLED = True",
        "TRANSFORMERS_INSTALLED = False  # composer_suite: no network for the tokenizers",
    ),
    (
        "fixtures/fixtures.py",
        "def download_tokenizers_files():\n",
        "def download_tokenizers_files():\n"
        "    pytest.skip('composer_suite: no network for the tokenizer download')\n",
    ),
)


def rename(text: str) -> str:
    return WORD.sub("lockstep", text)


@dataclasses.dataclass(frozen=True, slots=True)
class Side:
    name: str  # "composer" or "lockstep"
    root: Path  # SCRATCH/<name>; pytest runs here so that `tests.` imports resolve
    venv: Path
    placeholders: bool

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def launcher(self) -> Path:
        return self.venv / "bin" / self.name

    @property
    def results(self) -> Path:
        return self.root / "results"

    @property
    def harness(self) -> Path:
        return self.root / ".harness"


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    file: str  # relative to tests/
    world_size: int

    @property
    def key(self) -> str:
        stem = self.file.removesuffix(".py").replace("/", "__")
        return stem if self.world_size == 1 else f"{stem}.ws{self.world_size}"

    @property
    def label(self) -> str:
        return self.file if self.world_size == 1 else f"{self.file} ({self.world_size} processes)"


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    outcome: str  # passed, failed, error, skipped, not-run
    message: str  # first line of the failure, error or skip message
    text: str  # the traceback pytest wrote


# --------------------------------------------------------------------------- preparing the trees


def prepare_tree(side: Side, git_dir: Path, ref: str, composer_venv: Path) -> None:
    tests = side.root / "tests"
    shutil.rmtree(tests, ignore_errors=True)
    side.root.mkdir(parents=True, exist_ok=True)
    archive = _git(git_dir, "archive", ref, "tests")
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
        tar.extractall(side.root, filter="data")
    for relative, old, new in NETWORK_PATCHES:
        path = tests / relative
        text = path.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"{path}: expected one {old!r} to patch; has {ref} changed?")
        path.write_text(text.replace(old, new))
    if side.name == "lockstep":
        rename_tree(tests)
    write_pytest_config(side, _git(git_dir, "show", f"{ref}:pyproject.toml").decode())
    prepare_harness(side, composer_venv)


def _git(git_dir: Path, *args: str) -> bytes:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True).stdout


def rename_tree(tests: Path) -> None:
    for path in sorted(tests.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_file():
            try:
                path.write_text(rename(path.read_text(encoding="utf-8")), encoding="utf-8")
            except UnicodeDecodeError:
                pass  # binary
        if WORD.search(path.name):
            path.rename(path.with_name(rename(path.name)))


def write_pytest_config(side: Side, pyproject: str) -> None:
    options = tomllib.loads(pyproject)["tool"]["pytest"]["ini_options"]
    options["addopts"] = " ".join(options["addopts"].replace("--codeblocks", "").split())
    if side.name == "lockstep":
        renamed = [rename(entry) for entry in options["filterwarnings"]]
        missing = _missing_categories(side.python, renamed)
        options["filterwarnings"] = [entry for entry in renamed if _category(entry) not in missing]
        (side.root / DROPPED_FILTERS).write_text("".join(f"{name}\n" for name in missing))
    lines = ["# Written by scripts/composer_suite.py from Composer's.", "[tool.pytest.ini_options]"]
    for key, value in options.items():
        if isinstance(value, list):
            lines.append(f"{key} = [")
            lines.extend(f"    {json.dumps(entry)}," for entry in value)
            lines.append("]")
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    (side.root / "pyproject.toml").write_text("\n".join(lines) + "\n")


def _category(entry: str) -> str:
    parts = entry.split(":")
    return parts[2] if len(parts) > 2 else ""


def _missing_categories(python: Path, entries: list[str]) -> list[str]:
    """The lockstep warning categories in `entries` that do not import: pytest refuses to start on one.

    lockstep cannot emit a warning class it does not have, so leaving such a filter out changes nothing;
    the report lists them with the placeholders.
    """
    categories = sorted({c for c in map(_category, entries) if c.startswith("lockstep.")})
    probe = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    module, _, attr = name.rpartition('.')\n"
        "    try:\n"
        "        getattr(importlib.import_module(module), attr)\n"
        "    except (ImportError, AttributeError):\n"
        "        print(name)\n"
    )
    done = subprocess.run([python, "-c", probe, *categories], check=True, capture_output=True, text=True)
    return done.stdout.split()


def prepare_harness(side: Side, composer_venv: Path) -> None:
    """SIDE/.harness: this file (the pytest plugin) and, on the lockstep side, borrowed packages."""
    shutil.rmtree(side.harness, ignore_errors=True)
    side.harness.mkdir(parents=True)
    (side.harness / "composer_suite.py").symlink_to(Path(__file__).resolve())
    if side.name != "lockstep":
        return
    for package in BORROWED:
        if _importable(side.python, package):
            continue
        found = _package_paths(composer_venv / "bin" / "python", package)
        if not found:
            raise SystemExit(f"{package} is in neither venv; the Composer venv's setup.sh installs it")
        for path in found:
            (side.harness / path.name).symlink_to(path)


def _importable(python: Path, module: str) -> bool:
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def _package_paths(python: Path, package: str) -> list[Path]:
    probe = (
        "import importlib.util, pathlib, sys\n"
        f"spec = importlib.util.find_spec({package!r})\n"
        "if spec is None: sys.exit(1)\n"
        "path = pathlib.Path(list(spec.submodule_search_locations or [spec.origin])[0])\n"
        f"print(path); print(*path.parent.glob({package + '.libs'!r}), sep='\\n')\n"
    )
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    return [Path(line) for line in done.stdout.split()] if done.returncode == 0 else []


# --------------------------------------------------------------------------- running


@dataclasses.dataclass(frozen=True, slots=True)
class RunOptions:
    test_timeout: int | None  # pytest-timeout's --timeout; None without the plugin
    file_timeout: int


def run_side(side: Side, jobs: list[Job], options: RunOptions, parallel: int) -> float:
    side.results.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    single = sorted((j for j in jobs if j.world_size == 1), key=lambda j: -_expected_seconds(side, j))
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        running = {pool.submit(run_job, side, job, options): job for job in single}
        for future in concurrent.futures.as_completed(running):
            _progress(side, running[future], *future.result())
    for job in (j for j in jobs if j.world_size > 1):  # alone: its ranks need both cores
        _progress(side, job, *run_job(side, job, options))
    seconds = time.monotonic() - start
    summary = {"seconds": seconds, "runs": [j.key for j in jobs], "lockstep": _lockstep_version()}
    (side.results / "side.json").write_text(json.dumps(summary))
    return seconds


def _lockstep_version() -> str:
    """The checkout's commit, `-dirty` when src/ has changes (other work may be under way in it)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()

    dirty = "-dirty" if git("status", "--porcelain", "--", "src") else ""
    return (git("rev-parse", "--short", "HEAD") or "unknown") + dirty


def _progress(side: Side, job: Job, seconds: float, code: int) -> None:
    print(f"  [{side.name}] {job.label}: exit {code} in {seconds:.0f}s", flush=True)


def _expected_seconds(side: Side, job: Job) -> float:
    """Longest first, so the last file to finish is a short one: last time's duration, else file size."""
    for root in (side.root, side.root.parent / "composer"):
        meta = root / "results" / f"{job.key}.json"
        if meta.exists():
            return float(json.loads(meta.read_text())["seconds"])
    return (side.root / "tests" / job.file).stat().st_size / 100


def run_job(side: Side, job: Job, options: RunOptions) -> tuple[float, int]:
    for stale in side.results.glob(f"{job.key}.*"):
        if stale.is_file():
            stale.unlink()
    xml = side.results / (f"{job.key}.xml" if job.world_size == 1 else f"{job.key}.rank{{rank}}.xml")
    pytest_args = [
        f"tests/{job.file}", "-p", "composer_suite", "-p", "no:cacheprovider", "-m", MARKERS,
        "--color=no", "-v", "-rfE", "--durations=10", f"--junitxml={xml}", "-o", "junit_family=xunit2",
        "--continue-on-collection-errors",
    ]  # fmt: skip
    if options.test_timeout:
        pytest_args.append(f"--timeout={options.test_timeout}")
    if job.world_size == 1:
        argv = [str(side.python), "-m", "pytest", *pytest_args]
    else:
        logs = side.results / f"{job.key}.rank{{rank}}"
        argv = [str(side.launcher), "-n", str(job.world_size)]
        argv += ["--stdout", f"{logs}.stdout.log", "--stderr", f"{logs}.stderr.log"]
        if side.name == "lockstep":
            argv += ["--run_directory", str(side.results / f"{job.key}.run")]
        argv += ["-m", "pytest", *pytest_args]
    start = time.monotonic()
    with open(side.results / f"{job.key}.log", "w") as log:
        env = _environment(side, job)
        process = subprocess.Popen(
            argv, cwd=side.root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = process.wait(timeout=options.file_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the session this run started, nothing else
            code = process.wait()
            log.write(f"\ncomposer_suite: killed after --file-timeout {options.file_timeout}s\n")
    seconds = time.monotonic() - start
    meta = {"argv": argv, "cwd": str(side.root), "seconds": seconds, "returncode": code}
    (side.results / f"{job.key}.json").write_text(json.dumps(meta, indent=1))
    return seconds, code


def _environment(side: Side, job: Job) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _UNSET and not k.startswith("COMPOSER_SUITE_")}
    env.update(
        PATH=f"{side.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=str(side.venv),
        # the root too: tests that start `python -c "from tests.common import ..."` run it in tmp_path
        PYTHONPATH=os.pathsep.join((str(side.harness), str(side.root))),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    if side.placeholders:
        env[ENV_PLACEHOLDER_LOG] = str(side.results / f"{job.key}.placeholders.txt")
        env[ENV_TESTS_DIR] = str((side.root / "tests").resolve())
    return env


# A run must not inherit a rank from whoever started the harness; WORLD_SIZE picks the tests collected.
_UNSET = frozenset(
    {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"}
)


# --------------------------------------------------------------------------- reading results


def read_job(side: Side, job: Job) -> tuple[dict[str, Case], str | None]:
    """Every test of one run by id (in lockstep's spelling), and the run's collection error, if any."""
    pattern = f"{job.key}.xml" if job.world_size == 1 else f"{job.key}.rank*.xml"
    paths = sorted(side.results.glob(pattern))
    meta = side.results / f"{job.key}.json"
    if not meta.exists():
        return {}, f"not run on the {side.name} side"
    if not paths:
        code = json.loads(meta.read_text())["returncode"]
        return {}, f"no junit xml (exit code {code}; see {side.name}/results/{job.key}.log)"
    cases: dict[str, Case] = {}
    collection_error = None
    for path in paths:  # with several ranks, a test passes only where it passed on all of them
        rank_cases, rank_error = _read_junit(path)
        collection_error = collection_error or rank_error
        for test_id, case in rank_cases.items():
            if test_id not in cases or cases[test_id].outcome == "passed":
                cases[test_id] = case
    return cases, collection_error


def _read_junit(path: Path) -> tuple[dict[str, Case], str | None]:
    cases: dict[str, Case] = {}
    collection_error = None
    for element in ElementTree.parse(path).getroot().iter("testcase"):
        test_id = rename(f"{element.get('classname')}::{element.get('name')}")
        case = Case("passed", "", "")
        for child in element:  # a teardown error follows a failure; the first one is the cause
            if child.tag in ("failure", "error", "skipped") and case.outcome == "passed":
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                case = Case(outcome, _first_line(child.get("message") or ""), child.text or "")
        if case.outcome == "error" and case.message.startswith("collection failure"):
            collection_error = _last_error_line(case.text) or "collection failure"
            continue
        cases[test_id] = case
    return cases, collection_error


def _first_line(message: str) -> str:
    wrapped = re.match(r'failed on (setup|teardown) with "(.*)"\s*$', message, re.DOTALL)
    if wrapped:
        message = f"[{wrapped.group(1)}] {wrapped.group(2)}"
    return message.strip().split("\n", 1)[0].strip()


def _last_error_line(text: str) -> str:
    lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    exceptions = [line for line in lines if re.match(r"\w+(\.\w+)*(Error|Exception|Warning)\b", line)]
    return (exceptions or lines or [""])[0]


def normalize_cause(line: str) -> str:
    line = re.sub(r"(?<=[\s'\"(])/[\w.\-/]+", "<path>", line)
    line = re.sub(r"0x[0-9a-fA-F]+", "0x?", line)
    line = re.sub(r"(?<![\w.])-?\d+(\.\d+)?(e[-+]?\d+)?", "N", line)  # '1ep' -> 'Nep'; not 'fp32' 
    return line[:180]


_PRIVATE = re.compile(
    r"placeholder: lockstep(\.\w+)*\._\w*"
    r"|cannot import name '_\w*'"
    r"|has no attribute '_\w*'"
    r"|No module named 'lockstep(\.\w+)*\._\w*"
)
_PATCH_LINE = re.compile(r"^>.*(monkeypatch\.(setattr|delattr)|mock\.patch|\bpatch(\.object)?\()", re.M)


def flag(case: Case) -> str | None:
    """'private' or 'internal-patch' where the first failure is one the counting rule leaves out."""
    if case.outcome not in ("failed", "error", "not-run"):
        return None
    if _PRIVATE.search(case.message):
        return "private"
    patched = _PATCH_LINE.search(case.text) or "unittest/mock.py" in case.text
    if patched and re.search(r"(AttributeError|ModuleNotFoundError|ImportError).*lockstep", case.message):
        return "internal-patch"
    return None


# --------------------------------------------------------------------------- the report


@dataclasses.dataclass(slots=True)
class Row:
    label: str
    composer_seconds: float | None = None
    lockstep_seconds: float | None = None
    collected: int = 0  # on Composer, world size filter applied
    counted: int = 0
    passing: int = 0
    flagged: int = 0

    def add(self, other: Row) -> None:
        self.collected += other.collected
        self.counted += other.counted
        self.passing += other.passing
        self.flagged += other.flagged
        self.composer_seconds = _add(self.composer_seconds, other.composer_seconds)
        self.lockstep_seconds = _add(self.lockstep_seconds, other.lockstep_seconds)


def _add(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else a + b


def build_report(composer: Side, lockstep: Side, jobs: list[Job]) -> dict[str, Any]:
    rows: list[Row] = []
    tests: dict[str, dict[str, Any]] = {}
    for job in jobs:
        row = Row(job.label, _seconds(composer, job), _seconds(lockstep, job))
        reference, _ = read_job(composer, job)
        ours, collection_error = read_job(lockstep, job)
        pairs = pair_ids(list(reference), list(ours))
        for test_id, before in reference.items():
            our_id = pairs.get(test_id, "")
            after = ours.get(our_id) or Case("not-run", collection_error or "not collected on lockstep", "")
            entry: dict[str, Any] = {"file": job.label, "composer": before.outcome, "lockstep": after.outcome}
            if our_id and our_id != test_id:
                entry["lockstep_id"] = our_id
            if after.outcome != "passed":
                entry["error"] = after.message
            row.collected += 1
            if before.outcome == "passed":
                row.counted += 1
                row.passing += after.outcome == "passed"
                entry["flag"] = flag(after)
                row.flagged += entry["flag"] is not None
            tests[f"{job.key}::{test_id}"] = entry
        rows.append(row)
    side_seconds = {s.name: _side_summary(s).get("seconds") for s in (composer, lockstep)}
    version = _side_summary(lockstep).get("lockstep", "not run")
    placeholders = _placeholders(lockstep, jobs)
    report = {"rows": rows, "tests": tests, "placeholders": placeholders, "side_seconds": side_seconds}
    return {**report, "lockstep_version": version}


def _side_summary(side: Side) -> dict[str, Any]:
    path = side.results / "side.json"
    return json.loads(path.read_text()) if path.exists() else {}


def pair_ids(reference: list[str], ours: list[str]) -> dict[str, str]:
    """Composer's test ids (renamed) -> lockstep's.

    pytest names a parameter that is an object from its repr or str (`Event.INIT` on one side, `init` on
    the other), so the cases of a parametrized test pair by position where both sides collected as many,
    and by equal id otherwise.
    """
    ours_by_test: dict[str, list[str]] = {}
    for test_id in ours:
        ours_by_test.setdefault(test_id.split("[", 1)[0], []).append(test_id)
    reference_by_test: dict[str, list[str]] = {}
    for test_id in reference:
        reference_by_test.setdefault(test_id.split("[", 1)[0], []).append(test_id)
    known = set(ours)
    pairs: dict[str, str] = {}
    for test, ids in reference_by_test.items():
        candidates = ours_by_test.get(test, [])
        if len(candidates) == len(ids):
            pairs.update(zip(ids, candidates))
        else:
            pairs.update((test_id, test_id) for test_id in ids if test_id in known)
    return pairs


def _seconds(side: Side, job: Job) -> float | None:
    meta = side.results / f"{job.key}.json"
    return float(json.loads(meta.read_text())["seconds"]) if meta.exists() else None


def _placeholders(side: Side, jobs: list[Job]) -> dict[str, list[str]]:
    """Each placeholder name and the runs that made it."""
    made: dict[str, set[str]] = {}
    for job in jobs:
        log = side.results / f"{job.key}.placeholders.txt"
        for line in log.read_text().splitlines() if log.exists() else []:
            made.setdefault(line.split("\t")[0], set()).add(job.label)
    dropped = side.root / DROPPED_FILTERS
    for name in dropped.read_text().split() if dropped.exists() else []:
        made.setdefault(name, set()).add("filterwarnings (entry left out)")
    return {name: sorted(labels) for name, labels in sorted(made.items())}


def print_report(report: dict[str, Any], scratch: Path, top: int) -> None:
    rows: list[Row] = report["rows"]
    single = [r for r in rows if not r.label.endswith("processes)")]
    total = Row("total, single process (seconds summed)")
    for row in single:
        total.add(row)
    width = max(len(r.label) for r in [*rows, total]) + 2
    header = ("composer", "counted", "pass", "%", "flagged", "adj %", "composer s", "lockstep s")
    widths = [max(len(h), 6) + 2 for h in header]
    print("\n" + "file".ljust(width) + "".join(f"{h:>{w}}" for h, w in zip(header, widths)))
    for row in [*single, total, *(r for r in rows if r not in single)]:
        if row is total:
            print("-" * (width + sum(widths)))
        cells = (row.collected, row.counted, row.passing, _percent(row.passing, row.counted), row.flagged,
                 _percent(row.passing, row.counted - row.flagged),
                 _format_seconds(row.composer_seconds), _format_seconds(row.lockstep_seconds))  # fmt: skip
        print(row.label.ljust(width) + "".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    print("composer: tests Composer ran; counted: those it passed; pass: those lockstep passes too;")
    print("flagged: counted tests whose first lockstep failure is a private name or patches lockstep;")
    print("adj %: pass / (counted - flagged); seconds: each file's pytest run")
    causes = Counter(
        (normalize_cause(t["error"]), t["flag"]) for t in report["tests"].values()
        if t["composer"] == "passed" and t["lockstep"] != "passed"
    )  # fmt: skip
    print(f"\ntop {top} causes of counted tests failing on lockstep (normalized first error line):")
    for (cause, flagged), count in causes.most_common(top):
        print(f"{count:>6}  {cause}" + (f"  [{flagged}]" if flagged else ""))
    for side, seconds in report["side_seconds"].items():
        print(f"{side} side: {_format_seconds(seconds)}s wall for its last run")
    print(f"lockstep as run: {report['lockstep_version']}")
    print(f"{len(report['placeholders'])} placeholders made; report: {scratch / 'report.json'}")


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}" if whole else "-"


def _format_seconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.0f}"


def write_report(report: dict[str, Any], path: Path, meta: dict[str, Any]) -> None:
    rows = [dataclasses.asdict(r) for r in report["rows"]]
    content = {**meta, "lockstep": report["lockstep_version"], "side_seconds": report["side_seconds"]}
    content.update(files=rows)
    content.update(placeholders=report["placeholders"], tests=report["tests"])
    path.write_text(json.dumps(content, indent=1))


# --------------------------------------------------------------------------- the command line


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    scratch = args.scratch.resolve()
    composer = Side("composer", scratch / "composer", args.composer_venv, placeholders=False)
    lockstep = Side("lockstep", scratch / "lockstep", args.lockstep_venv, not args.no_placeholders)
    jobs = [Job(f, 1) for f in args.files] + [Job(f, 2) for f in args.files if f in TWO_PROCESS_FILES]
    if not args.report_only:
        _check_venvs(composer, lockstep)
        timeout_plugin = all(_importable(s.python, "pytest_timeout") for s in (composer, lockstep))
        options = RunOptions(args.timeout if timeout_plugin else None, args.file_timeout)
        composer_jobs = jobs if args.side in ("composer", "both") else [
            j for j in jobs if not (composer.results / f"{j.key}.json").exists()
        ]  # fmt: skip
        lockstep_jobs = jobs if args.side != "composer" else []
        for side, side_jobs in ((composer, composer_jobs), (lockstep, lockstep_jobs)):
            if not side_jobs:
                continue
            print(f"{side.name}: preparing {side.root}", flush=True)
            prepare_tree(side, args.composer_git, args.ref, args.composer_venv)
            print(f"{side.name}: {len(side_jobs)} runs, {args.jobs} at a time", flush=True)
            seconds = run_side(side, side_jobs, options, args.jobs)
            print(f"{side.name}: done in {seconds:.0f}s", flush=True)
    report = build_report(composer, lockstep, jobs)
    write_report(report, scratch / "report.json", {"ref": args.ref})
    print_report(report, scratch, args.top)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    side_help = "which side to run; lockstep alone reuses kept Composer results (and runs any missing)"
    parser.add_argument("--side", choices=("composer", "lockstep", "both"), default="both", help=side_help)
    parser.add_argument("--files", nargs="+", default=list(DEFAULT_FILES), help="files, relative to tests/")
    parser.add_argument("--jobs", type=int, default=2, help="pytest runs at a time (default 2)")
    parser.add_argument("--composer-git", type=Path, default=DEFAULT_GIT, help="Composer's git directory")
    parser.add_argument("--ref", default=DEFAULT_REF, help="the Composer tag whose tests run")
    parser.add_argument("--scratch", type=Path, default=DEFAULT_SCRATCH, help="for the trees and results")
    parser.add_argument("--composer-venv", type=Path, default=DEFAULT_COMPOSER_VENV)
    parser.add_argument("--lockstep-venv", type=Path, default=DEFAULT_LOCKSTEP_VENV)
    parser.add_argument("--no-placeholders", action="store_true", help="missing lockstep names fail a file")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test (pytest-timeout)")
    parser.add_argument("--file-timeout", type=int, default=3 * 3600, help="seconds before a run is killed")
    parser.add_argument("--top", type=int, default=30, help="how many causes to print")
    parser.add_argument("--report-only", action="store_true", help="run nothing; report what --scratch holds")
    return parser.parse_args(argv)


def _check_venvs(*sides: Side) -> None:
    for side in sides:
        if not side.python.exists() or not _importable(side.python, "pytest"):
            hint = "bash scripts/composer_reference/setup.sh" if side.name == "composer" else "make setup"
            raise SystemExit(f"{side.venv}: no python with pytest; run `{hint}`")


# --------------------------------------------------------------------------- the pytest plugin
# Every run loads this file with `-p composer_suite`; nothing below runs in the harness itself.


def pytest_configure(config: Any) -> None:
    """Under a launcher, each rank writes its own junit xml (the path holds `{rank}`).

    Plugins named with -p register after pytest's own, so this runs before junitxml reads the path.
    """
    xmlpath = getattr(config.option, "xmlpath", None)
    if xmlpath and "{rank}" in xmlpath:
        config.option.xmlpath = xmlpath.replace("{rank}", os.environ.get("RANK", "0"))


class _PlaceholderMeta(type):
    """Calling a placeholder raises; its public attributes are placeholders too (`TimeUnit.EPOCH`)."""

    _placeholder_name: str
    _placeholder_message: str

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise ImportError(cls._placeholder_message)

    def __getattr__(cls, attr: str) -> Any:
        if attr.startswith("_") or attr.startswith("pytest"):
            raise AttributeError(attr)
        return _placeholder_class(f"{cls._placeholder_name}.{attr}", record=False)


class _PlaceholderModule(types.ModuleType):
    """A missing lockstep module: its public names are placeholders."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_") or attr.startswith("pytest"):
            raise AttributeError(attr)
        return _placeholder_class(f"{self.__name__}.{attr}")


class _ModuleProxy:
    """What `from module import a, b` sees when `module` lacks some of the names."""

    def __init__(self, module: types.ModuleType, stubs: dict[str, type]) -> None:
        self._composer_suite_module = module
        self._composer_suite_stubs = stubs

    def __getattr__(self, attr: str) -> Any:
        if attr in self._composer_suite_stubs:
            return self._composer_suite_stubs[attr]
        return getattr(self._composer_suite_module, attr)


_made: dict[str, type] = {}


def _record(name: str, importer: str = "") -> None:
    with open(os.environ[ENV_PLACEHOLDER_LOG], "a") as log:
        log.write(f"{name}\t{importer}\n")


def _placeholder_class(name: str, importer: str = "", record: bool = True, reason: str = "") -> type:
    """A class that raises ImportError('placeholder: NAME missing') when called; `reason` adds why."""
    if name not in _made:
        short = name.rsplit(".", 1)[-1]
        bases: tuple[type, ...] = (Warning,) if short.endswith("Warning") else ()
        bases = bases or ((Exception,) if short.endswith(("Error", "Exception")) else ())
        message = f"placeholder: {name} missing" + (f" ({reason})" if reason else "")
        namespace = {"_placeholder_message": message, "_placeholder_name": name}
        namespace["__module__"] = name.rpartition(".")[0]
        _made[name] = _PlaceholderMeta(short, bases, namespace)
        if record:
            _record(name, importer)
    return _made[name]


def _is_lockstep(name: str) -> bool:
    return name == "lockstep" or name.startswith("lockstep.")


def _placeholder_modules(name: str, importer: str) -> None:
    """Import each prefix of `name`, making a placeholder module for each one that is missing."""
    parts = name.split(".")
    for end in range(1, len(parts) + 1):
        prefix = ".".join(parts[:end])
        if prefix in sys.modules:
            continue
        try:
            _real_import(prefix)
        except ModuleNotFoundError as error:
            if error.name != prefix:
                raise
            module = _PlaceholderModule(prefix)
            sys.modules[prefix] = module
            if end > 1:
                setattr(sys.modules[".".join(parts[: end - 1])], parts[end - 1], module)
            _record(prefix, importer)


_test_files: dict[str, bool] = {}


def _from_tests(globals_: dict[str, Any] | None) -> str:
    """The importing file when it is in the test tree, else ''."""
    filename = (globals_ or {}).get("__file__") or ""
    if filename not in _test_files:
        _test_files[filename] = os.path.realpath(filename).startswith(os.environ[ENV_TESTS_DIR] + os.sep)
    return filename if _test_files[filename] else ""


def _placeholder_import(
    name: str,
    globals: dict[str, Any] | None = None,
    locals: dict[str, Any] | None = None,
    fromlist: Iterable[str] | None = (),
    level: int = 0,
) -> Any:
    importer = _from_tests(globals) if level == 0 and _is_lockstep(name) else ""
    if not importer:
        return _real_import(name, globals, locals, fromlist, level)
    try:
        module = _real_import(name, globals, locals, fromlist, level)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if not (_is_lockstep(missing) and (name == missing or name.startswith(missing + "."))):
            raise
        _placeholder_modules(name, importer)
        module = sys.modules[name] if fromlist else sys.modules[name.partition(".")[0]]
    except ImportError:  # a name of the fromlist raised it (lockstep refuses some of Composer's names)
        if not fromlist or name not in sys.modules:
            raise
        module = sys.modules[name]
    if not fromlist:
        return module
    stubs: dict[str, type] = {}
    for attr in fromlist:
        reason = None if attr == "*" else _why_missing(module, attr)
        if reason is not None:
            stubs[attr] = _placeholder_class(f"{module.__name__}.{attr}", importer, reason=reason)
    return _ModuleProxy(module, stubs) if stubs else module


def _why_missing(module: types.ModuleType, attr: str) -> str | None:
    """None where `module` has `attr` (or a submodule of that name), else the ImportError's words, or ''."""
    try:
        getattr(module, attr)
        return None
    except AttributeError:
        reason = ""
    except ImportError as error:
        if isinstance(error, ModuleNotFoundError) and not _is_lockstep(error.name or ""):
            raise  # a package lockstep needs is not installed: that error stays real
        reason = str(error).split("\n", 1)[0]
    submodule = f"{module.__name__}.{attr}"
    if hasattr(module, "__path__") and not isinstance(module, _PlaceholderModule):
        try:  # a fromlist that raised early leaves later submodules unimported
            _real_import(submodule)
            return None
        except ModuleNotFoundError as error:
            if error.name != submodule:
                raise
    return reason


_real_import = builtins.__import__
if os.environ.get(ENV_PLACEHOLDER_LOG) and __name__ != "__main__":
    builtins.__import__ = _placeholder_import


if __name__ == "__main__":
    sys.exit(main())
