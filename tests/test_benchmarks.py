"""Every script in benchmarks/ still imports. The suite does not run the benchmarks, so nothing else
notices when a module one imports moves: three had stopped starting (found on 2026-12-04)."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
RUN_AT_IMPORT = {"probe.py"}  # the script launcher_overhead.py launches: its body is the measurement

IMPORT_EACH = """
import importlib.util, sys, traceback
from pathlib import Path
sys.path.insert(0, sys.argv[1])
failed = 0
for path in sys.argv[2:]:
    name = "benchmark_" + Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        failed += 1
        print(f"{Path(path).name}: {traceback.format_exc(limit=-2)}")
sys.exit(failed)
"""


@pytest.mark.timeout(120)
def test_every_benchmark_imports(tmp_path: Path) -> None:
    # run as `python benchmarks/X.py` runs it: the folder on the path, the repository root not
    scripts = sorted(str(p) for p in BENCHMARKS.glob("*.py") if p.name not in RUN_AT_IMPORT)
    assert len(scripts) > 20
    done = subprocess.run([sys.executable, "-c", IMPORT_EACH, str(BENCHMARKS), *scripts],
                          capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
