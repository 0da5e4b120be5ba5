#!/usr/bin/env bash
# The GPU validation, on a CUDA machine whose python3 has torch and pytest (plus nbval,
# ipykernel, nbformat, jsonschema): the gpu-marked tests, every notebook under nbval,
# executed copies with their plots as PNG, the kit's small measure, the benchmark.
# Usage: bash .ci/gpu-validate.sh OUTPUT_DIR   (logs and results land there)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash .ci/gpu-validate.sh OUTPUT_DIR}
mkdir -p "$out/plots"
py=${PYTHON:-python3}
case $py in /*) ;; */*) py="$PWD/$py" ;; esac  # steps below change directory
export ITERAGPU_REPORT_DIR="$out" PYTHONUNBUFFERED=1
failed=()
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi unavailable"
  $py -c "import platform, torch; print('python', platform.python_version(), '| torch', torch.__version__, '| cuda build', torch.version.cuda)"
} > "$out/device.txt" 2>&1
cat "$out/device.txt"

$py -m pytest -m gpu tests -p no:cacheprovider -o addopts="" -q -rfEs 2>&1 | tee "$out/pytest-gpu.log" || failed+=(pytest-gpu)
$py -m pytest --nbval-lax notebooks -p no:cacheprovider -o addopts="" -q 2>&1 | tee "$out/nbval.log" || failed+=(nbval)

{
  echo "== executed copies and their plots"
  $py - "$out/plots" <<'PY' || failed+=(executed-copies)
import base64, sys
from pathlib import Path
import nbformat
from nbclient import NotebookClient
out = Path(sys.argv[1])
for name in ("mesure-memoire", "pic-vs-reserve"):
    nb = nbformat.read(f"notebooks/{name}.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": "notebooks"}}).execute()
    nbformat.write(nb, out / f"{name}.executed.ipynb")
    n = 0
    for i, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            png = output.get("data", {}).get("image/png")
            if png:
                n += 1
                (out / f"{name}-cell{i:02d}-{n}.png").write_bytes(base64.b64decode(png))
    print(name, "executed,", n, "plots")
PY
  echo "== the kit, extracted alone, small measure"
  kit=$(mktemp -d)
  $py -m lab_helpers.kit build --output "$kit/iteragpu-lab-v1.zip" &&
  $py -m lab_helpers.kit verify "$kit/iteragpu-lab-v1.zip" &&
  $py -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$kit/iteragpu-lab-v1.zip" "$kit/x" &&
  ( cd "$kit/x/iteragpu-lab-v1" &&
    $py mesure_memoire.py measure --device cuda:0 --batch 1 --context 16 --width 64 --dtype float32 \
        --warmup 1 --repeats 2 --output "$kit/mesures-petit-essai.json" &&
    $py mesure_memoire.py compare "$kit/mesures-petit-essai.json" --fail-on-difference |
      $py -c "import json, sys; d = json.load(sys.stdin); print('kit measure: allocated_exact', d['allocated_exact'], '| workspace detected', d['workspace_detected_bytes'])" ) &&
  cp "$kit/mesures-petit-essai.json" "$out/kit-mesures-petit-essai.json" || failed+=(kit)
  echo "== benchmark"
  $py benchmarks/forward_vs_bare.py --output "$out/forward-vs-bare.json" || failed+=(benchmark)
} > "$out/extras.log" 2>&1
tail -n 25 "$out/extras.log"

echo "failed steps: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
