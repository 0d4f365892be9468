// kindconfig loads a kind cluster configuration the way `kind create cluster --config` does,
// without creating anything: it decodes the file strictly into kind's own v1alpha4 types (an
// unknown or misspelt field is an error, as in kind's pkg/internal/apis/config/encoding), applies
// kind's defaults and repeats the checks of kind's (internal, so not importable) Cluster.Validate.
// It prints {"cluster": <the defaulted config>, "defaultImage": <this kind's node image>}.
// Exit status 1 when kind would refuse the file.
//
// usage: kindconfig FILE
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"regexp"
	"strings"

	yaml "go.yaml.in/yaml/v3"
	"sigs.k8s.io/kind/pkg/apis/config/defaults"
	"sigs.k8s.io/kind/pkg/apis/config/v1alpha4"
)

// kind's validNameRE.
var validName = regexp.MustCompile(`^[a-z0-9.-]+$`)

// kind's internal config accepts "none" besides the modes v1alpha4 names.
var proxyModes = map[v1alpha4.ProxyMode]bool{
	v1alpha4.IPTablesProxyMode: true,
	v1alpha4.IPVSProxyMode:     true,
	v1alpha4.NFTablesProxyMode: true,
	"none":                     true,
}

type typeMeta struct {
	Kind       string `yaml:"kind"`
	APIVersion string `yaml:"apiVersion"`
}

func decode(raw []byte) (*v1alpha4.Cluster, error) {
	var tm typeMeta
	if err := yaml.Unmarshal(raw, &tm); err != nil {
		return nil, fmt.Errorf("could not determine kind / apiVersion: %w", err)
	}
	if tm.APIVersion != "kind.x-k8s.io/v1alpha4" || tm.Kind != "Cluster" {
		return nil, fmt.Errorf("unknown apiVersion/kind %s/%s", tm.APIVersion, tm.Kind)
	}
	cluster := &v1alpha4.Cluster{}
	decoder := yaml.NewDecoder(bytes.NewReader(raw))
	decoder.KnownFields(true)
	if err := decoder.Decode(cluster); err != nil {
		return nil, fmt.Errorf("unable to decode config: %w", err)
	}
	v1alpha4.SetDefaultsCluster(cluster)
	return cluster, nil
}

func validateSubnets(what, subnets string, family v1alpha4.ClusterIPFamily) error {
	var v4, v6 int
	for _, text := range strings.Split(subnets, ",") {
		_, cidr, err := net.ParseCIDR(text)
		if err != nil {
			return fmt.Errorf("invalid %s %q: %w", what, text, err)
		}
		if cidr.IP.To4() != nil {
			v4++
		} else {
			v6++
		}
	}
	ok := map[v1alpha4.ClusterIPFamily]bool{
		v1alpha4.IPv4Family:      v4 == 1 && v6 == 0,
		v1alpha4.IPv6Family:      v4 == 0 && v6 == 1,
		v1alpha4.DualStackFamily: v4+v6 == 1 || v4 == 1 && v6 == 1,
	}
	if !ok[family] {
		return fmt.Errorf("invalid %s %q for ipFamily %s", what, subnets, family)
	}
	return nil
}

func validate(c *v1alpha4.Cluster) error {
	var errs []error
	if c.Name != "" && !validName.MatchString(c.Name) {
		errs = append(errs, fmt.Errorf("%q is not a valid cluster name", c.Name))
	}
	n := c.Networking
	switch n.IPFamily {
	case v1alpha4.IPv4Family, v1alpha4.IPv6Family, v1alpha4.DualStackFamily:
		errs = append(errs,
			validateSubnets("podSubnet", n.PodSubnet, n.IPFamily),
			validateSubnets("serviceSubnet", n.ServiceSubnet, n.IPFamily))
	default:
		errs = append(errs, fmt.Errorf("invalid ipFamily %q", n.IPFamily))
	}
	if !proxyModes[n.KubeProxyMode] {
		errs = append(errs, fmt.Errorf("invalid kubeProxyMode %q", n.KubeProxyMode))
	}
	controlPlanes := 0
	for i, node := range c.Nodes {
		switch node.Role {
		case v1alpha4.ControlPlaneRole:
			controlPlanes++
		case v1alpha4.WorkerRole:
		default:
			errs = append(errs, fmt.Errorf("node %d: %q is not a valid node role", i, node.Role))
		}
	}
	if controlPlanes == 0 {
		errs = append(errs, errors.New("must have at least one control-plane node"))
	}
	return errors.Join(errs...)
}

func run(path string) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	cluster, err := decode(raw)
	if err != nil {
		return err
	}
	if err := validate(cluster); err != nil {
		return err
	}
	out := json.NewEncoder(os.Stdout)
	out.SetIndent("", "  ")
	return out.Encode(map[string]any{"cluster": cluster, "defaultImage": defaults.Image})
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: kindconfig FILE")
		os.Exit(2)
	}
	if err := run(os.Args[1]); err != nil {
		fmt.Fprintf(os.Stderr, "kindconfig: %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}
