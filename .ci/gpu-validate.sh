#!/usr/bin/env bash
# The GPU validation, on a CUDA machine whose python3 has torch, transformers and pytest (plus nbval,
# ipykernel, nbformat, nbclient, jsonschema): the gpu-marked tests, every notebook under nbval,
# the kit's small measure, the benchmark, then executed copies with their plots as PNG.
# With two or more GPUs visible it runs two halves at once, one GPU each (CUDA_VISIBLE_DEVICES), so
# that no test shares a GPU with another: the real-model half on GPU 0, the rest on GPU 1. The
# tensor-parallel tests then run alone, under torchrun on both GPUs (they skip with fewer than two).
# Usage: bash .ci/gpu-validate.sh OUTPUT_DIR [all|one-gpu|real-models|the-rest|tensor-parallel]   (logs and
# results land there; one-gpu: the two halves only; real-models or the-rest: one half, so that one H200
# runs each in its own call; tensor-parallel: the torchrun tests only; default all)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash .ci/gpu-validate.sh OUTPUT_DIR [all|one-gpu|real-models|the-rest|tensor-parallel]}
steps=${2:-all}
case $steps in all|one-gpu|real-models|the-rest|tensor-parallel) ;;
  *) echo "gpu-validate.sh: error: steps must be all, one-gpu, real-models, the-rest or tensor-parallel, not '$steps'" >&2; exit 2 ;; esac
mkdir -p "$out/plots"
out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
case $py in /*) ;; */*) py="$PWD/$py" ;; esac  # steps below change directory
export ITERAGPU_REPORT_DIR="$out" PYTHONUNBUFFERED=1
gpus=$($py -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi unavailable"
  $py -c "import platform, torch, transformers; print('python', platform.python_version(), '| torch', torch.__version__, '| cuda build', torch.version.cuda, '| transformers', transformers.__version__)"
  echo "gpus visible: $gpus"
} > "$out/device.txt" 2>&1
cat "$out/device.txt"
pytest=($py -m pytest -p no:cacheprovider -o addopts="" -q -rfEs)

real_models() {  # the transformers acceptance and the real-model notebook
  local failed=0
  "${pytest[@]}" -m gpu tests/test_gpu_real_model.py > "$out/pytest-gpu-real-model.log" 2>&1 || failed=1
  "${pytest[@]}" --nbval-lax notebooks/real-model.ipynb > "$out/nbval-real-model.log" 2>&1 || failed=1
  return $failed
}

the_rest() {  # every other gpu test, the other notebooks, the kit, the benchmark, executed copies
  local failed=0
  "${pytest[@]}" -m gpu tests --ignore=tests/test_gpu_real_model.py --ignore=tests/test_gpu_tensor_parallel.py \
      --ignore=tests/test_gpu_real_model_tp.py --ignore=tests/test_gpu_budget_rule.py \
      > "$out/pytest-gpu.log" 2>&1 || failed=1
  # alone: its usable-memory probe must find no CUDA context of an earlier test in the same process
  "${pytest[@]}" -m gpu tests/test_gpu_budget_rule.py > "$out/pytest-gpu-budget-rule.log" 2>&1 || failed=1
  "${pytest[@]}" --nbval-lax $(ls notebooks/*.ipynb | grep -v real-model) \
      > "$out/nbval.log" 2>&1 || failed=1
  {
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
    cp "$kit/mesures-petit-essai.json" "$out/kit-mesures-petit-essai.json" || failed=1
    echo "== benchmark"
    $py benchmarks/forward_vs_bare.py --output "$out/forward-vs-bare.json" || failed=1
    echo "== executed copies and their plots"
    $py - "$out/plots" <<'PY' || failed=1
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
    for i, cell in enumerate(nb.cells, start=1):
        for output in cell.get("outputs", []):
            png = output.get("data", {}).get("image/png")
            if png:
                n += 1
                (out / f"{name}-cell{i:02d}-{n}.png").write_bytes(base64.b64decode(png))
    print(name, "executed,", n, "plots")
PY
  } > "$out/extras.log" 2>&1
  return $failed
}

failed=()
if [ "$steps" = tensor-parallel ]; then :
elif [ "$steps" = real-models ]; then real_models || failed+=(real-models)
elif [ "$steps" = the-rest ]; then the_rest || failed+=(the-rest)
elif [ "$gpus" -ge 2 ]; then
  ( export CUDA_VISIBLE_DEVICES=0; real_models ) & first=$!
  ( export CUDA_VISIBLE_DEVICES=1; the_rest ) & second=$!
  wait $first || failed+=(real-models)
  wait $second || failed+=(the-rest)
else
  real_models || failed+=(real-models)
  the_rest || failed+=(the-rest)
fi
if [ "$steps" = all ] || [ "$steps" = tensor-parallel ]; then  # every visible GPU: torchrun starts one rank per GPU
  "${pytest[@]}" -m gpu tests/test_gpu_tensor_parallel.py > "$out/pytest-gpu-tensor-parallel.log" 2>&1 ||
    failed+=(tensor-parallel)
  "${pytest[@]}" -m gpu tests/test_gpu_real_model_tp.py > "$out/pytest-gpu-real-model-tp.log" 2>&1 ||
    failed+=(real-model-tensor-parallel)
fi
for log in "$out"/pytest-*.log "$out"/nbval*.log; do [ -f "$log" ] && echo "$(basename "$log"): $(tail -n 1 "$log")"; done
[ -f "$out/extras.log" ] && tail -n 12 "$out/extras.log"
echo "failed steps: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
