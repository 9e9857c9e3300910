#!/bin/bash
# Estimator vs measured tensor peak for the rows in docs/benchmarks.md ("Memory estimator").
set -u
row() {
  local ngpu=$1; shift
  local out; out=$(mktemp -d)
  python -m titanlite.tools.bench --ngpu "$ngpu" --warmup 1 --steps 2 --track-memory --out "$out/b.json" "$@" \
    --job.dump_folder "$out" >/dev/null || { echo "bench failed: $*"; return 1; }
  local est; est=$(python -m titanlite.tools.estimate --ngpu "$ngpu" "$@" | awk '/peak per rank/{print $4}')
  python - "$out/b.json" "$est" "$ngpu" "$*" <<'PY'
import json, sys
peaks = json.load(open(sys.argv[1]))["results"][0]["tensor_peak_gib_per_rank"]
est = float(sys.argv[2])
print(f"{sys.argv[3]} rank(s) | {sys.argv[4]} | estimate {est:.3f} | measured "
      + ", ".join(f"{p:.4f}" for p in peaks) + f" | error {max(abs(est - p) / p for p in peaks):.1%}")
PY
  rm -rf "$out"
}
D="--config debug_model.toml"; M="--config llama3_100m.toml"
row 1 $D --training.seq_len 64 --training.local_batch_size 4
row 2 $D --training.seq_len 64 --training.local_batch_size 4
row 1 $M --training.seq_len 256 --training.local_batch_size 2
row 2 $M --training.seq_len 256 --training.local_batch_size 2
row 1 $D --training.seq_len 256 --training.local_batch_size 16
row 1 $D --training.seq_len 256 --training.local_batch_size 16 --activation_checkpoint.mode full
row 1 $D --training.seq_len 256 --training.local_batch_size 16 --activation_checkpoint.mode selective --activation_checkpoint.selective_type layer
row 1 $D --training.seq_len 256 --training.local_batch_size 16 --activation_checkpoint.mode selective --activation_checkpoint.selective_type op
row 2 $D --training.seq_len 256 --training.local_batch_size 8 --activation_checkpoint.mode selective --activation_checkpoint.selective_type op
row 2 $D --training.seq_len 256 --training.local_batch_size 8 --activation_checkpoint.mode full
row 2 $M --training.seq_len 128 --training.local_batch_size 1
row 2 $M --training.seq_len 128 --training.local_batch_size 1 --optimizer.implementation foreach
row 1 $D --training.seq_len 64 --training.local_batch_size 4 --optimizer.implementation foreach
row 2 $D --training.seq_len 64 --training.local_batch_size 4 --parallelism.tensor_parallel_degree 2
row 2 $M --training.seq_len 256 --training.local_batch_size 2 --parallelism.tensor_parallel_degree 2
Q="--config qwen3_moe_debug.toml"  # MoE: the estimate routes a balanced load (docs/scaling.md)
row 1 $Q --training.seq_len 64 --training.local_batch_size 4
row 2 $Q --training.seq_len 64 --training.local_batch_size 4 --parallelism.expert_parallel_degree 2
