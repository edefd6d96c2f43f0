#!/usr/bin/env bash
# `bash benchmarks/old_tree.sh REV [DIR]`: REV's code (without specla/models, ~3 MB) in DIR
# (default .old, ignored by git), for an A/B lane on the device: carry DIR and run
# `SRC=DIR LANE=o bash benchmarks/h200.sh STEP...` beside a lane of this tree. The lane copies
# this tree's specla/models in (check first that REV's are the same: `git diff --stat REV --
# specla/models` prints nothing) and runs REV's own benches and diagnostics.
set -euo pipefail
rev=$1 dir=${2:-.old}
rm -rf "$dir" && mkdir -p "$dir"
git archive "$rev" -- specla ':!specla/models' pyproject.toml benchmarks/diagnostics | tar x -C "$dir"
echo "$rev" > "$dir/REV"
if ! git diff --quiet "$rev" HEAD -- specla/models; then
  echo "warning: specla/models differ between $rev and HEAD; the lane would run HEAD's" >&2
fi
du -sh "$dir"
