// Command cnidriver drives CNI plugins through libcni, the way a container
// runtime would. It is test tooling for knit; the product itself is Python.
//
// Usage:
//
//	cnidriver <add|check|del|gc|status> --conflist FILE --cni-path DIR1:DIR2 --cache-dir DIR
//	          [--netns PATH] [--container-id ID] [--ifname IF] [--args "K=V;K2=V2"]
//	          [--capability-args JSON] [--valid-attachments "ID/IF,ID2/IF2"] [--timeout DUR]
//	cnidriver bench --conflist FILE --cni-path DIRS --cache-dir DIR --netns-list FILE [--ifname eth0]
//
// add prints the final result (in the conflist's cniVersion) as JSON on stdout.
// check/del/gc/status print nothing on success. On failure the exit status is 1,
// the error text goes to stderr and, if the error is (or wraps) a CNI
// *types.Error, its JSON is printed on stdout. Usage errors exit with 2.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"
)

const usageText = `usage:
  cnidriver <add|check|del|gc|status> --conflist FILE --cni-path DIR1:DIR2 --cache-dir DIR
            [--netns PATH] [--container-id ID] [--ifname IF] [--args "K=V;K2=V2"]
            [--capability-args JSON] [--valid-attachments "ID/IF,ID2/IF2"] [--timeout DUR]
  cnidriver bench --conflist FILE --cni-path DIRS --cache-dir DIR --netns-list FILE
            [--ifname IF] [--args ...] [--capability-args JSON] [--timeout DUR]
`

type options struct {
	conflist         string
	cniPath          string
	cacheDir         string
	netns            string
	containerID      string
	ifname           string
	args             string
	capabilityArgs   string
	validAttachments string
	netnsList        string
	timeout          time.Duration
}

type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(argv []string, stdout, stderr io.Writer) int {
	if len(argv) < 1 {
		fmt.Fprint(stderr, usageText)
		return 2
	}
	cmd := argv[0]
	switch cmd {
	case "-h", "--help", "help":
		fmt.Fprint(stdout, usageText)
		return 0
	case "add", "check", "del", "gc", "status", "bench":
	default:
		fmt.Fprintf(stderr, "cnidriver: unknown command %q\n%s", cmd, usageText)
		return 2
	}

	var o options
	fs := flag.NewFlagSet("cnidriver "+cmd, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, usageText) }
	fs.StringVar(&o.conflist, "conflist", "", "network configuration list file")
	fs.StringVar(&o.cniPath, "cni-path", "", "colon-separated plugin search path")
	fs.StringVar(&o.cacheDir, "cache-dir", "", "libcni cache directory")
	fs.StringVar(&o.netns, "netns", "", "network namespace path")
	fs.StringVar(&o.containerID, "container-id", "", "container ID")
	fs.StringVar(&o.ifname, "ifname", "eth0", "interface name inside the container")
	fs.StringVar(&o.args, "args", "", `CNI_ARGS as "K=V;K2=V2"`)
	fs.StringVar(&o.capabilityArgs, "capability-args", "", "JSON object of capability args")
	fs.StringVar(&o.validAttachments, "valid-attachments", "", `GC: valid attachments "ID/IF,ID2/IF2"`)
	fs.StringVar(&o.netnsList, "netns-list", "", "bench: file with one netns path per line")
	fs.DurationVar(&o.timeout, "timeout", 0, "overall timeout (0 = none)")
	if err := fs.Parse(argv[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "cnidriver: unexpected arguments: %q\n", fs.Args())
		return 2
	}

	err := dispatch(cmd, &o, stdout)
	if err == nil {
		return 0
	}
	var ue usageError
	if errors.As(err, &ue) {
		fmt.Fprintf(stderr, "cnidriver %s: %s\n%s", cmd, ue.msg, usageText)
		return 2
	}
	var cniErr *types.Error
	if errors.As(err, &cniErr) {
		if b, mErr := json.Marshal(cniErr); mErr == nil {
			fmt.Fprintln(stdout, string(b))
		}
	}
	fmt.Fprintf(stderr, "cnidriver %s: %v\n", cmd, err)
	return 1
}

