#!/usr/bin/env bash
# Packs what benchmarks/s3_checkpoint_cost.py needs on a device machine (torch is there, the rest is
# not, and nothing outside it can be reached) into .device/: the `weed` server compressed (153 MB
# becomes about 34 MB, inside the 64 MiB a device call carries) and boto3's pure-Python wheels.
# Then: device run, carry [".device"], command `bash scripts/device_s3_cost.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .device/wheels
[ -f .device/weed.xz ] || xz -6 -T2 -c .venv/bin/weed > .device/weed.xz
PIP_CONSTRAINT="$PWD/constraints.txt" .venv/bin/pip download --no-deps -q -d .device/wheels \
    boto3 botocore s3transfer jmespath python-dateutil six urllib3
du -sh .device
