// Command quotad is the quotaring node and its tools: run a node (serve), try
// it (demo), measure it (bench), break it on purpose (chaos), and operate
// the ledger (migrate, reconcile, revoke, admin). Run `quotad --help`.
package main

import (
	"context"
	"errors"
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
	ctx, cancelCause := context.WithCancelCause(context.Background())
	cancel := func() { cancelCause(nil) }
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
		var sig os.Signal
		select {
		case sig = <-sigs:
		case <-done:
			return
		}
		// Reset before cancel: whoever sees ctx end may rely on it.
		signal.Reset(os.Interrupt)
		cancelCause(signalReceived{sig}) // context.Cause names it (serve logs which)
		<-done
	}()
	return ctx, func() {
		signal.Stop(sigs)
		close(done)
		cancel()
	}
}

// signalReceived is the cause of notifyContext's end: which signal came.
type signalReceived struct{ sig os.Signal }

func (s signalReceived) Error() string {
	switch s.sig {
	case os.Interrupt:
		return "SIGINT (Ctrl-C)"
	case syscall.SIGTERM:
		return "SIGTERM"
	case syscall.SIGHUP:
		return "SIGHUP (a closed terminal, or a reload signal: quotad has none, and stops)"
	}
	return s.sig.String()
}

// signalName is the signal that ended ctx (notifyContext), or "" when none
// did.
func signalName(ctx context.Context) string {
	var s signalReceived
	if errors.As(context.Cause(ctx), &s) {
		return s.Error()
	}
	return ""
}
