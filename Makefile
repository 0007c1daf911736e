# dos — build, test and demo targets. `make help` lists them.
GO      ?= go
BIN     ?= bin
PKGS    := ./...

.PHONY: help test vet fmt-check test-short demo bench gpu-bins gpu-test gpu-check clean

help:
	@echo "make demo       run the main job on its embedded default"
	@echo "make test       vet, gofmt check, go test -race ./..., and the allocation tests without -race (what CI runs)"
	@echo "make bench      CPU AdamW benchmarks (params/s, GB/s) against copy and the naive loop"
	@echo "make gpu-bins   build bin/dos and one test binary per package for the GPU machine"
	@echo "make gpu-test   run bin/test/* with DOS_REQUIRE_GPU=1 (on the GPU machine)"
	@echo "make gpu-check  the GPU machine's checks: PyTorch cases, selftest, Python safetensors, tests, bench"
	@echo "make test-short go test -short, no race detector (quick)"
	@echo "make clean      remove bin/"

test: vet fmt-check
	$(GO) test -race -count=1 $(PKGS)
	$(GO) test -count=1 -run 'NoAllocs' $(PKGS)

vet:
	$(GO) vet $(PKGS)

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi

test-short:
	$(GO) test -short $(PKGS)

# The main job: dos train on its embedded default (Newton's Opticks, a 4-layer
# byte-level GPT-2), checkpointing into bin/demo-ckpt, after the selftest.
demo:
	$(GO) build -o $(BIN)/dos ./cmd/dos
	$(BIN)/dos selftest | grep -E '^selftest:|no GPU backend'
	rm -rf $(BIN)/demo-ckpt
	$(BIN)/dos train --ckpt-dir $(BIN)/demo-ckpt --summary-json $(BIN)/demo-summary.json
	@cat $(BIN)/demo-summary.json

bench:
	$(GO) test -run '^$$' -bench . -benchtime 5x ./adam/

# Binaries for the GPU machine, which has no Go toolchain: the CLI and one
# test binary per package, named after the package path (adam/adamcase ->
# adam_adamcase.test). scripts/gpu-test.sh runs them there.
gpu-bins:
	@mkdir -p $(BIN)/test
	CGO_ENABLED=0 $(GO) build -ldflags='-s -w' -o $(BIN)/dos ./cmd/dos
	@for d in $$($(GO) list -f '{{if or .TestGoFiles .XTestGoFiles}}{{.Dir}}{{end}}' $(PKGS)); do \
		rel=$${d#$(CURDIR)/}; [ "$$rel" = "$(CURDIR)" ] && rel=.; \
		name=$$(echo $$rel | tr / _); \
		echo "CGO_ENABLED=0 go test -c -o $(BIN)/test/$$name.test ./$$rel"; \
		CGO_ENABLED=0 $(GO) test -c -ldflags='-s -w' -o $(BIN)/test/$$name.test ./$$rel || exit 1; \
	done
	@echo "CGO_ENABLED=1 go test -race -c -o $(BIN)/race/cuda.test ./cuda (the context rule under the race detector)"
	@mkdir -p $(BIN)/race
	CGO_ENABLED=1 $(GO) test -race -c -ldflags='-s -w' -o $(BIN)/race/cuda.test ./cuda

gpu-test:
	bash scripts/gpu-test.sh

gpu-check:
	bash scripts/gpu-check.sh

clean:
	rm -rf $(BIN)
