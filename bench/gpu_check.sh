#!/usr/bin/env bash
# Every NCCL/CUDA path of stalwart, on a lent GPU machine, in well under 10 minutes.
#
#   bash bench/gpu_check.sh                 # on the GPU machine (logs in /tmp/gpu_check/run;
#                                           # a tarball of them in $OUT when set)
#   GPU_CHECK_DEVICE=cpu bash bench/gpu_check.sh   # the same logic on gloo/CPU, anywhere
#
# The GPU image has torch but maybe not stalwart's small dependencies: wheels for them
# (psutil, rich, prometheus-client, msgspec, PyYAML, xxhash, setproctitle) may be carried
# in .whl/ (see the device tool's notes); they are installed into /tmp/site first.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEV=${GPU_CHECK_DEVICE:-cuda}
# Logs and checkpoints on the machine's own disk; under $OUT (the device tool's folder
# that comes back) only a tarball of the logs, written at the end.
RES=/tmp/gpu_check/run
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
# Issue 23 on the device: FSDP2 + AdamW state in CUDA memory, saved through DCP and
# stalwart (pinned staging buffers), restored from disk and from the launcher's RAM, each
# restore equal to the save; prints the medians. Smaller on CPU.
if [ "$DEV" = cuda ]; then mib=${GPU_CHECK_MIB:-512}; else mib=${GPU_CHECK_MIB:-32}; fi
check dcpbench 300 "$PY" -m stalwart.cli run --nproc-per-node 1 --ckpt-ram 3GiB \
  --log-dir "$RES/runs_dcpbench" bench/gpu_check.py dcpbench --device "$DEV" \
  --ckpt "$RES/ckpt_dcpbench" --mib "$mib" --repeats 3
grep "dcpbench rows" "$RES/dcpbench.log" | sed 's/^/    /'
"$PY" - "$RES/runs_dcpbench" <<'PYEOF' || failed=1
import json, pathlib, sys
evs = [json.loads(x) for f in pathlib.Path(sys.argv[1]).glob("*/events.jsonl")
       for x in f.read_text().splitlines()]
src = [e.get("source") for e in evs if e["event"] == "checkpoint_restored"]
ok = len(src) == 6 and set(src) == {"ram"}
print(("PASS" if ok else "FAIL") + f" dcpbench restores reported by the launcher: {src}")
sys.exit(0 if ok else 1)
PYEOF
check inprocess 120 "${run[@]}" bench/gpu_check.py inprocess --device "$DEV"
# A rank asleep before the all-reduce, nothing configured: found from the learned rhythm,
# rank 1 blamed (rank 0 waits in the all-reduce / device synchronise), attempt 1 finishes.
check hang 240 "$PY" -m stalwart.cli run --nproc-per-node 2 --max-restarts 1 \
  --log-dir "$RES/runs_hang" bench/gpu_check.py hang --device "$DEV" --steps 60
grep -q '"attempt": 1' "$RES/hang.log" || { echo "FAIL hang: attempt 1 did not finish"; failed=1; }
"$PY" - "$RES/runs_hang" <<'PYEOF' || failed=1
import json, pathlib, sys
evs = [json.loads(x) for f in pathlib.Path(sys.argv[1]).glob("*/events.jsonl")
       for x in f.read_text().splitlines()]
hangs = [e for e in evs if e["event"] == "hang_detected" and e.get("attempt") == 0]
roots = [e["global_rank"] for e in hangs if e.get("waiting_on") is None]
restart = [e["root_cause"]["rank"] for e in evs if e["event"] == "restart"]
ok = roots == [1] and restart == [1]
print(("PASS" if ok else "FAIL") + f" hang blame: roots {roots}, restart blamed {restart}, "
      f"timeout {[round(e['timeout'], 2) for e in hangs]} s")
sys.exit(0 if ok else 1)
PYEOF
# The stock GPU node check (docs/health.md), alone and as a one-node job's health check.
check health_gpu 120 bash -c "$PY -m stalwart.health.gpu --device $DEV && echo 'gpu_check health_gpu ok'"
check health_run 240 bash -c '"$@" && echo "gpu_check health_run ok"' _ "${run[@]}" \
  --node-health-timeout 150 --node-health-check "$PY -m stalwart.health.gpu --device $DEV" \
  bench/gpu_check.py env --device "$DEV"
grep -q '"event": *"node_excluded"' "$RES"/runs/*/events.jsonl 2>/dev/null \
  && { echo "FAIL health_run: a healthy GPU node was kept out"; failed=1; }
# The collective link check's process: one per GPU on NCCL (one GPU: a one-rank NCCL
# group), each must conclude and blame nobody; on CPU, three on gloo.
check health_links 180 "$PY" bench/gpu_links.py --device "$DEV"
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/gpu_check_logs.tgz" --exclude='ckpt_*' -C /tmp/gpu_check run 2>/dev/null
fi
exit $failed
