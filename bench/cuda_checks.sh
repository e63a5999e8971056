#!/usr/bin/env bash
# What one CUDA GPU can prove about dpprof, in one go (a few minutes on one GPU):
#   1. the cuda-marked tests (tests/test_cuda.py);
#   2. the rest of the suite with a GPU visible (CPU-worker paths must not change when CUDA is there);
#      the dashboard's tests are left out with --no-dashboard (they need streamlit and plotly, no GPU);
#   3. a recorded run on cuda:0 (CUDA events, allocator counters, real NVML), shown and exported as CSV;
#   4. DDP: two ranks sharing GPU 0 over gloo (NCCL refuses two ranks on one GPU); FSDP2 likewise (--fsdp), each
#      rank's allocator figures in dpprof show;
#   5. a deep capture on cuda:0 (--capture): its kernels and operators per device, and its raw trace kept in OUTDIR;
#   6. bench/overhead.py --device cuda: recording against torch.profiler with CUDA activities, and
#      bench/overhead_parts.py --device cuda: which part of recording costs what (events, allocator, NVML, activations).
# One GPU cannot show DataParallel over several GPUs: the two-GPU parity tests skip.
#
# The rest of the suite runs last and gets what is left of --budget SECONDS (a GPU lease is short);
# a step that would start with under 20 s left is skipped and named.
#
#   bench/cuda_checks.sh [--no-dashboard] [--rounds N] [--budget SECONDS] [OUTDIR]   (python: $PYTHON, else python3)
set -u
dashboard=1 rounds=8 budget=100000
while [ $# -gt 0 ]; do
  case $1 in
    --no-dashboard) dashboard=0; shift ;;
    --rounds) rounds=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    *) break ;;
  esac
done
out=$(mkdir -p "${1:-cuda-checks}" && cd "${1:-cuda-checks}" && pwd)
py=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 DPPROF_REPORTS=$out/reports
failed=() skipped=()
step() {  # step NAME SECONDS CMD...: run, log to $out/NAME.log, remember a failure; bounded by what is left of the budget
  local name=$1 limit=$2; shift 2
  local left=$((budget - SECONDS))
  if [ $left -lt 20 ]; then echo "== $name: skipped, ${left} s of the budget left"; skipped+=("$name"); return; fi
  [ $left -lt $limit ] && limit=$left
  echo "== $name (at most $limit s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || failed+=("$name")
}

# the suite's commands run `dpprof` as the README's set-up installs it: on a bare GPU machine, install this checkout
# (editable, no dependencies fetched: the machine's torch stays)
command -v dpprof >/dev/null || "$py" -m pip install -q --no-deps --no-build-isolation -e . || echo "dpprof not installed"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$py" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPUs", torch.cuda.device_count(), torch.cuda.get_device_name(0))'

step cuda-tests 300 "$py" -m pytest tests/test_cuda.py -v -rs -p no:cacheprovider
step cuda-run 180 "$py" -m dpprof profile cifar-lenet --devices cuda --steps 200 --name "cifar-lenet on cuda:0" --quiet
newest='import dpprof; print(dpprof.list_runs().loc[0, "id"])'
run_id=$("$py" -c "$newest")
step cuda-show 120 "$py" -m dpprof show "$run_id"
step cuda-export 120 "$py" -m dpprof export "$run_id" --out "$out/csv"
step capture-run 180 "$py" -m dpprof profile cifar-lenet --devices cuda --steps 60 --capture 20:25 \
  --name "cifar-lenet on cuda:0, steps 20-24 captured" --quiet
capture_id=$("$py" -c "$newest")
step capture-ops 60 "$py" -m dpprof ops "$capture_id" --top 15
step capture-kernels 60 "$py" -m dpprof kernels "$capture_id" --top 15
step capture-memory 60 "$py" -m dpprof memory "$capture_id"
cp "$DPPROF_REPORTS"/*.capture-*.pt.trace.json.gz "$out/" 2>/dev/null  # the raw trace, for reading elsewhere
step ddp-gloo 300 "$py" -m dpprof profile cifar-lenet --ddp --nproc 2 --devices cuda --steps 100 --batch-size 128 \
  --name "cifar-lenet, 2 DDP ranks sharing cuda:0 over gloo" --quiet
ddp_id=$("$py" -c "$newest")
step ddp-show 120 "$py" -m dpprof show "$ddp_id"
step fsdp-gloo 300 "$py" -m dpprof profile tutorial-linear --fsdp --nproc 2 --devices cuda --steps 30 \
  --name "tutorial-linear, 2 FSDP ranks sharing cuda:0 over gloo" --quiet
fsdp_id=$("$py" -c "$newest")
step fsdp-show 120 "$py" -m dpprof show "$fsdp_id"
step overhead 200 nice -n -5 "$py" -u bench/overhead.py --device cuda --rounds "$rounds" --cprofile
step parts 120 nice -n -5 "$py" -u bench/overhead_parts.py --device cuda --rounds "$rounds"

ignore=()
if [ $dashboard -eq 0 ]; then
  ignore=(--ignore=tests/test_app.py --ignore=tests/test_browser.py --ignore=tests/test_trace_app.py
          --ignore=tests/test_charts.py --deselect=tests/test_queries.py::test_the_read_side_never_imports_streamlit
          --deselect=tests/test_faults.py::test_the_dashboard_shows_that_line_instead_of_starting_a_run)
fi
"$py" -c 'import xdist' 2>/dev/null && ignore+=(-n 8)  # pytest-xdist, where installed
# the lint module needs ruff and mypy, the strict docs build mkdocs: a GPU image may have none of them
"$py" -c 'import ruff, mypy' 2>/dev/null || ignore+=(--ignore=tests/test_lint.py)
"$py" -c 'import mkdocs' 2>/dev/null || ignore+=(--deselect=tests/test_docs.py::test_mkdocs_builds_the_site_strictly)
# -v: each test's outcome with its name as it ends, so a run the budget stops still names what failed (-q names
# none before its summary, which a stopped run never prints)
# -rfE --tb=short: a run that ends says each failure's and error's cause in the log (the GPU image's own torch, SQLite
# and package metadata differ from the build machine's: two real bugs were found that way)
step suite 900 "$py" -m pytest tests -v -rfE --tb=short -p no:cacheprovider "${ignore[@]}" --ignore=tests/test_cuda.py
grep -E "(FAILED|ERROR)( |$)" "$out/suite.log" | grep -v "^FAILED\|^ERROR" | sed 's/^/   /' | head -n 40

echo
[ ${#skipped[@]} -eq 0 ] || echo "SKIPPED (budget): ${skipped[*]}"
if [ ${#failed[@]} -eq 0 ]; then echo "all steps passed; logs in $out"; else echo "FAILED: ${failed[*]}; logs in $out"; exit 1; fi
