#!/usr/bin/env bash
# Re-export every committed fixture, check it in onnxruntime and refresh the README's op table.
# EXPORT_VENV_457 / EXPORT_VENV_5: the two export environments (models/README.md); CHECK_PYTHON: any
# Python with onnx, onnxruntime and numpy (the repo's .venv).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv457="${EXPORT_VENV_457:-$HOME/export-venv-457}"
venv5="${EXPORT_VENV_5:-$HOME/export-venv-5}"
check_python="${CHECK_PYTHON:-$here/../.venv/bin/python}"
out="$here/fixtures"

rm -f "$out"/*.onnx "$out"/*.npz "$out"/manifest.json
"$venv5/bin/python" "$here/export_moe_blocks.py" --all --out-dir "$out"
"$venv457/bin/python" "$here/export_moe_blocks.py" --all --out-dir "$out"
for venv in "$venv457:tf457" "$venv5:tf5"; do  # the routers alone (tests/test_rewrite_gating.py)
  for exporter in torchscript dynamo; do
    "${venv%%:*}/bin/python" "$here/export_routers.py" "$exporter" "$out/routers/deepseek_v3_${venv##*:}_$exporter.onnx"
  done
done
"$check_python" "$here/export_moe_blocks.py" --check "$out" --op-table "$out" --update-readme
