package wal

import (
	"log/slog"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"

	"github.com/quotaring/quotaring/internal/logbuf"
	"github.com/quotaring/quotaring/internal/waitfor"
)

// A used-up disk quota (EDQUOT: XFS project quotas, a per-user quota) is a
// full disk to Pebble, through a real flush: it failed at once and for
// ever, and the node retried it about 100 times in 30 ms, each with a
// stack trace in the log, until writes stalled. It exits, as for ENOSPC.
func TestQuotaExceededExits(t *testing.T) {
	var full atomic.Bool
	fs := errorfs.Wrap(vfs.NewMem(), errorfs.InjectorFunc(func(op errorfs.Op) error {
		if full.Load() && strings.HasSuffix(op.Path, ".sst") && op.Kind.ReadOrWrite() == errorfs.OpIsWrite {
			return &os.PathError{Op: "write", Path: op.Path, Err: syscall.EDQUOT}
		}
		return nil
	}))
	var logs logbuf.Buffer
	var exits atomic.Int64
	opts := testOpts(fs)
	opts.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	opts.Exit = func(int) { exits.Add(1) }
	l := mustOpen(t, opts)
	t.Cleanup(func() { full.Store(false) }) // runs before Close
	appendDurable(t, l, []byte("r"))
	full.Store(true)
	if _, err := l.db.AsyncFlush(); err != nil {
		t.Fatal(err)
	}
	waitfor.Cond(t, 5*time.Second, "an exit on the flush's EDQUOT", func() bool { return exits.Load() > 0 })
	if !strings.Contains(logs.String(), "disk quota of the data dir") {
		t.Fatalf("exited without saying why:\n%s", logs.String())
	}
}
