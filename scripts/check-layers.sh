#!/usr/bin/env bash
# Fails when a file under cohort/ includes a cohort module above its own
# layer (docs/design.md, "Layers"). A module may include its own folder and
# the layers below it, never a layer above nor a peer on its own layer.
# Run by the test command (ctest: layering); `scripts/check-layers.sh` alone
# prints every offending include.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# Layer of each module folder under cohort/, bottom (0) to top. A new module
# gets a line here: the check refuses folders it does not know. A sub-module
# (a folder inside a module, "dcp/state_dict") may have a layer of its own:
# a file belongs to the innermost folder of its path that has one.
declare -A layer=(
  [core]=0
  [observability]=1
  [memory]=2
  [activation]=3
  [algorithms]=4
  [comm]=5
  [compression]=6
  [data]=6
  [dcp]=6  # its core: state dicts, save, load, the files; no mode
  [grad_sync]=7
  [plan]=8  # what the Trainer calls: TrainingPlan and its interfaces; no mode
  [train]=9  # below every mode: it knows them only through the plan
  [mesh]=10
  [fsdp]=11
  [optim]=12
  [ddp]=13  # above optim and mesh: they reduce through grad_sync, not DDP
  [pipeline]=14
  [tensor_parallel]=15
  [context_parallel]=15
  [expert_parallel]=16
  [dcp/state_dict]=17  # get_state_dict/set_state_dict: knows every mode
  [wiring]=18  # TrainerWiring's factories: a mode's parts and its state dict
)

# The module of a path under cohort/ (in REPLY; no subshell per include).
module_of() {
  local dir=${1%/*}
  REPLY=${1%%/*}
  while [ "$dir" != "$1" ] && [ -n "$dir" ]; do
    if [ -n "${layer[$dir]+x}" ]; then
      REPLY=$dir
      return
    fi
    [ "$dir" = "${dir%/*}" ] && return
    dir=${dir%/*}
  done
}

status=0
while IFS= read -r file; do
  rel=${file#cohort/}
  [ "${rel%%/*}" = "$rel" ] && continue  # cohort/cohort.h, the umbrella: may include all
  module_of "$rel"
  from=$REPLY
  if [ -z "${layer[$from]+x}" ]; then
    echo "layering: $file: module '$from' has no layer in scripts/check-layers.sh"
    status=1
    continue
  fi
  while IFS=: read -r line target; do
    module_of "${target#cohort/}"
    to=$REPLY
    [ "$to" = "$from" ] && continue
    if [ -z "${layer[$to]+x}" ]; then
      echo "layering: $file:$line includes cohort/$to, which has no layer"
      status=1
    elif [ "${layer[$to]}" -ge "${layer[$from]}" ]; then
      echo "layering: $file:$line: $from (layer ${layer[$from]}) includes $target (layer ${layer[$to]})"
      status=1
    fi
  done < <(grep -noE '^#include "cohort/[^"]+"' "$file" | sed -E 's/:#include "/:/; s/"$//')
  # The library never reaches into tests, tools, examples or benchmarks.
  if grep -nE '^#include "(tests|tools|examples|bench)/' "$file"; then
    echo "layering: $file includes a file outside the library"
    status=1
  fi
done < <(git ls-files 'cohort/*.h' 'cohort/*.cpp' 'cohort/*.hpp')

# The example models (examples/models) sit above the whole library: they may
# include any of it and each other, nothing from tests, tools, benchmarks or
# another example; the library never includes them (checked above).
while IFS= read -r file; do
  if grep -nE '^#include "(tests|tools|bench|examples)/' "$file" | grep -vE ':#include "examples/models/'; then
    echo "layering: $file (an example model) includes a file outside the library and the models"
    status=1
  fi
done < <(git ls-files 'examples/models/*.h' 'examples/models/*.cpp')

# Differences between LibTorch releases live in one header: nothing else
# names a LibTorch version.
if git ls-files -z --cached --others --exclude-standard cohort tests tools bench examples | grep -zv '^cohort/core/torch_compat\.h$' |
  xargs -0 grep -nE 'TORCH_VERSION'; then
  echo "layering: only cohort/core/torch_compat.h may name a LibTorch version"
  status=1
fi

[ $status -eq 0 ] && echo "layering: every include points down"
exit $status
