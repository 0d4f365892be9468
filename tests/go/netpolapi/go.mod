// The ClusterNetworkPolicy conformance suite's module, pinned (go.sum): build.sh copies it,
// applies no-sctp.patch and builds its test binary (`go test -c ./conformance`).
module knit.local/netpolapi

go 1.26.0

require sigs.k8s.io/network-policy-api v0.2.0
