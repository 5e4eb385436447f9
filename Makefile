# kvindex: make demo | make test | make bench | make lint
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench bench-quick bench-readme lint venv clean fuzz sanitize soak sglang-record
FUZZ_SECONDS ?= 120
SOAK_SECONDS ?= 300

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip 'setuptools>=77'
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP) $(CORE_STAMP)

# The C extensions again when any of their sources change (an editable install built them
# once): the core's csrc/, and the C receive and lookup thread beside their Python faces.
CORE_STAMP := $(VENV)/.core-built
C_SOURCES := $(wildcard src/kvindex/index/csrc/*) $(wildcard src/kvindex/*/*.c src/kvindex/*/*.h) \
	$(wildcard src/kvindex/*/*/*.c)
$(CORE_STAMP): $(STAMP) $(C_SOURCES)
	$(BIN)/python setup.py -q build_ext --inplace
	touch $(CORE_STAMP)

venv: $(CORE_STAMP)

demo: $(CORE_STAMP)
	$(BIN)/kvindex demo

# The index, wire, subscriber and interop tests run twice: on the compiled code (the core,
# the C receive), then on the pure-Python
# reference (KVINDEX_PURE=1); tests/test_core.py holds the two to identical answers.
# test_fastpath_serve.py too: serve's HTTP protocol with every token lookup handed to the
# route, as a build without a compiler serves.
PURE_TESTS := tests/test_index.py tests/test_index_model.py tests/test_core.py \
	tests/test_wire.py tests/test_fuzz.py tests/test_sglang_interop.py \
	tests/test_subscriber.py tests/test_hostile.py \
	tests/test_vllm_releases.py tests/test_interop_releases.py tests/interop \
	tests/test_runtime_membership.py tests/test_membership_stress.py \
	tests/test_fastpath_serve.py

test: $(CORE_STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=30
	KVINDEX_PURE=1 $(BIN)/python -m pytest -q -p no:cacheprovider $(PURE_TESTS)

# The benchmark suite, full size (10-20 minutes): table, bench/results.json, bench/*.png.
# Dynamo (the `[bench]` extra: its standalone indexer end to end, its radix tree in process)
# is a baseline when it installs, skipped if not.
bench: $(CORE_STAMP)
	$(BIN)/pip install -q -e '.[bench]' || echo "bench: ai-dynamo-runtime did not install; its column will say skipped"
	$(BIN)/python -m kvindex.bench

# The same cases, smaller (a minute or two; what CI can afford).
bench-quick: $(CORE_STAMP)
	$(BIN)/pip install -q -e '.[bench]' || echo "bench: ai-dynamo-runtime did not install; its column will say skipped"
	$(BIN)/python -m kvindex.bench --quick

# Rewrite README.md's benchmark section from bench/results.json (after `make bench`).
bench-readme: $(STAMP)
	$(BIN)/python -m kvindex.bench.report --readme README.md --results bench/results.json

lint: $(STAMP)
	$(BIN)/ruff check src tests examples bench fuzz sanitize
	$(BIN)/ruff format --check src tests examples fuzz sanitize
	$(BIN)/mypy

# Coverage-guided fuzzing of the compiled core against the pure-Python reference (atheris;
# fuzz/README.md): payload programs on both, every verdict, count, pool, lookup and tree
# compared, no C byte left behind. With clang (Debian's clang-14 and libclang-rt-14-dev)
# the C runs instrumented, in a copy of the package under build/fuzz-native: its coverage
# guides the fuzzer and ASan + UBSan stop it at the first memory error. A finding is saved
# as fuzz/crash-*, fuzz/reduce.py shrinks it. `make test` replays fuzz/corpus and a short
# seeded run (tests/test_core_fuzz.py).
FUZZ_CC ?= $(shell command -v clang-14 || command -v clang)
FUZZ_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined \
	-fsanitize-coverage=inline-8bit-counters,pc-table,trace-cmp -g -fno-omit-frame-pointer
fuzz: $(CORE_STAMP)
	$(BIN)/pip install -q -e '.[fuzz]'
	mkdir -p build/fuzz-work
ifeq ($(FUZZ_CC),)
	@echo "fuzz: no clang here: only the Python guides the fuzzer (apt-get install clang-14)"
	$(BIN)/python fuzz/fuzz_core.py -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=4096 \
		-timeout=60 -artifact_prefix=fuzz/ build/fuzz-work fuzz/corpus
else
	fuzz/build.sh build/fuzz-native $(FUZZ_CC) "$(FUZZ_FLAGS)"
	fuzz/asan_libfuzzer.sh build/asan_with_fuzzer.so $(FUZZ_CC)
	LD_PRELOAD=$(CURDIR)/build/asan_with_fuzzer.so ASAN_OPTIONS=detect_leaks=0 \
		PYTHONPATH=$(CURDIR)/build/fuzz-native $(BIN)/python fuzz/fuzz_core.py \
		-max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=4096 -timeout=60 \
		-artifact_prefix=fuzz/ build/fuzz-work fuzz/corpus
endif

# The C extensions under ASan + UBSan (gcc) with LeakSanitizer, built apart in
# build/sanitize: the tests that drive the C (allocation failures injected included), then
# ThreadSanitizer (build/tsan) over the C ingest path and ingest + membership churn +
# every kind of lookup at once, then a churn under valgrind (sanitize/run.sh;
# docs/c-review.md says what each finds).
sanitize: $(CORE_STAMP)
	bash sanitize/run.sh

# 5 minutes at a steady rate with random faults; reports exactness and memory (not in CI).
soak: $(STAMP)
	$(BIN)/python scripts/soak.py --seconds $(SOAK_SECONDS)

# Re-run SGLang 0.5.23's own cache and publisher live (its venv is built on first use,
# scripts/sglang-venv.sh) and rewrite the recording + answers under tests/data/sglang/.
sglang-record: $(STAMP)
	$(BIN)/python scripts/sglang_record.py

clean:
	rm -rf $(VENV) build *.egg-info
