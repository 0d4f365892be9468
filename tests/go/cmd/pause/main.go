// Command pause is the process of a pod sandbox, like Kubernetes' pause image: it holds
// the pod's namespaces open and does nothing else. It sleeps until SIGINT or SIGTERM,
// then exits 0, and reaps zombies on SIGCHLD (when the pod shares its PID namespace,
// pause is PID 1 and inherits orphaned processes).
//
// Built static (CGO_ENABLED=0) so it can be the only file of an image.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "-v" {
		fmt.Println("pause (knit test tooling)")
		return
	}
	// As PID 1 the kernel drops signals that have no handler; Notify installs one.
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range sigs {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		reap()
	}
}

// reap collects every exited child without blocking; SIGCHLDs can coalesce,
// so one signal may stand for several children.
func reap() {
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
		if err == syscall.EINTR {
			continue
		}
		if pid <= 0 || err != nil {
			return
		}
	}
}
