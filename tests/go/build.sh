#!/usr/bin/env bash
# Build knit's Go test tooling:
#   OUTDIR/tools/cnidriver                          (libcni driver, ./cmd/cnidriver)
#   OUTDIR/refcni/{bridge,host-local,portmap,loopback}  (reference CNI plugins,
#                                                    pinned by go.mod/go.sum)
#   OUTDIR/controlplane/{etcd,kube-apiserver,kubectl}  (a real control plane and its client,
#                                                    pinned by controlplane/go.mod/go.sum)
#   OUTDIR/controlplane/{kubelet,kube-controller-manager,kube-scheduler,kube-proxy}
#                                                   (the rest of a node and cluster, same pin)
#   OUTDIR/node/{containerd,containerd-shim-runc-v2,ctr}  (containerd 2.x, pinned by
#                                                    node/go.mod/go.sum; runc is Debian's)
#   OUTDIR/node/coredns                             (cluster DNS, pinned by coredns/go.mod/go.sum)
#   OUTDIR/images/pause                             (pod sandbox process, ./cmd/pause)
#   OUTDIR/images/agnhost, localhost.{crt,key}      (Kubernetes' e2e test image binary and
#                                                    its porter's TLS certificate,
#                                                    pinned with kubernetes in controlplane/)
#   OUTDIR/tools/kubeproxyconfig                    (kube-proxy's own config loading and
#                                                    validation, ./controlplane/cmd/kubeproxyconfig)
#   OUTDIR/tools/{actionlint,kindconfig,dockerfilelint}  (linters for .github/workflows,
#                                                    deploy/kind and the Dockerfile, pinned by
#                                                    lint/go.mod/go.sum)
#
# With --e2e it builds only (slow: e2e.test takes minutes on a cold cache):
#   OUTDIR/e2e/e2e.test                             (`go test -c k8s.io/kubernetes/test/e2e`)
#   OUTDIR/e2e/ginkgo                               (its runner, at the version kubernetes
#                                                    requires; both pinned in controlplane/)
#   OUTDIR/images/regression-issue-74839            (the Conntrack spec's raw-socket client,
#                                                    a static binary, same pin)
#   OUTDIR/e2e/cnp-conformance.test                 (network-policy-api's ClusterNetworkPolicy
#                                                    conformance suite, pinned by
#                                                    netpolapi/go.mod/go.sum, with
#                                                    netpolapi/no-sctp.patch applied)
#
# usage: tests/go/build.sh [--e2e] OUTDIR
#
# Uses `go` from PATH (or /usr/local/go/bin/go) if it is at least the highest `go`
# version of the go.mod files; otherwise downloads that toolchain from the Go module proxy
# (module golang.org/toolchain), verifies it against the checksum database
# (through the proxy) and caches it in ${XDG_CACHE_HOME:-$HOME/.cache}/knit/go.
#
# Environment:
#   KNIT_FORCE_GO_BOOTSTRAP=1   ignore installed go, always use the bootstrapped one
#   KNIT_GO_VERSION=1.24.6      toolchain version to bootstrap (default: go.mod's)
#   KNIT_GO_CACHE=DIR           where bootstrapped toolchains live
#   KNIT_FORCE_BUILD=1          rebuild even if outputs look up to date
#   GOPROXY                     first proxy in the list is used for the bootstrap
#   GOSUMDB=off                 skip the checksum check of the bootstrapped toolchain
set -euo pipefail

