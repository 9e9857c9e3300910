#!/usr/bin/env bash
# Launch titanlite training with torchrun.
#   [NGPU=N] ./run_train.sh [--config FILE] [--skip-preflight] [--print-plan] [--healthcheck] [--section.key VALUE ...]
# FILE may be a bare name in train_configs/ (default: debug_model.toml). Multi-node: set NNODES, NODE_RANK and
# RDZV_ENDPOINT=host:port on every node (see docs/multinode.md).
set -euo pipefail

NO_GPU=0  # NGPU unset on a machine without CUDA: 1 rank, but the health check's own default (2 gloo ranks)
if [[ -z "${NGPU:-}" ]]; then
  NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
  if [[ "$NGPU" == 0 ]]; then NGPU=1 NO_GPU=1; fi
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
for var in NGPU NNODES; do
  if ! [[ "${!var}" =~ ^[1-9][0-9]*$ ]]; then
    echo "titanlite: error: $var must be a positive integer, got '${!var}'" >&2
    exit 2
  fi
done

# Without --config, the default job: train_configs/debug_model.toml (as TorchTitan's run_train.sh),
# so the bare command and the file are one job, not the file and JobConfig's defaults.
has_config=0
for arg in "$@"; do
  case "$arg" in --config | --config=* | --job.config_file | --job.config_file=*) has_config=1 ;; esac
done
# (the health check's own default job is llama3 1B at the node's size: it gets no default config)
case " $* " in *" --healthcheck "*) has_config=1 ;; esac
if (( ! has_config )); then set -- --config debug_model.toml "$@"; fi

case " $* " in
  *" --help "* | *" -h "* | *" --print-config "*) exec python -m titanlite.train "$@" ;;
  # the planner's best layouts for this job on NGPU x NNODES GPUs (titanlite.plan), no launch
  *" --print-plan "*)
    rest=()
    for arg in "$@"; do [[ "$arg" == --print-plan ]] || rest+=("$arg"); done
    exec python -m titanlite.plan --ngpu $((NGPU * NNODES)) ${rest[@]+"${rest[@]}"} ;;
  # the health check of this node's NGPU GPUs (titanlite.tools.healthcheck), run on every node as a
  # job is: its collectives span the nodes through NNODES/NODE_RANK/RDZV_ENDPOINT; no training
  *" --healthcheck "*)
    rest=()
    for arg in "$@"; do [[ "$arg" == --healthcheck ]] || rest+=("$arg"); done
    ngpu=(--ngpu "$NGPU")
    if (( NO_GPU )); then ngpu=(); fi
    exec python -m titanlite.tools.healthcheck ${ngpu[@]+"${ngpu[@]}"} ${rest[@]+"${rest[@]}"} ;;
esac

# --skip-preflight: launch without the dry run below (if it fails inside titanlite, it says so)
preflight=1
args=()
for arg in "$@"; do
  if [[ "$arg" == --skip-preflight ]]; then preflight=0; else args+=("$arg"); fi
done
set -- ${args[@]+"${args[@]}"}

# Validate in one process first: bad input gives one clear line, not one per rank.
# The config alone is checked without torch (fast), then the trainer's preflight (layout,
# model, files) and a dry run of one step on fake tensors (seconds) that refuses a layout
# that cannot fit in memory.
python -m titanlite.config.load "$@"
if (( preflight )); then
  python -m titanlite.dryrun --check-memory "$NGPU" --ngpu $((NGPU * NNODES)) "$@"
fi

if [[ -n "${RDZV_ENDPOINT:-}" || "$NNODES" != 1 ]]; then
  launch=(--nnodes="$NNODES" --node_rank="$NODE_RANK" --rdzv_backend=c10d
          --rdzv_endpoint="${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port for multi-node runs}"
          --rdzv_id="${RDZV_ID:-titanlite}")
else
  launch=(--standalone)
fi
# torchrun runs under titanlite's launcher: a stop signal ends in exit 0 and the stop line, a
# rank's failure in its own one-line error and exit code; torchrun's report goes to
# <dump_folder>/logs/torchrun.log
exec python -m titanlite.runtime.launch "${launch[@]}" --nproc_per_node="$NGPU" --local-ranks-filter="${LOG_RANK:-0}" \
  -- "$@"
