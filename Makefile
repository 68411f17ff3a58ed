# WeightBridge: two commands do everything on a fresh Debian 12 machine.
#   make demo   install what is missing, build, run the main job
#   make test   install what is missing, build //..., run every test
SHELL := /bin/bash
BAZEL ?= bazel
BAZEL_FLAGS ?=

# Debian packages the build, the tests and the demo need.
DEB_PACKAGES := bazel-bootstrap bazel-rules-java protobuf-compiler protobuf-compiler-grpc \
  libgrpc++-dev libprotobuf-dev libabsl-dev libgtest-dev libgmock-dev libxxhash-dev \
  nlohmann-json3-dev prometheus-cpp-dev libssl-dev zlib1g-dev openssl iperf3 \
  python3-grpcio python3-protobuf python3-numpy python3-matplotlib python3-yaml \
  clang-14 libclang-rt-14-dev

.PHONY: deps build test demo fuzz asan tsan clean help

help:
	@echo "make demo   - install missing packages, build, run the main job"
	@echo "make test   - install missing packages, build and run every test"
	@echo "make build  - build //..."
	@echo "make fuzz   - build the libFuzzer targets with clang and fuzz each for FUZZ_SECONDS (default 600)"
	@echo "make asan   - every test under AddressSanitizer (bazel test --config=asan //...)"
	@echo "make tsan   - every test under ThreadSanitizer (bazel test --config=tsan //...)"

deps:
	@bash tools/install_deps.sh $(DEB_PACKAGES)

build: deps
	$(BAZEL) build $(BAZEL_FLAGS) //...

test: deps
	@bash tools/run_tests.sh $(BAZEL_FLAGS)

demo: deps
	@bash tools/demo.sh

# Long fuzzing by hand (CI runs a few seconds per target in //tests/fuzz:fuzz_smoke_test). New inputs
# are kept in out/fuzz/corpus; crashes land in out/fuzz/artifacts. See docs/fuzzing.md.
FUZZ_SECONDS ?= 600
fuzz: deps
	bash tests/fuzz/build_and_run.sh --out out/fuzz --seconds $(FUZZ_SECONDS) --keep-corpus out/fuzz/corpus \
	  --artifacts out/fuzz/artifacts $(FUZZ_TARGETS)

# Sanitizer runs (docs/sanitizers.md). Each has its own output directory (k8-dbg-asan / -tsan), so
# they do not overwrite the normal build; a first run rebuilds everything (about 25 min on 2 cores).
asan: deps
	@bash tools/run_tests.sh --config=asan $(BAZEL_FLAGS)

tsan: deps
	@bash tools/run_tests.sh --config=tsan $(BAZEL_FLAGS)

clean:
	$(BAZEL) clean
