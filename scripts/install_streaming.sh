#!/usr/bin/env bash
# mosaicml-streaming for the tests, in a folder of its own (VENV/streaming, on the PYTHONPATH of the
# jobs that use it), never in the venv itself: its requirements (numpy<2.2, transformers<5) exclude
# what the venv has, and `import streaming` imports torchvision, whose only 0.28 wheel is a CUDA
# build. Installed without their requirements, the CPU venv's numpy and torch serve them; the two
# fake kernels torchvision registers for its own C++ ops (absent without CUDA) are made conditional.
set -euo pipefail
venv=${1:?usage: install_streaming.sh VENV}
target="$venv/streaming"
rm -rf "$target"
"$venv/bin/pip" install --quiet --no-deps --target "$target" mosaicml-streaming==0.13.0 torchvision==0.28.0 \
    Brotli==1.2.1 python-snappy==0.7.3 cramjam==2.14.0 zstd==1.5.7.2 catalogue==2.0.10
sed -i 's/^@torch.library.register_fake("torchvision::\(q\?nms\)")/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))/' \
    "$target/torchvision/_meta_registrations.py"
grep -q 'if torchvision.extension._has_ops() else' "$target/torchvision/_meta_registrations.py"
