package flush

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/internal/logsample"
	"github.com/quotaring/quotaring/snapshot"
)

// Refresher reads the config snapshot from the ledger every Interval and
// hands it to the engine. When the ledger is down the engine keeps serving
// the last good snapshot (kept in its log, so also after a restart).
type Refresher struct {
	Ledger   Ledger
	Engine   *engine.Engine
	Interval time.Duration // default 3 s
	// Timeout bounds each read of the loop (default DefaultRefreshTimeout):
	// without it a read that hung (a lock on a config table, a connection
	// to a server gone without a word) stopped the loop for good, and the
	// node enforced its last snapshot for the rest of its life.
	Timeout time.Duration
	Logger  *slog.Logger

	lastOK atomic.Int64
	errors atomic.Int64
	// failLog samples the loop's failure warnings (a WARN every Interval
	// flooded the log through an outage).
	failLog logsample.Sampler
	// warned is the route weights version whose unmatchable patterns were
	// logged.
	warned atomic.Int64
	// wentBack is 1 + the config version older than the one held that
	// was last logged (warnWentBack); 0: none.
	wentBack atomic.Int64
	cancel   context.CancelFunc
	done     chan struct{}
}

// RefreshOnce reads and applies one snapshot.
func (r *Refresher) RefreshOnce(ctx context.Context) error {
	mark := r.Engine.ReadMark() // before the read: what the snapshot can include
	s, err := r.Ledger.Snapshot(ctx, time.Unix(0, r.Engine.Clock().Now().Wall).UTC())
	if err == nil {
		r.warnWentBack(r.Engine.Snapshot(), s)
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

// warnWentBack logs, once per version, a config older than the one held:
// the ledger was restored from a backup or rebuilt, and what changed since
// (a key revoked, a plan lowered) is undone on every node. It is applied
// all the same (the ledger is the config's only source), but an operator
// must redo those changes.
func (r *Refresher) warnWentBack(held, s *snapshot.Snapshot) {
	if held == nil || s.Version >= held.Version || r.wentBack.Swap(s.Version+1) == s.Version+1 {
		return
	}
	r.logger().Warn("the ledger's config is older than the one this node held (a ledger restored from a backup, or rebuilt): "+
		"what was changed since is undone, keys revoked since work again: redo those changes (quotad admin)",
		"ledger_version", s.Version, "held_version", held.Version)
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

// DefaultRefreshTimeout bounds a read of the config snapshot by the loop
// (Refresher.Timeout): a snapshot of a million accounts and keys reads in a
// few seconds.
const DefaultRefreshTimeout = time.Minute

// refreshFailEvery is how often the loop logs a failed refresh: the first
// at once, then one a minute with the count held back.
const refreshFailEvery = time.Minute

// Start runs the loop until Close.
func (r *Refresher) Start() {
	if r.Interval <= 0 {
		r.Interval = 3 * time.Second
	}
	if r.Timeout <= 0 {
		r.Timeout = DefaultRefreshTimeout
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
				r.refreshLogged(ctx)
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

// refreshLogged is one round of the loop: RefreshOnce within Timeout, a
// failure logged (sampled) with how old the snapshot in use is.
func (r *Refresher) refreshLogged(ctx context.Context) {
	cctx, cancel := context.WithTimeout(ctx, r.Timeout)
	defer cancel()
	err := r.RefreshOnce(cctx)
	if err == nil || ctx.Err() != nil {
		return
	}
	if cctx.Err() != nil {
		err = fmt.Errorf("no snapshot within %s, cancelled: %w", r.Timeout, err)
	}
	if ok, held := r.failLog.Allow(time.Now(), refreshFailEvery); ok {
		age := "none read yet"
		if t := r.LastSuccess(); !t.IsZero() {
			age = time.Since(t).Round(time.Second).String()
		}
		r.Logger.Warn("config snapshot refresh failed; serving the last good one (plans, accounts, keys and route weights changed since are not enforced here)",
			"err", err, "snapshot_age", age, "similar_lines_held_back", held)
	}
}
