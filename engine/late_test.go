package engine

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/shard"
)

// stoppedCtx is the context of a call whose deadline passed while this
// process was stopped (SIGSTOP, a frozen VM): resumed, the process finds
// the record durable and the deadline gone at once. Err says it ended;
// Done never fires, so the wait for the disk cannot see it first.
type stoppedCtx struct{ context.Context }

func (stoppedCtx) Err() error { return context.DeadlineExceeded }

// resumedCtx is stoppedCtx as the process sees it first on resuming: the
// deadline has passed but the timer that ends the context has not run
// yet, so Err is still nil.
type resumedCtx struct{ context.Context }

func (resumedCtx) Deadline() (time.Time, bool) { return time.Now().Add(-time.Second), true }

// A charge durable only after its caller's context ended was answered OK to
// nobody: the caller (an RPC past its deadline) retried at the next owner
// or reported a failure, and the charge stood, billed for a request that
// had failed (a review's SIGSTOP of an owner under load billed such
// requests). It is now taken back, even while the node holds its decisions
// after the pause (the take-back answers nobody), and the error says so.
func TestChargeDurableAfterItsCallerLeftIsTakenBack(t *testing.T) {
	for _, c := range []struct {
		name string
		many bool
		ctx  context.Context
	}{
		{"Charge", false, stoppedCtx{context.Background()}},
		{"ChargeMany", true, stoppedCtx{context.Background()}},
		{"Charge before the deadline's timer ran", false, resumedCtx{context.Background()}},
		{"ChargeMany before the deadline's timer ran", true, resumedCtx{context.Background()}},
	} {
		many, ctx := c.many, c.ctx
		t.Run(c.name, func(t *testing.T) {
			l := openLog(t, t.TempDir())
			defer l.Close()
			var holds atomic.Int64 // the first call (the charge's decision) passes; later ones hold, as after a pause
			e, err := Open(Options{Log: l, Clock: NewManualClock(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC)), Hold: func() error {
				if holds.Add(1) > 1 {
					return errors.New("paused")
				}
				return nil
			}})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			if err := e.SetSnapshot(testSnapshot(t, map[string]int64{"acme": 100}), AllSettled); err != nil {
				t.Fatal(err)
			}
			req := shard.Charge{EventID: "job-1", ClientID: true, Units: 7}
			if many {
				err = e.ChargeMany(ctx, []Request{{Account: "acme", Charge: req}})[0].Err
			} else {
				_, err = e.Charge(ctx, "acme", req)
			}
			if !errors.Is(err, ErrQuotaUnavailable) || !errors.Is(err, errAnsweredLate) || !strings.Contains(err.Error(), "it was taken back, retry") {
				t.Fatalf("a charge durable after its caller left: %v; want quota-unavailable, answered late, taken back", err)
			}
			if n, units := countRecords(t, l, shard.RecRefund); n != 1 || units != 7 {
				t.Fatalf("refund records: %d of %d units; want the take-back, 1 of 7", n, units)
			}
		})
	}
}