log() { printf 'build.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

E2E=0
if [ "${1:-}" = --e2e ]; then E2E=1; shift; fi
[ $# -eq 1 ] && [ -n "$1" ] || { echo "usage: $0 [--e2e] OUTDIR" >&2; exit 2; }

SRC_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CP_DIR=$SRC_DIR/controlplane
LINT_DIR=$SRC_DIR/lint
NODE_DIR=$SRC_DIR/node
DNS_DIR=$SRC_DIR/coredns
mkdir -p "$1"
OUT_DIR=$(cd "$1" && pwd)

REF_PKG=github.com/containernetworking/plugins/plugins
REF_PLUGINS=(main/bridge ipam/host-local meta/portmap main/loopback)
KUBE_NODE=(kubelet kube-controller-manager kube-scheduler kube-proxy)
CTRD_PKG=github.com/containerd/containerd/v2
LINT_TOOLS=(actionlint kindconfig dockerfilelint)
if [ "$E2E" = 1 ]; then
    OUTPUTS=("$OUT_DIR/e2e/e2e.test" "$OUT_DIR/e2e/ginkgo")
    OUTPUTS+=("$OUT_DIR/images/regression-issue-74839" "$OUT_DIR/e2e/cnp-conformance.test")
else
    OUTPUTS=("$OUT_DIR/tools/cnidriver")
    for p in "${REF_PLUGINS[@]}"; do OUTPUTS+=("$OUT_DIR/refcni/${p##*/}"); done
    OUTPUTS+=("$OUT_DIR/controlplane/etcd" "$OUT_DIR/controlplane/kube-apiserver")
    OUTPUTS+=("$OUT_DIR/controlplane/kubectl" "$OUT_DIR/tools/kubeproxyconfig")
    for t in "${KUBE_NODE[@]}"; do OUTPUTS+=("$OUT_DIR/controlplane/$t"); done
    for t in containerd containerd-shim-runc-v2 ctr coredns; do OUTPUTS+=("$OUT_DIR/node/$t"); done
    OUTPUTS+=("$OUT_DIR/images/pause" "$OUT_DIR/images/agnhost")
    OUTPUTS+=("$OUT_DIR/images/localhost.crt" "$OUT_DIR/images/localhost.key")
    for t in "${LINT_TOOLS[@]}"; do OUTPUTS+=("$OUT_DIR/tools/$t"); done
fi

# ---------------------------------------------------------------- up to date?
# The inputs are every go source, go.mod and go.sum under SRC_DIR: all the modules.
up_to_date() {
    [ "${KNIT_FORCE_BUILD:-0}" = 1 ] && return 1
    local o newer
    for o in "${OUTPUTS[@]}"; do
        [ -x "$o" ] || return 1
        newer=$(find "$SRC_DIR" \( -name '*.go' -o -name go.mod -o -name go.sum -o -name build.sh \
                     -o -name '*.patch' \) \
                     -type f -newer "$o" -print -quit)
        [ -z "$newer" ] || return 1
    done
    return 0
}
if up_to_date; then
    log "outputs in $OUT_DIR are up to date (KNIT_FORCE_BUILD=1 to rebuild)"
    exit 0
fi

# ---------------------------------------------------------------- toolchain
# version_ge A B: A >= B (plain dotted versions, as printed by `go version`)
version_ge() { [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n1)" = "$2" ]; }

REQ_GO=0
for mod in "$SRC_DIR/go.mod" "$CP_DIR/go.mod" "$LINT_DIR/go.mod" "$NODE_DIR/go.mod" "$DNS_DIR/go.mod"; do
    v=$(sed -n 's/^go[[:space:]]\{1,\}\([0-9][0-9a-z.]*\).*/\1/p' "$mod" | head -n1)
    [ -n "$v" ] || die "no go directive in $mod"
    version_ge "$REQ_GO" "$v" || REQ_GO=$v
done

# go_version GO: prints e.g. 1.24.2, or nothing if GO does not run
go_version() {
    local v
    v=$(GOTOOLCHAIN=local "$1" env GOVERSION 2>/dev/null) || return 0
    v=${v#go}; v=${v%%[ -]*}
    printf '%s' "$v"
}

GO=""
if [ "${KNIT_FORCE_GO_BOOTSTRAP:-0}" != 1 ]; then
    for cand in "$(command -v go 2>/dev/null || true)" /usr/local/go/bin/go; do
        [ -n "$cand" ] && [ -x "$cand" ] || continue
        v=$(go_version "$cand")
        if [ -n "$v" ] && version_ge "$v" "$REQ_GO"; then GO=$cand; break; fi
        log "ignoring $cand (go ${v:-?} < required $REQ_GO)"
    done
fi

bootstrap_go() {
    local ver=${KNIT_GO_VERSION:-$REQ_GO}
    # since go1.21 the first release of a line is 1.N.0
    case $ver in
        1.[0-9]|1.1[0-9]|1.20) ;;
        [0-9]*.[0-9]*.*) ;;
        *[!0-9.]*) ;;                      # rc/beta: use as is
        *) ver=$ver.0 ;;
    esac
    local os arch
    os=$(uname -s | tr '[:upper:]' '[:lower:]')
    case $(uname -m) in
        x86_64|amd64) arch=amd64 ;;
        aarch64|arm64) arch=arm64 ;;
        armv6l|armv7l) arch=armv6l ;;
        i?86) arch=386 ;;
        ppc64le) arch=ppc64le ;;
        s390x) arch=s390x ;;
        riscv64) arch=riscv64 ;;
        *) die "unsupported machine $(uname -m)" ;;
    esac
    local modver="v0.0.1-go$ver.$os-$arch"
    local cache=${KNIT_GO_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/knit/go}
    local root="$cache/go$ver.$os-$arch"
    if [ -x "$root/bin/go" ] && [ -f "$root/.knit-complete" ]; then
        GO="$root/bin/go"; return
    fi

    local proxy="" p
    IFS=',|' read -r -a _proxies <<<"${GOPROXY:-https://proxy.golang.org,direct}"
    for p in "${_proxies[@]}"; do
        case $p in direct|off|"") ;; *) proxy=${p%/}; break ;; esac
    done
    [ -n "$proxy" ] || die "GOPROXY=${GOPROXY:-} names no proxy to bootstrap go from"

    log "bootstrapping go$ver from $proxy (golang.org/toolchain@$modver) into $root"
    mkdir -p "$cache"
    local tmp
    tmp=$(mktemp -d "$cache/.tmp.XXXXXX")
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'" EXIT
    curl -fsSL --retry 3 -o "$tmp/go.zip" "$proxy/golang.org/toolchain/@v/$modver.zip" \
        || die "download of $proxy/golang.org/toolchain/@v/$modver.zip failed"
    (cd "$tmp" && unzip -q go.zip && rm go.zip) || die "unzip failed"
    local top="$tmp/golang.org/toolchain@$modver"
    [ -f "$top/bin/go" ] || die "unexpected zip layout (no golang.org/toolchain@$modver/bin/go)"

    # Verify the module hash (h1:, Go's dirhash) against the checksum database.
    if [ "${GOSUMDB:-}" = off ]; then
        log "GOSUMDB=off: not verifying the toolchain checksum"
    else
        local want got hex
        want=$(curl -fsSL --retry 3 "$proxy/sumdb/sum.golang.org/lookup/golang.org/toolchain@$modver" 2>/dev/null |
               awk -v m="$modver" '$1=="golang.org/toolchain" && $2==m {print $3; exit}') || true
        if [ -z "$want" ]; then
            die "could not fetch the checksum of golang.org/toolchain@$modver via $proxy/sumdb (GOSUMDB=off to skip)"
        fi
        hex=$(cd "$tmp" && find "golang.org/toolchain@$modver" -type f -print0 | LC_ALL=C sort -z |
              xargs -0 sha256sum | sha256sum | cut -c1-64)
        got="h1:$(printf "$(printf '%s' "$hex" | sed 's/../\\x&/g')" | base64 -w0)"
        [ "$got" = "$want" ] || die "toolchain checksum mismatch: got $got, sumdb says $want"
        log "verified $modver $got"
    fi

    # Module zips carry no file modes; make the binaries executable, as cmd/go does.
    chmod -R a+rX "$top"
    find "$top/bin" "$top/pkg/tool" -type f -exec chmod a+x {} +
    touch "$top/.knit-complete"
    rm -rf "$root"
    mv "$top" "$root"
    rm -rf "$tmp"
    trap - EXIT
    GO="$root/bin/go"
}

