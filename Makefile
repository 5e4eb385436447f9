# kvindex: make demo | make test | make bench | make lint
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench bench-quick bench-readme lint venv clean fuzz soak sglang-record
FUZZ_SECONDS ?= 120
SOAK_SECONDS ?= 300

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvindex demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

# The benchmark suite, full size (10-20 minutes): table, bench/results.json, bench/*.png.
# Dynamo's radix tree (the `[bench]` extra) is a baseline when it installs, skipped if not.
bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]' || echo "bench: ai-dynamo-runtime did not install; its column will say skipped"
	$(BIN)/python -m kvindex.bench

# The same cases, smaller (under 2 minutes; what CI can afford).
bench-quick: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]' || echo "bench: ai-dynamo-runtime did not install; its column will say skipped"
	$(BIN)/python -m kvindex.bench --quick

# Rewrite README.md's benchmark section from bench/results.json (after `make bench`).
bench-readme: $(STAMP)
	$(BIN)/python -m kvindex.bench.report --readme README.md --results bench/results.json

lint: $(STAMP)
	$(BIN)/ruff check src tests examples bench
	$(BIN)/ruff format --check src tests examples
	$(BIN)/mypy

# Coverage-guided fuzzing of the decoder + index apply (atheris); hypothesis runs a short
# version in `make test`.
fuzz: $(STAMP)
	$(BIN)/pip install -q -e '.[fuzz]'
	$(BIN)/python fuzz/fuzz_wire.py -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=4096 .fuzz-corpus

# 5 minutes at a steady rate with random faults; reports exactness and memory (not in CI).
soak: $(STAMP)
	$(BIN)/python scripts/soak.py --seconds $(SOAK_SECONDS)

# Re-run SGLang 0.5.23's own cache and publisher live (its venv is built on first use,
# scripts/sglang-venv.sh) and rewrite the recording + answers under tests/data/sglang/.
sglang-record: $(STAMP)
	$(BIN)/python scripts/sglang_record.py

clean:
	rm -rf $(VENV) build *.egg-info
