#!/usr/bin/env bash
# A virtual environment that runs MosaicML Composer 0.32.1 itself on lockstep's torch, so that
# fixtures can be made from the numbers Composer produces. Composer pins torch < 2.7.1; we install
# it without its dependencies beside torch 2.13.0 (CPU) and add only what `import composer`,
# `composer.optim` and `composer.trainer` need.
#
#   bash scripts/composer_reference/setup.sh [VENV]     # VENV defaults to $COMPOSER_VENV or /tmp/composer-venv
#
# Safe to run again: pip skips what is installed, and the torchvision patch applies once.
# pip's note that mosaicml 0.32.1 wants torch < 2.7.1 and torchvision < 0.22.1 is expected.
# The last line printed is the venv's path.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-${COMPOSER_VENV:-/tmp/composer-venv}}"
PY="${PYTHON:-python3}"
# Every pip call stays on the CPU build of torch: any other torch pulls gigabytes of CUDA wheels.
export PIP_CONSTRAINT="$REPO/constraints.txt"

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_install() { "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@"; }

pip_install "torch==2.13.0"
# --no-deps: each of these asks for another torch. (Composer also declares torch-optimizer, which
# nothing in it imports.)
pip_install --no-deps "mosaicml==0.32.1" "torchvision==0.28.*" "torchmetrics>=1.0,<1.7.5" "lightning-utilities"
# Pure-Python dependencies, in the ranges Composer 0.32.1 declares; mosaicml-cli (imported by
# Composer's MosaicMLLogger) brings its own (gql, rich, backoff, ...), none of which needs torch.
pip_install "mosaicml-cli>=0.5.25,<0.8" "numpy>=1.21.5,<2.3.0" "pyyaml>=6.0,<7" "tqdm>=4.62.3,<5" "psutil>=5.8.0,<8" \
    "coolname>=1.1.0,<3" "tabulate==0.9.0" "py-cpuinfo>=8.0.0,<10" "packaging>=21.3.0,<25.1" \
    "importlib-metadata>=5.0.0,<9" "pillow>=10.3.0,<12" "requests>=2.26.0,<3" "typing-extensions"

# Composer's own tests (scripts/composer_suite.py): pytest, and mlflow in Composer's range, since an
# autouse fixture of theirs skips every test where mlflow does not import; boto3, which
# test_checkpoint.py needs at collection; pandas, for the loggers' log_table.
pip_install "pytest>=8" "pytest-timeout>=2.1" "mlflow-skinny>=2.14.1,<3.0" "boto3>=1.21.45,<2" \
    "pandas>=2.0.0,<3.0"

# torchvision 0.28's only wheel is a CUDA build whose C++ ops do not load against CPU torch; it then
# registers fake kernels for ops that were never defined, which fails at import. Register those two
# only when the ops exist.
"$VENV/bin/python" - <<'PYEOF'
import pathlib
import sysconfig

meta = pathlib.Path(sysconfig.get_paths()["purelib"]) / "torchvision" / "_meta_registrations.py"
text = meta.read_text()
for op in ("nms", "qnms"):
    old = f'@torch.library.register_fake("torchvision::{op}")'
    new = f'@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() else (lambda f: f))'
    if old + "\n" in text:
        text = text.replace(old + "\n", new + "\n")
meta.write_text(text)
PYEOF

"$VENV/bin/python" -c "import composer; from composer.optim import DecoupledAdamW; from composer import Trainer" \
    || { echo "setup.sh: Composer does not import in $VENV (see the error above)" >&2; exit 1; }
echo "$VENV"
