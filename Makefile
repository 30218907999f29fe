# The README's two commands are `make run` and `make test`.
.PHONY: run test model nvrtc build lint python-test

# Start the daemon on the default config (CUDA where a GPU is present, else CPU).
run: model
	cargo run --release --bin replayd -- --config config/replayd.toml

# Everything CI runs: lint, then every test (needs the model and NVRTC).
test: model nvrtc lint
	cargo test --all-targets

model:
	scripts/fetch-model.sh

nvrtc:
	scripts/install-nvrtc.sh

build:
	cargo build --release

lint:
	cargo fmt --all -- --check
	cargo clippy --all-targets -- -D warnings

# The Python client's tests (clients/python) against the daemon binary
# ($REPLAYD_BIN, else target/debug/replayd, else target/release/replayd).
python-test: model
	scripts/python-tests.sh