if [ -z "$GO" ]; then
    bootstrap_go
    v=$(go_version "$GO")
    [ -n "$v" ] && version_ge "$v" "$REQ_GO" || die "bootstrapped $GO does not work (version '${v}')"
fi
log "using go $(go_version "$GO") at $GO (the go.mod files require $REQ_GO)"

# ---------------------------------------------------------------- build
export GOTOOLCHAIN=local CGO_ENABLED=0
# go.sum is the pin: refuse to change go.mod/go.sum while building.
export GOFLAGS="-mod=readonly -buildvcs=false -trimpath"

# timed WHAT CMD...: run CMD and log how long it took
timed() {
    local what=$1 start
    shift
    start=$(date +%s)
    "$@"
    log "built $what in $(( $(date +%s) - start ))s"
}

# Report the pinned release as the version (clients and e2e read it), as Kubernetes' own
# build does; a plain `go build` reports v0.0.0-master.
cd "$CP_DIR"
kube=$("$GO" list -m -f '{{.Version}}' k8s.io/kubernetes)
IFS=. read -r major minor _ <<<"${kube#v}"
vpkg=k8s.io/component-base/version
kube_ldflags="-s -w -X $vpkg.gitVersion=$kube -X $vpkg.gitMajor=$major"
kube_ldflags+=" -X $vpkg.gitMinor=$minor -X $vpkg.gitTreeState=clean"

