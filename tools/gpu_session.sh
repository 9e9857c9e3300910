#!/usr/bin/env bash
# One GPU session, prepared: what titanlite still needs measured on a CUDA GPU, inside 8 minutes
# from a bare machine, most valuable first, each section in its own time limit; a failure is
# recorded (FAIL and one line) and the next section runs.
#
#   bash tools/gpu_session.sh [OUT]        (default ./gpu_session; the device tool passes $OUT)
#
# Writes OUT/session.json (every figure), OUT/session.md (the table, printed last) and
# OUT/session.log (every section's output). Sections, in this order:
#   facts        python, torch, CUDA, GPU, driver, the wheels installed
#   1b_eager     llama3 1B, bf16, selective AC, one rank, 2 warm-up + 5 timed steps: tokens/s,
#                MFU, peak memory next to the dry run's prediction (run on the host meanwhile)
#   1b_compiled  the same, compile.enable true
#   healthcheck  python -m titanlite.tools.healthcheck --skip-run (rates, numerics, features)
#   3b_eager     llama3 3B (batch 1 x 8192) where the dry run says it fits
#   1b_float8    the compiled 1B step with float8.enable true (torchao tensorwise)
#   gpu_tests    pytest -m gpu tests/test_gpu.py: flex backward, varlen, float8 training, bf16
#                compile, deterministic mode twice bit for bit (their five training runs of the
#                debug model share the GPU at once)
#   3b_compiled  the 3B step compiled
# What the 8 minutes (GPU_SESSION_BUDGET_S=470 s of sections) cannot hold is recorded SKIP.
# A rerun of some sections in what is left of a lease: GPU_SESSION_ONLY="healthcheck gpu_tests"
# (facts always run; the others SKIP), and GPU_TESTS_K narrows the gpu tests (pytest -k).
# On a machine without CUDA the same script runs in a minute or two as a smoke test: the health
# check over two gloo ranks and the debug model's step, the GPU sections SKIP ("no CUDA").
#
# The machine: python3 with torch 2.11 (CUDA), no titanlite install, no network. titanlite runs
# from this checkout (PYTHONPATH), and what its python lacks travels as wheels in .whl/ (git
# ignores it; the lead carries it), fetched on a machine with network, from the repo root:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl torchdata==0.11.0 torchao==0.18.0
# (torchdata: the stateful data loader, pure Python; torchao 0.18.0: float8, built on torch's
# stable ABI for torch >= 2.11; 3.4 MB together.)
set -uo pipefail
{  # the whole script is read before it runs: a checkout that changes under a running session cannot change it

OUT=$(mkdir -p "${1:-./gpu_session}" && cd "${1:-./gpu_session}" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUDGET=${GPU_SESSION_BUDGET_S:-470}  # seconds for every section; the report needs a few more
START=$SECONDS
WORK=$(mktemp -d)
LOG=$OUT/session.log
: > "$LOG"
: > "$WORK/sections.tsv"
: > "$WORK/steps.tsv"

record() {  # name status seconds note
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(tr '\t\n' '  ' <<< "$4" | cut -c1-300)" >> "$WORK/sections.tsv"
  echo "--- $1: $2 ${4:+($4)}" | tee -a "$LOG"
}

wanted() {  # name: is this section in the run (GPU_SESSION_ONLY, when set, lists them)
  [[ -z "${GPU_SESSION_ONLY:-}" || $1 == facts || " $GPU_SESSION_ONLY " == *" $1 "* ]]
}

section() {  # name limit_s command...: run it within its limit and the session's budget
  local name=$1 limit=$2
  shift 2
  if ! wanted "$name"; then
    record "$name" SKIP 0 "not in GPU_SESSION_ONLY"
    return
  fi
  local left=$(( BUDGET - (SECONDS - START) ))
  (( limit > left )) && limit=$left
  if (( limit < 20 )); then
    record "$name" SKIP 0 "out of the session's ${BUDGET} s budget"
    return
  fi
  echo "=== $name (at most ${limit} s) ===" | tee -a "$LOG"
  local t0=$SECONDS rc
  timeout -k 10 "$limit" "$@" > "$WORK/last.log" 2>&1
  rc=$?
  cat "$WORK/last.log" >> "$LOG"
  tail -n 4 "$WORK/last.log"
  local last
  last=$(grep -v '^\s*$' "$WORK/last.log" | tail -n 1)
  case $rc in
    0) record "$name" PASS $(( SECONDS - t0 )) "" ;;
    77) record "$name" SKIP $(( SECONDS - t0 )) "$last" ;;
    124|137) record "$name" FAIL $(( SECONDS - t0 )) "timed out after ${limit} s" ;;
    *) record "$name" FAIL $(( SECONDS - t0 )) "exit $rc: $last" ;;
  esac
}