func dispatch(cmd string, o *options, stdout io.Writer) error {
	if o.conflist == "" {
		return usageError{"--conflist is required"}
	}
	if o.cniPath == "" {
		return usageError{"--cni-path is required"}
	}
	if o.cacheDir == "" {
		return usageError{"--cache-dir is required"}
	}
	if cmd == "bench" && o.netnsList == "" {
		return usageError{"--netns-list is required for bench"}
	}

	list, err := libcni.NetworkConfFromFile(o.conflist)
	if err != nil {
		return fmt.Errorf("loading %s: %w", o.conflist, err)
	}
	cniArgs, err := parseArgs(o.args)
	if err != nil {
		return usageError{err.Error()}
	}
	var capArgs map[string]interface{}
	if o.capabilityArgs != "" {
		if err := json.Unmarshal([]byte(o.capabilityArgs), &capArgs); err != nil {
			return usageError{fmt.Sprintf("--capability-args: invalid JSON object: %v", err)}
		}
	}

	var paths []string
	for _, p := range filepath.SplitList(o.cniPath) {
		if p != "" {
			paths = append(paths, p)
		}
	}
	exec := &invoke.DefaultExec{
		// Forward plugin stderr (also on success) to ours, for debugging.
		RawExec:       &invoke.RawExec{Stderr: os.Stderr},
		PluginDecoder: version.PluginDecoder{},
	}
	cni := libcni.NewCNIConfigWithCacheDir(paths, o.cacheDir, exec)

	ctx := context.Background()
	if o.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, o.timeout)
		defer cancel()
	}

	rt := &libcni.RuntimeConf{
		ContainerID:    o.containerID,
		NetNS:          o.netns,
		IfName:         o.ifname,
		Args:           cniArgs,
		CapabilityArgs: capArgs,
		CacheDir:       o.cacheDir,
	}

	switch cmd {
	case "add":
		res, err := cni.AddNetworkList(ctx, list, rt)
		if err != nil {
			return err
		}
		if res == nil {
			fmt.Fprintln(stdout, "{}")
			return nil
		}
		b, err := json.Marshal(res)
		if err != nil {
			return fmt.Errorf("encoding result: %w", err)
		}
		fmt.Fprintln(stdout, string(b))
		return nil
	case "check":
		return cni.CheckNetworkList(ctx, list, rt)
	case "del":
		return cni.DelNetworkList(ctx, list, rt)
	case "gc":
		valid, err := parseAttachments(o.validAttachments)
		if err != nil {
			return usageError{err.Error()}
		}
		return cni.GCNetworkList(ctx, list, &libcni.GCArgs{ValidAttachments: valid})
	case "status":
		return cni.GetStatusNetworkList(ctx, list)
	case "bench":
		return bench(ctx, cni, list, rt, o.netnsList, stdout)
	}
	return usageError{"unknown command " + cmd}
}

// parseArgs turns "K=V;K2=V2" into libcni's [][2]string.
func parseArgs(s string) ([][2]string, error) {
	var out [][2]string
	for _, part := range strings.Split(s, ";") {
		if part == "" {
			continue
		}
		k, v, ok := strings.Cut(part, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("--args: invalid pair %q (want K=V)", part)
		}
		out = append(out, [2]string{k, v})
	}
	return out, nil
}

// parseAttachments turns "ID/IF,ID2/IF2" into GC attachments. The result is
// never nil, so an empty flag means "no attachment is valid".
func parseAttachments(s string) ([]types.GCAttachment, error) {
	out := []types.GCAttachment{}
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		i := strings.LastIndex(part, "/")
		if i <= 0 || i == len(part)-1 {
			return nil, fmt.Errorf("--valid-attachments: invalid entry %q (want ID/IF)", part)
		}
		out = append(out, types.GCAttachment{ContainerID: part[:i], IfName: part[i+1:]})
	}
	return out, nil
}

type benchResult struct {
	Add   []float64 `json:"add"`
	Check []float64 `json:"check"`
	Del   []float64 `json:"del"`
}

func readNetnsList(file string) ([]string, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		out = append(out, line)
	}
	return out, sc.Err()
}

func bench(ctx context.Context, cni *libcni.CNIConfig, list *libcni.NetworkConfigList,
	base *libcni.RuntimeConf, netnsList string, stdout io.Writer) error {
	nss, err := readNetnsList(netnsList)
	if err != nil {
		return fmt.Errorf("reading --netns-list: %w", err)
	}
	if len(nss) == 0 {
		return fmt.Errorf("--netns-list %s holds no netns paths", netnsList)
	}
	rts := make([]*libcni.RuntimeConf, len(nss))
	for i, ns := range nss {
		rt := *base
		rt.ContainerID = fmt.Sprintf("bench-%d", i)
		rt.NetNS = ns
		rts[i] = &rt
	}
	res := benchResult{Add: []float64{}, Check: []float64{}, Del: []float64{}}

	added := 0
	// On failure, best-effort DEL whatever was added so nothing leaks.
	cleanup := func() {
		for i := 0; i < added; i++ {
			_ = cni.DelNetworkList(context.Background(), list, rts[i])
		}
	}
	for i, rt := range rts {
		t := time.Now()
		_, err := cni.AddNetworkList(ctx, list, rt)
		d := time.Since(t).Seconds()
		added = i + 1 // a failed ADD may have left state behind too
		if err != nil {
			cleanup()
			return fmt.Errorf("ADD %s (%s): %w", rt.ContainerID, rt.NetNS, err)
		}
		res.Add = append(res.Add, d)

		t = time.Now()
		err = cni.CheckNetworkList(ctx, list, rt)
		d = time.Since(t).Seconds()
		if err != nil {
			cleanup()
			return fmt.Errorf("CHECK %s (%s): %w", rt.ContainerID, rt.NetNS, err)
		}
		res.Check = append(res.Check, d)
	}
	for i, rt := range rts {
		t := time.Now()
		err := cni.DelNetworkList(ctx, list, rt)
		d := time.Since(t).Seconds()
		if err != nil {
			rts = rts[i+1:]
			added = len(rts)
			cleanup()
			return fmt.Errorf("DEL %s (%s): %w", rt.ContainerID, rt.NetNS, err)
		}
		res.Del = append(res.Del, d)
	}
	b, err := json.Marshal(res)
	if err != nil {
		return err
	}
	fmt.Fprintln(stdout, string(b))
	return nil
}
