#!/usr/bin/env bash
# Reproduce the ShapesEval base model shipped in rlgen_cli/assets/models/shapes_base:
# flow-matching pretraining from random weights (experiment=shapes_pretrain: 30 epochs × 50 steps of 128
# rendered scenes, ~35 min on 2 CPU cores), then export one epoch's weights (default 15, where strict
# test accuracy is ~30 %: often right, often wrong, room for RL).
#
#   scripts/pretrain_shapes.sh [RUN_DIR] [EPOCH]
set -euo pipefail
run_dir=${1:-outputs/shapes_pretrain}
epoch=${2:-15}
rlgen train experiment=shapes_pretrain hydra.run.dir="$run_dir"
weights="$run_dir/checkpoints/$(printf 'epoch_%06d' "$epoch")/weights/transformer"
target="$(python -c 'import rlgen_cli, pathlib; print(pathlib.Path(rlgen_cli.__file__).parent / "assets/models/shapes_base")')"
mkdir -p "$target"
cp "$weights/config.json" "$weights/diffusion_pytorch_model.safetensors" "$target/"
echo "exported $weights -> $target"
