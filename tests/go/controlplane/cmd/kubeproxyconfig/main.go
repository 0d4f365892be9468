// kubeproxyconfig checks a KubeProxyConfiguration file as kube-proxy itself loads it: strict
// decoding through kube-proxy's scheme (an unknown or misspelt field is an error; defaults
// applied), then kube-proxy's own validation. Exit status 1, with the errors, when kube-proxy
// would refuse the file.
//
// usage: kubeproxyconfig FILE
package main

import (
	"fmt"
	"os"

	kubeproxyconfig "k8s.io/kubernetes/pkg/proxy/apis/config"
	"k8s.io/kubernetes/pkg/proxy/apis/config/scheme"
	"k8s.io/kubernetes/pkg/proxy/apis/config/validation"
)

func check(path string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	obj, gvk, err := scheme.Codecs.UniversalDecoder().Decode(data, nil, nil)
	if err != nil {
		return err
	}
	config, ok := obj.(*kubeproxyconfig.KubeProxyConfiguration)
	if !ok {
		return fmt.Errorf("not a KubeProxyConfiguration: %v", gvk)
	}
	return validation.Validate(config).ToAggregate()
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: kubeproxyconfig FILE")
		os.Exit(2)
	}
	if err := check(os.Args[1]); err != nil {
		fmt.Fprintf(os.Stderr, "kubeproxyconfig: %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}
