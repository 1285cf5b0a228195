#!/usr/bin/env bash
# Every NCCL/CUDA path of stalwart, on a lent GPU machine, in well under 10 minutes.
#
#   bash bench/gpu_check.sh                 # on the GPU machine (results under $OUT or /tmp)
#   GPU_CHECK_DEVICE=cpu bash bench/gpu_check.sh   # the same logic on gloo/CPU, anywhere
#
# The GPU image has torch but maybe not stalwart's small dependencies: wheels for them
# (psutil, rich, prometheus-client, msgspec, PyYAML, xxhash, setproctitle) may be carried
# in .whl/ (see the device tool's notes); they are installed into /tmp/site first.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEV=${GPU_CHECK_DEVICE:-cuda}
RES=${OUT:-/tmp/gpu_check}/gpu_check
rm -rf "$RES" && mkdir -p "$RES"
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

failed=0
check() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  if timeout "$limit" "$@" >"$RES/$name.log" 2>&1 && grep -q "gpu_check $name ok" "$RES/$name.log"; then
    echo "PASS $name ($((SECONDS - t0)) s): $(grep "gpu_check $name ok" "$RES/$name.log" | tail -1)"
  else
    echo "FAIL $name ($((SECONDS - t0)) s); last lines of $RES/$name.log:"
    tail -25 "$RES/$name.log" | sed 's/^/    /'
    failed=1
  fi
}
run=("$PY" -m stalwart.cli run --nproc-per-node 1 --log-dir "$RES/runs")

check env 60 "$PY" bench/gpu_check.py env --device "$DEV"
check ddp 180 "${run[@]}" --max-restarts 1 --inject crash:rank=0,step=35 \
  bench/gpu_check.py ddp --device "$DEV" --ckpt "$RES/ckpt_ddp"
grep -q '"attempt": 1, "resumed_from": 30' "$RES/ddp.log" \
  || { echo "FAIL ddp: expected attempt 1 resumed from step 30"; failed=1; }
check dcp 180 "${run[@]}" bench/gpu_check.py dcp --device "$DEV" --ckpt "$RES/ckpt_dcp"
check inprocess 120 "${run[@]}" bench/gpu_check.py inprocess --device "$DEV"
# The stock GPU node check (docs/health.md), alone and as a one-node job's health check.
check health_gpu 120 bash -c "$PY -m stalwart.health.gpu --device $DEV && echo 'gpu_check health_gpu ok'"
check health_run 240 bash -c '"$@" && echo "gpu_check health_run ok"' _ "${run[@]}" \
  --node-health-timeout 150 --node-health-check "$PY -m stalwart.health.gpu --device $DEV" \
  bench/gpu_check.py env --device "$DEV"
grep -q '"event": *"node_excluded"' "$RES"/runs/*/events.jsonl 2>/dev/null \
  && { echo "FAIL health_run: a healthy GPU node was kept out"; failed=1; }
exit $failed
