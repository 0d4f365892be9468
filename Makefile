# knit: the two commands a newcomer needs are `make lab` and `make test` (see README.md).
SHELL := /bin/bash
ROOT := $(abspath .)
VENV := $(ROOT)/.venv
PY := $(VENV)/bin/python
BUILD := $(ROOT)/build
# libnftables1: knit-proxyd's nftables mode and the plugin's nftables rules load it (nftables
# depends on it; named as their own need). debootstrap: the lab builds its images on a Debian rootfs
# (deploy/lab/image/). containerd and runc: the lab's node3 runs Debian's containerd 1.6 (the
# other nodes the 2.x that go-tools builds), and its ctr imports the images. gcc and libc6-dev:
# the plugin's compiled client (cni/client.c), linked statically.
APT_PACKAGES := iproute2 iptables nftables libnftables1 conntrack ipset iputils-ping procps util-linux mount \
	python3 python3-venv curl ca-certificates unzip git openssl \
	shellcheck debootstrap containerd runc patch gcc libc6-dev

.PHONY: setup system-deps venv cni go-tools e2e-tools e2e test vm-test lint unit fuzz bench-cni bench-proxy bench-proxy-vm bench-netlink bench-policy bench-watch chaos soak lab lab-down \
	controlplane controlplane-down clean image kind-up kind-down

setup: system-deps venv

system-deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing system packages:" $$missing; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

# build/cni is a CNI_PATH directory holding the plugin executable `knit`: the compiled client
# (cni/client.c, static so that it runs on any node), its knit.d/launch settings and the Python
# plugin it execs for in-process calls (deploy/lab/plugin_dir.py). CNI_SOCKET=PATH sends calls
# to a daemon.
CLIENT_CFLAGS := -O2 -static -s -Wall -Wextra -Werror
cni: $(BUILD)/cni/knit $(BUILD)/cni/knit.d/launch

$(BUILD)/cni/knit: cni/client.c
	mkdir -p $(@D)
	$(CC) $(CLIENT_CFLAGS) -o $@.tmp cni/client.c
	mv $@.tmp $@

$(BUILD)/cni/knit.d/launch: venv Makefile deploy/lab/plugin_dir.py
	cd $(ROOT) && $(PY) -m deploy.lab.plugin_dir --output $(BUILD)/cni --socket "$(CNI_SOCKET)"

# libcni driver, the reference plugins (bridge, host-local, portmap, loopback), the control
# plane (etcd, kube-apiserver) and kubectl, and the linters for the deployment files
# (actionlint, kindconfig, dockerfilelint), pinned.
go-tools:
	tests/go/build.sh $(BUILD)

# e2e.test and ginkgo from the pinned kubernetes module (~3 min cold)
e2e-tools:
	tests/go/build.sh --e2e $(BUILD)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

unit: venv
	$(PY) -m pytest -q tests/unit

# The generated-input runs, longer than make test's: FUZZ_EXAMPLES configs and stdins through the
# plugin's call path, an eighth of that through the real executable in namespaces, a twelfth of
# it as API objects through the proxy and policy into a namespace's kernel
FUZZ_EXAMPLES ?= 20000
fuzz: venv
	KNIT_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q tests/unit/test_cni_fuzz.py \
		tests/integration/test_cni_fuzz_kernel.py tests/integration/test_hostile_fuzz_kernel.py

# the VM node's tests (tests/vm) run here too, but for the long ones (KNIT_VM=1)
test: setup cni go-tools e2e-tools lint
	@$(MAKE) --no-print-directory system-deps APT_PACKAGES="$(VM_APT_PACKAGES)"
	KNIT_VM=1 $(PY) -m pytest -q -p no:cacheprovider --durations=40 tests

# the VM node's tests (tests/vm), all of them: Debian's kernel under qemu (TCG), with IPVS and
# SCTP. The first run builds build/vm/ (the kernel package and an initramfs).
VM_APT_PACKAGES := qemu-system-x86
vm-test: setup cni go-tools
	@$(MAKE) --no-print-directory system-deps APT_PACKAGES="$(VM_APT_PACKAGES)"
	KNIT_VM=all $(PY) -m pytest -v -p no:cacheprovider tests/vm

