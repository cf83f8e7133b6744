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
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := newRootCmd().ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "quotad:", err)
		os.Exit(exitCode(err))
	}
}
