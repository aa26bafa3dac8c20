#!/bin/bash
# Build .gpu/ (git-ignored) for a lent GPU machine: the packages its image lacks, the SmolLM2 GGUF in two parts
# (one call carries at most 64 MiB), the data the jobs read, a bare clone for provenance, and these scripts with
# the job lanes. Usage, from the repository root: benchmarks/device/bundle.sh LANE_FILE... (see benchmarks/RESULTS.md).
# benchmarks/device/bundle.sh --check: the bundle of issue 44's GPU check (gpu_check.sh), small enough for one call
# (no GGUF: smollm2-135m is built there from its config, .gpu/smollm2, with random weights; of the data only a
# 600-record E2E slice, .gpu/e2e_small, for its opt-in finetune step).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
CHECK=false
if [ "${1:-}" = --check ]; then CHECK=true; shift; fi
mkdir -p .git/info && { grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude; }
rm -rf .gpu && mkdir -p .gpu/whl .gpu/lanes .gpu/smollm2
PIP=".venv/bin/pip"
PLATFORM="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
# versions from constraints.txt; the image has torch, accelerate, sacrebleu and the rest (peft, but not our version)
for name in typer click prv-accountant dp-accounting dm-tree gguf nltk transformers defusedxml opacus peft; do
  pin=$(grep -i "^${name//-/[-_]}==" constraints.txt)
  $PIP download -q --no-deps $PLATFORM -d .gpu/whl "$pin"
done
$PIP wheel -q --no-deps -w .gpu/whl "$(grep -i '^rouge[-_]score==' constraints.txt)"  # an sdist only
smollm2=$(.venv/bin/python -c "from dptext.models.offline import smollm2_folder; print(smollm2_folder())")
find "$smollm2" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} .gpu/smollm2/ \;  # config and tokenizer
if $CHECK; then  # gpu_check.sh --only finetune: a few hundred E2E records (its csv files hold quoted newlines)
  .venv/bin/python - <<'PY'
import csv
from pathlib import Path

source, target = Path("../shared/data/e2e_nlg"), Path(".gpu/e2e_small")
target.mkdir()
for name, rows in (("trainset.csv", 600), ("devset.csv", 40), ("testset_w_refs.csv", 40)):
    with open(source / name, newline="", encoding="utf-8") as handle, \
            open(target / name, "w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out)
        for index, row in enumerate(csv.reader(handle)):
            if index > rows:
                break
            writer.writerow(row)
PY
else
  gguf=$(.venv/bin/python -c "import dptext.models.offline as o, importlib.util as u, pathlib as p; \
print(p.Path(u.find_spec(o.SMOLLM2_PACKAGE).origin).parent / o.SMOLLM2_GGUF)")
  head -c 52000000 "$gguf" > .gpu/partA && tail -c +52000001 "$gguf" > .gpu/partB
  sha256sum "$gguf" | cut -c1-64 > .gpu/gguf.sha256
  tar -C ../shared/data -cJf .gpu/data.tar.xz e2e_nlg amazon_multidomain_sentiment
fi
git clone -q --bare . .gpu/git
cp benchmarks/device/{go,poll,env}.sh .gpu/
for lane in "$@"; do cp "$lane" .gpu/lanes/; done
du -sh .gpu/*
