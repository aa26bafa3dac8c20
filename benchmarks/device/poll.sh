#!/bin/bash
# On the GPU machine: wait up to $1 seconds (or until no queue runs), show each lane, pack the small files to $OUT.
cd "$(dirname "$0")/.."
end=$((SECONDS + $1))
while [ $SECONDS -lt $end ] && pgrep -f results_queue.py > /dev/null; do sleep 10; done
for lane in /tmp/runs/*/; do
  echo "== $lane"; tail -n 3 "$lane/queue.log"
  for log in "$lane"*.log "$lane"*/*.log; do [ -f "$log" ] && echo "-- $log: $(tail -c 300 "$log" | tr '\r' '\n' | tail -n 1)"; done
done
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
tar -C /tmp -czf "$OUT/runs.tgz" --exclude=model --exclude=checkpoints --exclude='*.safetensors' --exclude='*.pt' runs
