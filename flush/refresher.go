package flush

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/snapshot"
)

// Refresher reads the config snapshot from the ledger every Interval and
// hands it to the engine. When the ledger is down the engine keeps serving
// the last good snapshot (kept in its log, so also after a restart).
type Refresher struct {
	Ledger   Ledger
	Engine   *engine.Engine
	Interval time.Duration // default 3 s
	Logger   *slog.Logger

	lastOK atomic.Int64
	errors atomic.Int64
	// warned is the route weights version whose unmatchable patterns were
	// logged.
	warned atomic.Int64
	cancel context.CancelFunc
	done   chan struct{}
}

// RefreshOnce reads and applies one snapshot.
func (r *Refresher) RefreshOnce(ctx context.Context) error {
	mark := r.Engine.ReadMark() // before the read: what the snapshot can include
	s, err := r.Ledger.Snapshot(ctx, time.Unix(0, r.Engine.Clock().Now().Wall).UTC())
	if err == nil {
		err = r.Engine.SetSnapshotRead(s, mark)
	}
	if err != nil {
		r.errors.Add(1)
		return err
	}
	r.lastOK.Store(time.Now().UnixNano())
	r.warnUnmatchable(s)
	return nil
}

// warnUnmatchable logs, once per route weights version, the patterns
// SetRoutes now refuses (snapshot.Routes.Unmatchable). Tables stored before
// it did may hold some: they load and bill as before (refusing the table
// would freeze the node on an older config), but the operator should
// replace them.
func (r *Refresher) warnUnmatchable(s *snapshot.Snapshot) {
	if v := s.Routes.Version; r.warned.Swap(v) != v {
		for _, err := range s.Routes.Unmatchable() {
			r.logger().Warn("route weights: a stored pattern is one new tables refuse (most such match no request, so their requests cost the default); replace the table with quotad admin routes set",
				"version", v, "err", err)
		}
	}
}

func (r *Refresher) logger() *slog.Logger {
	if r.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return r.Logger
}

// LastSuccess is when a snapshot was last applied (zero: never).
func (r *Refresher) LastSuccess() time.Time {
	if ns := r.lastOK.Load(); ns > 0 {
		return time.Unix(0, ns)
	}
	return time.Time{}
}

// Errors counts failed refreshes.
func (r *Refresher) Errors() int64 { return r.errors.Load() }

// Start runs the loop until Close.
func (r *Refresher) Start() {
	if r.Interval <= 0 {
		r.Interval = 3 * time.Second
	}
	if r.Logger == nil {
		r.Logger = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel, r.done = cancel, make(chan struct{})
	go func() {
		defer close(r.done)
		t := time.NewTicker(r.Interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				if err := r.RefreshOnce(ctx); err != nil && ctx.Err() == nil {
					r.Logger.Warn("config snapshot refresh failed; serving the last good one", "err", err)
				}
			}
		}
	}()
}

// Close stops the loop and waits for it.
func (r *Refresher) Close() {
	if r.cancel != nil {
		r.cancel()
		<-r.done
	}
}
