# ebb: `make run` serves a small embedded model; `make test` runs the tests.
# Both install what they need first (scripts/install-deps.sh).

GO       ?= go
BIN      := bin/ebb
MODEL    ?= assets/default-model
PORT     ?= 30000
# go-nvml's headers mark some NVML calls deprecated; the warnings are noise.
export CGO_CFLAGS ?= -O2 -Wno-deprecated-declarations

.PHONY: all build run test deps vet fmt clean

all: build

deps:
	@./scripts/install-deps.sh

build: deps
	$(GO) build -o $(BIN) ./cmd/ebb

# The default model is a 15M-parameter Qwen3 trained on Go's source tree
# (tools/train_default_model.py): it writes Go.
run: build
	./$(BIN) serve --model $(MODEL) --port $(PORT)

vet:
	$(GO) vet ./...

test: deps
	@test -z "$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))" || { gofmt -l .; echo "gofmt: files above need formatting"; exit 1; }
	$(GO) vet ./...
	$(GO) test -count=1 ./...

fmt:
	gofmt -w $$(git ls-files '*.go')

clean:
	rm -rf bin .cache
