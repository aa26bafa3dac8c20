#!/bin/bash
# On the GPU machine: install once (the first call left /tmp/partA and /tmp/data.tar.xz there), then start one
# results_queue per lane file in .gpu/lanes (LANES="l1 l2" picks some), each in its own session so it outlives the call.
cd "$(dirname "$0")/.."
bash benchmarks/device/install.sh || exit 1  # the tracked copy: it travels with the tree
source .gpu/env.sh
for lane in ${LANES:-$(ls .gpu/lanes)}; do
  setsid nohup python3 benchmarks/results_queue.py .gpu/lanes/${lane%.txt}.txt --runs /tmp/runs/${lane%.txt} \
    --data /tmp/data >> /tmp/runs/${lane%.txt}.out 2>&1 < /dev/null &
done
sleep 5; echo started
