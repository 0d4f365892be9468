# knit's image: knit-proxyd, and the CNI plugin bundle it installs on every node.
#
#   docker build -t knit:dev .        (`make image`)
#
# Base images are pinned to exact releases. To pin the bytes too, append the digest of the tag
# (e.g. `docker buildx imagetools inspect python:3.11.17-slim-bookworm`, the "Digest:" line) as
# ARG PYTHON_IMAGE=python:3.11.17-slim-bookworm@sha256:<digest>, and likewise GO_IMAGE; no
# registry is reachable where this file was written, so no digest could be looked up.
ARG PYTHON_IMAGE=python:3.11.17-slim-bookworm
ARG GO_IMAGE=golang:1.26.8-bookworm

# ---------------------------------------------------------------- the reference portmap plugin
# Built from github.com/containernetworking/plugins at the version tests/go/go.mod pins (go.sum
# verifies every module), for hostPorts: the node's conflist chains knit with portmap.
FROM ${GO_IMAGE} AS portmap
WORKDIR /src
COPY tests/go/go.mod tests/go/go.sum ./
ENV CGO_ENABLED=0 GOFLAGS="-mod=readonly -trimpath -buildvcs=false" GOTOOLCHAIN=local
RUN go build -ldflags="-s -w" -o /portmap \
        github.com/containernetworking/plugins/plugins/meta/portmap

# ---------------------------------------------------------------- the plugin's compiled client
# The executable the runtime starts for every CNI call (cni/client.c), linked statically as the
# Makefile says, so it runs on any node.
FROM ${PYTHON_IMAGE} AS client
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Makefile ./
COPY cni/client.c cni/
RUN make BUILD=/build /build/cni/knit

# ---------------------------------------------------------------- the project and the bundle
# Every dependency installs from a wheel, so no compiler; binutils lives here only, for
# cni.bundle to strip the bundled interpreter and libraries.
FROM ${PYTHON_IMAGE} AS builder
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends binutils \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/knit/venv
ENV PATH=/opt/knit/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cni cni
COPY proxyd proxyd
RUN pip install .
COPY --from=portmap /portmap /portmap
COPY --from=client /build/cni/knit /knit-client
# The plugin as the nodes run it: the client, an interpreter, the cni package and pyroute2,
# relocatable (kind's node images do not promise a python3).
RUN python -m cni.bundle --output /opt/knit/cni-bundle --client /knit-client --plugin /portmap

# ---------------------------------------------------------------- the image
# The same base as the builder, so the venv's interpreter links resolve; no compiler.
# iptables (both flavours, iptables-{nft,legacy}-{save,restore}) is what knit-proxyd and the
# in-daemon plugin execute, nftables brings the libnftables they load (and nft, for operators),
# and kmod's modprobe loads br_netfilter where the kernel has it
# as a module (the DaemonSet's init container, which alone holds CAP_SYS_MODULE); links,
# routes, conntrack, ipsets and IPVS go through netlink.
FROM ${PYTHON_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        iptables nftables kmod \
    && rm -rf /var/lib/apt/lists/*
COPY --from=builder /opt/knit/venv /opt/knit/venv
COPY --from=builder /opt/knit/cni-bundle /opt/knit/cni-bundle
ENV PATH=/opt/knit/venv/bin:$PATH PYTHONUNBUFFERED=1
# root: the DaemonSet grants the capabilities (NET_ADMIN, NET_RAW, SYS_ADMIN) to root in the
# pod, and the host paths knit writes (/etc/cni/net.d, /opt/cni/bin, /var/lib/cni) are root's.
USER root
ENTRYPOINT ["knit-proxyd"]