# a real cluster in namespaces (docs/lab.md); e.g. ARGS="--mode nftables"
lab: setup cni go-tools
	cd $(ROOT) && $(PY) -m deploy.lab.lab up $(ARGS)

lab-down:
	cd $(ROOT) && $(PY) -m deploy.lab.lab down

# the upstream e2e network specs against a fresh lab in each proxy mode (iptables, nftables);
# JUnit reports under build/e2e/MODE/. ARGS="--selection conformance" for the CI subset.
e2e: setup cni go-tools e2e-tools
	cd $(ROOT) && $(PY) -m deploy.lab.e2e $(ARGS)

# chaos under churn on a fresh lab per proxy mode (~20 min each); e.g. ARGS="--minutes 5"
chaos: setup cni go-tools
	cd $(ROOT) && $(PY) -m deploy.lab.chaos $(ARGS)

# an hour of churn on a fresh lab: knit-proxyd's memory, threads, fds and sync times, flat?
# (docs/results/DATE-soak.json and .png); e.g. ARGS="--minutes 20 --mode iptables"
soak: setup cni go-tools
	cd $(ROOT) && $(PY) -m bench.soak $(ARGS)

# etcd + kube-apiserver on host loopback, left running; kubeconfig and logs in .controlplane/
controlplane: setup go-tools
	cd $(ROOT) && $(PY) -m deploy.lab.controlplane up --dir $(ROOT)/.controlplane

controlplane-down:
	cd $(ROOT) && $(PY) -m deploy.lab.controlplane down --dir $(ROOT)/.controlplane

bench-cni: setup cni go-tools
	cd $(ROOT) && $(PY) -m bench.cni_bench $(ARGS)

# NetworkPolicy at 1,000 and 10,000 pods with 1,000 policies (~10 min)
bench-policy: setup cni go-tools
	cd $(ROOT) && $(PY) -m bench.policy_bench $(ARGS)

# the daemon's address and UDP conntrack reads and VXLAN peers, against the old ways (~2 min)
bench-netlink: setup
	cd $(ROOT) && $(PY) -m bench.netlink_bench $(ARGS)

# the API server's cost of knit-proxyd's watches beside kube-proxy's, 1/10/50 watchers of 10,000
# pods, and each watcher's memory (~15 min); e.g. ARGS="--pods 1000 --watchers 1,2 --changes 100"
bench-watch: setup go-tools
	cd $(ROOT) && $(PY) -m bench.api_watch_cost $(ARGS)

# knit-proxyd at 1,000 and 10,000 services (~25-30 min); e.g. ARGS="--sizes 1000 --quick"
bench-proxy: setup cni go-tools
	cd $(ROOT) && $(PY) -m bench.proxy_bench $(ARGS)

# the IPVS mode beside kube-proxy's, in a VM node with Debian's kernel (~1 hour at 1,000 and
# 10,000 services); e.g. ARGS="--sizes 1000 --quick"
bench-proxy-vm: setup cni go-tools
	@$(MAKE) --no-print-directory system-deps APT_PACKAGES="$(VM_APT_PACKAGES)"
	cd $(ROOT) && $(PY) -m bench.proxy_vm $(ARGS)

clean:
	rm -rf $(BUILD)

# ---------------------------------------------------------------- kind (needs docker and kind)
# The cluster's name fixes the DaemonSet's API server address (knit-control-plane) and the
# image tag is the one deploy/kubernetes names; KNIT_MANIFESTS may be an overlay of
# deploy/kubernetes (the kind-e2e workflow selects the proxy mode with one).
KNIT_IMAGE := knit:dev
KIND_CLUSTER := knit
KNIT_MANIFESTS ?= deploy/kubernetes
KIND_KUBECTL := kubectl --context kind-$(KIND_CLUSTER)

image:
	docker build -t $(KNIT_IMAGE) .

kind-up: image
	kind create cluster --config deploy/kind/cluster.yaml --name $(KIND_CLUSTER)
	kind load docker-image $(KNIT_IMAGE) --name $(KIND_CLUSTER)
	$(KIND_KUBECTL) apply -k $(KNIT_MANIFESTS)
	$(KIND_KUBECTL) -n kube-system rollout status daemonset/knit --timeout=5m
	$(KIND_KUBECTL) -n kube-system rollout status deployment/coredns --timeout=5m

kind-down:
	kind delete cluster --name $(KIND_CLUSTER)
