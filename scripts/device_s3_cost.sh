#!/usr/bin/env bash
# On a device machine (16 cores: the SeaweedFS server and the uploads get cores training does not
# use): the S3 checkpoint cost benchmark, from src/ on PYTHONPATH and what
# scripts/prepare_device_s3.sh packed into .device/. Results go to $OUT (or ./device-out).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/device-out}"
mkdir -p "$OUT" /tmp/lockstep-weed /tmp/lockstep-pylibs
python -c "import lzma, shutil; shutil.copyfileobj(lzma.open('.device/weed.xz'), open('/tmp/lockstep-weed/weed', 'wb'))"
chmod +x /tmp/lockstep-weed/weed
for w in .device/wheels/*.whl; do python -m zipfile -e "$w" /tmp/lockstep-pylibs; done
export PATH="/tmp/lockstep-weed:$PATH" PYTHONPATH="$PWD/src:/tmp/lockstep-pylibs" OMP_NUM_THREADS=1
{ nproc; python -c "import torch, boto3; print(torch.__version__, boto3.__version__)"; } | tee "$OUT/s3_cost.txt"
python benchmarks/s3_checkpoint_cost.py --rounds "${ROUNDS:-5}" --steps "${STEPS:-40}" 2>&1 | tee -a "$OUT/s3_cost.txt"
