#!/usr/bin/env bash
# Lay out a Primus checkout for tests/test_primus.py, as Megatron-LM trees are laid out:
#   tests/export_primus.sh GIT_DIR REF DEST   ->  DEST/primus_<REF>/ (a plain tree, no .git)
# Only the package and the Megatron examples are exported (all the tests read; a shallow or
# partial clone may lack other blobs).
# then: export PRIMUS_TREES=DEST/primus_<REF>   (':'-separated for several). Never commit the tree.
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 GIT_DIR REF DEST" >&2; exit 2; }
git_dir=$1 ref=$2 dest=$3
out="$dest/primus_${ref//\//_}"
rm -rf "$out" && mkdir -p "$out"
git --git-dir="$git_dir" archive --format=tar "$ref" primus examples/megatron | tar -x -C "$out"
echo "$out"
