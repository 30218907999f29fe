# The README's two commands are `make run` and `make test`.
.PHONY: run test model nvrtc build lint check-paths python-test install check-deploy fuzz

# Start the daemon on the default config (CUDA where a GPU is present, else CPU).
run: model
	cargo run --release --bin replayd -- --config config/replayd.toml

# Everything CI runs: lint, every Rust test (needs the model and NVRTC), the
# host-stage micro-benchmarks and the scaling benchmark's smoke run (figures
# printed), the Python client's tests
# against the daemon cargo just built, the deployment files' checks, and a
# bounded fuzz run (FUZZ_SECONDS per target).
test: model nvrtc lint
	cargo test --all-targets
	# Each host stage's figures, printed (debug build, a few seconds: that it
	# runs and what it measures; speed is read from a release build).
	cargo run --quiet --bin replayd-hostbench -- --seconds 0.25 --iters 300
	# The scaling benchmark's flow (issue 35) on this machine's CPUs: 1 and 2
	# simulated devices and zero-time ones, every reply counted (about a
	# minute; figures printed, not judged: the GPU machine's are in
	# docs/perf-log.md).
	SCALE_GPU=0 SCALE_SECONDS=4 SCALE_DEVICES="1 2" SCALE_BIN=target/debug \
	  SCALE_MODEL=models/all-MiniLM-L6-v2 OUT=target/scale-smoke scripts/bench/scale-devices.sh
	scripts/dev/python-tests.sh
	scripts/dev/check-deploy.sh
	scripts/dev/fuzz.sh

model:
	scripts/dev/fetch-model.sh

nvrtc:
	scripts/dev/install-nvrtc.sh

# The release binaries, with the CUDA kernels compiled in for the GPU
# architectures of REPLAYD_EMBED_KERNELS (build.rs; `default` is sm_80, 86,
# 89, 90, 100 and 120; empty: none, compiled at the first start instead).
REPLAYD_EMBED_KERNELS ?= default
build: nvrtc
	REPLAYD_EMBED_KERNELS="$(REPLAYD_EMBED_KERNELS)" cargo build --release

# Formatting, clippy, the API docs without a broken link, and no repository
# path named in a .rs, .md or .toml file that does not exist.
lint: check-paths
	cargo fmt --all -- --check
	cargo clippy --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --quiet

# Repository paths named in .rs, .md and .toml files that do not exist (about
# a second).
check-paths:
	scripts/dev/check-paths.py

# The Python client's tests (clients/python) against the daemon binary
# ($REPLAYD_BIN, else target/debug/replayd, else target/release/replayd).
python-test: model
	scripts/dev/python-tests.sh

# Install the binaries (from target/release; run `make build` first), the service
# config, the systemd unit and its sysusers/tmpfiles files. DESTDIR stages it.
PREFIX ?= /usr/local
DESTDIR ?=
install:
	PREFIX="$(PREFIX)" DESTDIR="$(DESTDIR)" scripts/dev/install.sh

# Check the deployment files: systemd-analyze verify and security (exposure at most
# 3.5), sysusers/tmpfiles, and every Kubernetes manifest against its schema.
check-deploy:
	scripts/dev/check-deploy.sh

# A longer fuzz run: make fuzz FUZZ_SECONDS=600
fuzz:
	FUZZ_SECONDS=$(or $(FUZZ_SECONDS),600) scripts/dev/fuzz.sh
