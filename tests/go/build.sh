#!/usr/bin/env bash
# Build knit's Go test tooling:
#   OUTDIR/tools/cnidriver                          (libcni driver, ./cmd/cnidriver)
#   OUTDIR/refcni/{bridge,host-local,portmap,loopback}  (reference CNI plugins,
#                                                    pinned by go.mod/go.sum)
#   OUTDIR/controlplane/{etcd,kube-apiserver,kubectl}  (a real control plane and its client,
#                                                    pinned by controlplane/go.mod/go.sum)
#   OUTDIR/tools/kubeproxyconfig                    (kube-proxy's own config loading and
#                                                    validation, ./controlplane/cmd/kubeproxyconfig)
#   OUTDIR/tools/{actionlint,kindconfig,dockerfilelint}  (linters for .github/workflows,
#                                                    deploy/kind and the Dockerfile, pinned by
#                                                    lint/go.mod/go.sum)
#
# usage: tests/go/build.sh OUTDIR
#
# Uses `go` from PATH (or /usr/local/go/bin/go) if it is at least the highest `go`
# version of the three go.mod files; otherwise downloads that toolchain from the Go module proxy
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

[ $# -eq 1 ] && [ -n "$1" ] || { echo "usage: $0 OUTDIR" >&2; exit 2; }

SRC_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CP_DIR=$SRC_DIR/controlplane
LINT_DIR=$SRC_DIR/lint
mkdir -p "$1"
OUT_DIR=$(cd "$1" && pwd)

REF_PKG=github.com/containernetworking/plugins/plugins
REF_PLUGINS=(main/bridge ipam/host-local meta/portmap main/loopback)
OUTPUTS=("$OUT_DIR/tools/cnidriver")
for p in "${REF_PLUGINS[@]}"; do OUTPUTS+=("$OUT_DIR/refcni/${p##*/}"); done
OUTPUTS+=("$OUT_DIR/controlplane/etcd" "$OUT_DIR/controlplane/kube-apiserver")
OUTPUTS+=("$OUT_DIR/controlplane/kubectl" "$OUT_DIR/tools/kubeproxyconfig")
LINT_TOOLS=(actionlint kindconfig dockerfilelint)
for t in "${LINT_TOOLS[@]}"; do OUTPUTS+=("$OUT_DIR/tools/$t"); done

# ---------------------------------------------------------------- up to date?
# The inputs are every go source, go.mod and go.sum under SRC_DIR: all three modules.
up_to_date() {
    [ "${KNIT_FORCE_BUILD:-0}" = 1 ] && return 1
    local o newer
    for o in "${OUTPUTS[@]}"; do
        [ -x "$o" ] || return 1
        newer=$(find "$SRC_DIR" \( -name '*.go' -o -name go.mod -o -name go.sum -o -name build.sh \) \
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
for mod in "$SRC_DIR/go.mod" "$CP_DIR/go.mod" "$LINT_DIR/go.mod"; do
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
mkdir -p "$OUT_DIR/tools" "$OUT_DIR/refcni" "$OUT_DIR/controlplane"

# timed WHAT CMD...: run CMD and log how long it took
timed() {
    local what=$1 start
    shift
    start=$(date +%s)
    "$@"
    log "built $what in $(( $(date +%s) - start ))s"
}

cd "$SRC_DIR"
pkgs=()
for p in "${REF_PLUGINS[@]}"; do pkgs+=("$REF_PKG/$p"); done
timed "tools/cnidriver" "$GO" build -ldflags='-s -w' -o "$OUT_DIR/tools/cnidriver" ./cmd/cnidriver
timed "refcni/*" "$GO" build -ldflags='-s -w' -o "$OUT_DIR/refcni/" "${pkgs[@]}"

cd "$CP_DIR"
timed "controlplane/etcd" "$GO" build -ldflags='-s -w' -o "$OUT_DIR/controlplane/etcd" \
    go.etcd.io/etcd/server/v3
# Report the pinned release as the server version (clients read it), as Kubernetes' own
# build does; a plain `go build` reports v0.0.0-master.
kube=$("$GO" list -m -f '{{.Version}}' k8s.io/kubernetes)
IFS=. read -r major minor _ <<<"${kube#v}"
vpkg=k8s.io/component-base/version
kube_ldflags="-s -w -X $vpkg.gitVersion=$kube -X $vpkg.gitMajor=$major"
kube_ldflags+=" -X $vpkg.gitMinor=$minor -X $vpkg.gitTreeState=clean"
timed "controlplane/kube-apiserver" "$GO" build -ldflags="$kube_ldflags" \
    -o "$OUT_DIR/controlplane/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver
timed "controlplane/kubectl" "$GO" build -ldflags="$kube_ldflags" \
    -o "$OUT_DIR/controlplane/kubectl" k8s.io/kubernetes/cmd/kubectl
timed "tools/kubeproxyconfig" "$GO" build -ldflags='-s -w' \
    -o "$OUT_DIR/tools/kubeproxyconfig" ./cmd/kubeproxyconfig

cd "$LINT_DIR"
timed "tools/{actionlint,kindconfig,dockerfilelint}" "$GO" build -ldflags='-s -w' -o "$OUT_DIR/tools/" \
    ./cmd/kindconfig ./cmd/dockerfilelint github.com/rhysd/actionlint/cmd/actionlint
# make the outputs newer than every input even if the go build cache made them old
touch "${OUTPUTS[@]}"
