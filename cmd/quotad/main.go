// Command quotad is the quotaring node and its tools: run a node (serve), try
// it (demo), measure it (bench), break it on purpose (chaos), and operate
// the ledger (migrate, reconcile, revoke, admin). Run `quotad --help`.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := notifyContext()
	err := newRootCmd().ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "quotad:", err)
		os.Exit(exitCode(err))
	}
}

// notifyContext returns a context that ends on the first SIGINT, SIGTERM
// or SIGHUP (unless ignored):
// every command then stops in order (a node drains, chaos stops its
// processes and keeps what it recorded, the demo stops its processes and
// removes its dir unless --keep). A second Ctrl-C (SIGINT, a
// person at a terminal) ends the process at once, with the default action;
// a repeated SIGTERM (a supervisor signalling the group, then the process)
// is ignored, so that a drain is never cut short by it. stop releases the
// signals and ends the goroutine that watches them.
func notifyContext() (ctx context.Context, stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	if !signal.Ignored(syscall.SIGHUP) {
		// A closed terminal or a dropped SSH session (SIGHUP) stops as a
		// Ctrl-C does: it killed the process at once, a node without its
		// drain, the demo leaving its directory behind. Not under nohup,
		// which ignores it on purpose (Notify would undo that).
		signal.Notify(sigs, syscall.SIGHUP)
	}
	done := make(chan struct{})
	go func() {
		select {
		case <-sigs:
		case <-done:
			return
		}
		// Reset before cancel: whoever sees ctx end may rely on it.
		signal.Reset(os.Interrupt)
		cancel()
		<-done
	}()
	return ctx, func() {
		signal.Stop(sigs)
		close(done)
		cancel()
	}
}