if [ "$E2E" = 1 ]; then
    mkdir -p "$OUT_DIR/e2e"
    # ginkgo's version is the one k8s.io/kubernetes requires (go.mod pins it explicitly too).
    timed "e2e/ginkgo" "$GO" build -ldflags='-s -w' -o "$OUT_DIR/e2e/ginkgo" \
        github.com/onsi/ginkgo/v2/ginkgo
    # Test files of a dependency: e2edeps/ keeps their modules in go.mod/go.sum.
    timed "e2e/e2e.test" "$GO" test -c -ldflags="$kube_ldflags" -o "$OUT_DIR/e2e/e2e.test" \
        k8s.io/kubernetes/test/e2e
    mkdir -p "$OUT_DIR/images"
    regression=regression-issue-74839
    timed "images/$regression" env CGO_ENABLED=0 "$GO" build -ldflags='-s -w' \
        -o "$OUT_DIR/images/$regression" "k8s.io/kubernetes/test/images/$regression"
    # The suite's manifests are embedded (go:embed), so it is patched in a copy of its module.
    cd "$SRC_DIR/netpolapi"
    npa=$("$GO" mod download -json sigs.k8s.io/network-policy-api | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
    [ -d "$npa" ] || die "network-policy-api was not downloaded"
    rm -rf "$OUT_DIR/src/network-policy-api"
    mkdir -p "$OUT_DIR/src"
    cp -r "$npa" "$OUT_DIR/src/network-policy-api"
    chmod -R u+w "$OUT_DIR/src/network-policy-api"
    patch -s -p1 -d "$OUT_DIR/src/network-policy-api" < no-sctp.patch
    cd "$OUT_DIR/src/network-policy-api"
    timed "e2e/cnp-conformance.test" "$GO" test -c -ldflags='-s -w' \
        -o "$OUT_DIR/e2e/cnp-conformance.test" ./conformance
    touch "${OUTPUTS[@]}"
    exit 0
fi

mkdir -p "$OUT_DIR/tools" "$OUT_DIR/refcni" "$OUT_DIR/controlplane" "$OUT_DIR/node" "$OUT_DIR/images"
cd "$SRC_DIR"
pkgs=()
for p in "${REF_PLUGINS[@]}"; do pkgs+=("$REF_PKG/$p"); done
timed "tools/cnidriver" "$GO" build -ldflags='-s -w' -o "$OUT_DIR/tools/cnidriver" ./cmd/cnidriver
timed "refcni/*" "$GO" build -ldflags='-s -w' -o "$OUT_DIR/refcni/" "${pkgs[@]}"
timed "images/pause" "$GO" build -ldflags='-s -w' -o "$OUT_DIR/images/pause" ./cmd/pause

cd "$CP_DIR"
timed "controlplane/etcd" "$GO" build -ldflags='-s -w' -o "$OUT_DIR/controlplane/etcd" \
    go.etcd.io/etcd/server/v3
timed "controlplane/kube-apiserver" "$GO" build -ldflags="$kube_ldflags" \
    -o "$OUT_DIR/controlplane/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver
timed "controlplane/kubectl" "$GO" build -ldflags="$kube_ldflags" \
    -o "$OUT_DIR/controlplane/kubectl" k8s.io/kubernetes/cmd/kubectl
for t in "${KUBE_NODE[@]}"; do
    timed "controlplane/$t" "$GO" build -ldflags="$kube_ldflags" \
        -o "$OUT_DIR/controlplane/$t" "k8s.io/kubernetes/cmd/$t"
done
timed "tools/kubeproxyconfig" "$GO" build -ldflags='-s -w' \
    -o "$OUT_DIR/tools/kubeproxyconfig" ./cmd/kubeproxyconfig
# agnhost is a package of k8s.io/kubernetes (no go.mod of its own), so it is pinned with it.
# Its image tag is test/images/agnhost/VERSION: 2.66.1 in kubernetes v1.37.1, the tag that
# v1.37.1's e2e.test asks for (test/utils/image/manifest.go), so this is the same source.
agnhost_dir=$("$GO" list -f '{{.Dir}}' k8s.io/kubernetes/test/images/agnhost)
agnhost_ver=$(cat "$agnhost_dir/VERSION")
timed "images/agnhost" "$GO" build -ldflags="-s -w -X main.Version=$agnhost_ver" \
    -o "$OUT_DIR/images/agnhost" k8s.io/kubernetes/test/images/agnhost
# porter's TLS ports serve with these (the image has them at /), as upstream's Dockerfile adds
install -m 0644 "$agnhost_dir/porter/localhost.crt" "$agnhost_dir/porter/localhost.key" \
    "$OUT_DIR/images/"

# containerd's own Makefile builds the shim with CGO_ENABLED=0 and tags no_grpc; the daemon
# and ctr need cgo only for btrfs (tag no_btrfs) and PKCS#11 image decryption (left out).
cd "$NODE_DIR"
ctrd=$("$GO" list -m -f '{{.Version}}' "$CTRD_PKG")
ctrd_ldflags="-s -w -X $CTRD_PKG/version.Version=$ctrd -X $CTRD_PKG/version.Package=$CTRD_PKG"
ctrd_tags="urfave_cli_no_docs,no_btrfs,no_devmapper,no_zfs,no_aufs"
for t in containerd ctr; do
    timed "node/$t" "$GO" build -tags "$ctrd_tags" -ldflags="$ctrd_ldflags" \
        -o "$OUT_DIR/node/$t" "$CTRD_PKG/cmd/$t"
done
timed "node/containerd-shim-runc-v2" "$GO" build -tags "$ctrd_tags,no_grpc" \
    -ldflags="$ctrd_ldflags" -o "$OUT_DIR/node/containerd-shim-runc-v2" \
    "$CTRD_PKG/cmd/containerd-shim-runc-v2"

# CoreDNS has a module of its own: its dependency graph (client-go among others) must
# not raise or lower Kubernetes' versions in controlplane/.
cd "$DNS_DIR"
timed "node/coredns" "$GO" build -ldflags='-s -w' -o "$OUT_DIR/node/coredns" \
    github.com/coredns/coredns

cd "$LINT_DIR"
timed "tools/{actionlint,kindconfig,dockerfilelint}" "$GO" build -ldflags='-s -w' -o "$OUT_DIR/tools/" \
    ./cmd/kindconfig ./cmd/dockerfilelint github.com/rhysd/actionlint/cmd/actionlint
# make the outputs newer than every input even if the go build cache made them old
touch "${OUTPUTS[@]}"