# What the machine has; the wheels first, so the facts see them
if compgen -G ".whl/*.whl" > /dev/null; then
  PIP_CONFIG_FILE=/dev/null $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >> "$LOG" 2>&1 \
    || for w in .whl/*.whl; do $PY -m zipfile -e "$w" /tmp/site; done  # a wheel is a zip: no pip, no problem
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export WORK
FACTS='
import importlib.metadata as md, importlib.util, os, platform, subprocess, sys
import torch
from titanlite.tools.healthcheck import datasheet, power_limit_w
have = {p: md.version(p) for p in ("triton", "transformers", "torchao", "torchdata") if importlib.util.find_spec(p)}
line = (f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()} ({sys.executable}), "
        f"torch {torch.__version__}, " + ", ".join(f"{k} {v}" for k, v in have.items()))
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.split() or ["?"]
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    line += (f"; {torch.cuda.device_count()} x {p.name} ({p.total_memory / 2**30:.1f} GiB, sm {p.major}{p.minor}), "
             f"driver {smi[0]}, CUDA {torch.version.cuda}, NCCL {nccl}")
    g = datasheet(p.name)
    open(os.environ["WORK"] + "/gpu", "w").write(g.name if g else "")
    watts = power_limit_w()  # the dry runs predict at the limit the driver enforces
    line += f", power limit {watts:.0f} W" if watts else ", power limit unknown"
    open(os.environ["WORK"] + "/power", "w").write(f"{watts:g}" if watts else "")
else:
    line += "; no CUDA: a smoke test of the session on CPU"
open(os.environ["WORK"] + "/facts.txt", "w").write(line)
print(line)
'
section facts 90 $PY -c "$FACTS"
[[ -f "$WORK/facts.txt" ]] || echo "facts: python3 could not import torch/titanlite" > "$WORK/facts.txt"

step() {  # name dry_json compiled(0/1) overrides...: one measured step next to its dry run
  local name=$1 dry=$2 compiled=$3
  shift 3
  wanted "$name" && printf '%s\t%s\t%s\n' "$name" "$dry" "$compiled" >> "$WORK/steps.tsv"
  section "$name" "$STEP_LIMIT" $PY -m titanlite.tools.gpu_session step "$WORK" "$name" "$@"
}
dry_run() {  # out_json overrides...: the dry run on the host CPU, beside the GPU sections
  local out=$1
  shift
  if [[ -z "$GPU" ]]; then
    echo "no dry run: titanlite.dryrun.hardware has no figures for this GPU" > "$WORK/$out.log"
    return
  fi
  local power=()
  [[ -s "$WORK/power" ]] && power=(--power-limit "$(cat "$WORK/power")")
  timeout -k 5 240 $PY -m titanlite.dryrun --ngpu 1 --gpu "$GPU" "${power[@]}" --out "$WORK/$out" "$@" > "$WORK/$out.log" 2>&1 &
}

L1=(--config llama_1b.toml --activation_checkpoint.mode selective)
L3=(--config llama_3b.toml --activation_checkpoint.mode selective --training.local_batch_size 1)
if [[ -f "$WORK/gpu" ]]; then
  GPU=$(cat "$WORK/gpu")
  TOLERANCE=0.25
  STEP_LIMIT=110
  { wanted 1b_eager || wanted 1b_compiled; } && dry_run dry_1b.json "${L1[@]}"
  dry_run dry_3b.json "${L3[@]}"  # 3b_eager's --fit reads it
  step 1b_eager dry_1b.json 0 -- "${L1[@]}"
  STEP_LIMIT=150
  step 1b_compiled dry_1b.json 1 -- "${L1[@]}" --compile.enable true
  section healthcheck 150 $PY -m titanlite.tools.healthcheck --skip-run --out "$WORK/healthcheck.json"
  STEP_LIMIT=120
  step 3b_eager dry_3b.json 0 --fit "$WORK/dry_3b.json" -- "${L3[@]}"
  STEP_LIMIT=150
  step 1b_float8 "" 1 -- "${L1[@]}" --compile.enable true --float8.enable true
  # -v: each test's verdict reaches the log even if the section's time runs out
  section gpu_tests 150 $PY -m pytest -v -p no:cacheprovider -m gpu tests/test_gpu.py ${GPU_TESTS_K:+-k "$GPU_TESTS_K"}
  step 3b_compiled dry_3b.json 1 --fit "$WORK/dry_3b.json" -- "${L3[@]}" --compile.enable true
else
  # no CUDA: the same machinery at tiny sizes (an H100's prediction next to CPU figures, never judged),
  # with room for a shared CPU: the 8-minute budget is the GPU's
  BUDGET=${GPU_SESSION_BUDGET_S:-900}
  GPU=h100
  TOLERANCE=none
  tiny=(--model.flavor debugmodel --training.seq_len 64 --training.local_batch_size 2 --data.holdout_fraction 0.0)
  dry_run dry_debug.json "${tiny[@]}"
  section healthcheck 400 $PY -m titanlite.tools.healthcheck --ngpu 2 --warmup 1 --steps 2 --out "$WORK/healthcheck.json"
  STEP_LIMIT=300
  step debug_cpu dry_debug.json 0 -- "${tiny[@]}"
  for name in 1b_eager 1b_compiled 3b_eager 1b_float8 gpu_tests 3b_compiled; do record "$name" SKIP 0 "no CUDA"; done
fi
wait  # the dry runs
for f in "$WORK"/*.json.log; do [[ -f "$f" ]] && { echo "=== $(basename "$f")"; cat "$f"; } >> "$LOG"; done
echo "=== session: $(( SECONDS - START )) s" | tee -a "$LOG"
$PY -m titanlite.tools.gpu_session report "$WORK" "$OUT" "$TOLERANCE" 2>&1 | tee -a "$LOG"
rm -rf "$WORK"
exit
}
