package flush

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/internal/logsample"
	"github.com/quotaring/quotaring/shard"
)

// SettlerOptions configure a Settler.
type SettlerOptions struct {
	Ledger Ledger
	Engine *engine.Engine
	// Interval between settles (default 1 s). A settle also starts early when
	// the unsettled log holds MaxBatch records.
	Interval time.Duration
	// MaxBatch bounds the records of one settle (default 100,000).
	MaxBatch int
	// Events keeps the event log in the ledger (default true via
	// DefaultSettlerOptions; false keeps aggregates only and gives up the
	// ledger's duplicate catch).
	Events bool
	// MaxBackoff caps the wait between failed settles (default 30 s).
	MaxBackoff time.Duration
	// Heartbeat is how often at least an idle node refreshes its
	// heartbeat_at in the ledger (default HeartbeatEvery).
	Heartbeat time.Duration
	// CallTimeout bounds each call the settler makes to the ledger (one
	// batch of a settle, a heartbeat; default DefaultCallTimeout). A call
	// that has not answered by then is cancelled and fails like any other
	// (the records stay in the log and are retried), and from that moment
	// on the ledger counts as down (Healthy). A ledger that hangs (a
	// SIGSTOPped or overloaded server, a lock held on its tables) answers
	// no error: without a bound the call waited for ever and the node
	// looked healthy throughout.
	CallTimeout time.Duration
	// Now reads the clock that times ledger calls and outages (default
	// time.Now; tests).
	Now    func() time.Time
	Logger *slog.Logger
	// OnSettle, when set, hears every attempt (for metrics).
	OnSettle func(SettleReport)
	// AfterCommit, when set, runs after the ledger committed a batch and
	// before it is marked settled locally: a failpoint for the test that kills
	// a node exactly there.
	AfterCommit func()
	// OnRefused, when set, hears once that the loop's settle was refused
	// for good: the ledger's mark and the log disagree on what was settled
	// (ErrMarkConflict that the ledger being ahead within the log does not
	// explain: a ledger restored from a backup older than the log). The
	// loop goes on retrying, as before, and logs it: the node should stop
	// taking charges it can never settle. It was retried for ever while the
	// node served.
	OnRefused func(error)
	// Start, when its Process is set, is recorded with the node's
	// registration (Ledger.RecordStart): which process and build run it.
	Start NodeStart
	// Process is this process's name, sent with every batch (Batch.Process)
	// so that the ledger refuses its settles once a later process started
	// as its node and incarnation (ErrOtherProcess) [Start.Process]. Set
	// it on every settler of a process, also those whose Start is empty
	// (registered again after the ledger came back).
	Process string
}

// SettleReport describes one attempt.
type SettleReport struct {
	Records    int
	Charges    int
	Duplicates int
	Applied    bool
	Took       time.Duration
	RoundTrips int
	Err        error
}

// Settler ships one node's log to the ledger.
type Settler struct {
	opts SettlerOptions
	log  logView
	node string
	inc  string
	mu   sync.Mutex // serialises SettleOnce; protects lastBeat, limit, growBelow and downSince
	// refused runs OnRefused once.
	refused sync.Once
	// lastBeat is when this node last wrote its heartbeat to the ledger
	// (a settle or Register).
	lastBeat time.Time
	// limit is the records of one settle: MaxBatch, halved (down to
	// minBatch) each time a settle times out, on our side (CallTimeout) or
	// the ledger's (statement_timeout). Below MaxBatch it doubles back
	// after each settle quicker than growBelow, since a ledger that hung
	// for a minute is not slow for ever, and a role's statement_timeout
	// can be raised, or its cancel have been one statement's wait on a
	// lock.
	limit int
	// growBelow is a quarter of how long the settle that cut limit took
	// before it was cancelled (about the timeout that cancelled it): a
	// settle of limit records quicker than that can double and still end
	// before that timeout.
	growBelow time.Duration
	failed    atomic.Int64
	lastOK    atomic.Int64 // stamp of the last successful settle
	lastErr   atomic.Int64 // stamp of the last failed one
	// beatOK and beatErr are the stamps of the last heartbeat (or settle)
	// that reached the ledger and of the last heartbeat that did not: an
	// idle node learns that the ledger is down from its heartbeats only.
	beatOK, beatErr atomic.Int64
	// born is when the settler was made, with the monotonic clock reading
	// the stamps above count from (stamp): Healthy compares them, and wall
	// clock stamps read a failure after a step back of the clock as older
	// than the last success, so a ledger down looked up.
	born time.Time
	// calling is the Unix ns (by opts.Now) at which the ledger call in
	// progress started, 0 when none is: one that has run for CallTimeout
	// makes the settler unhealthy even before it returns.
	calling atomic.Int64
	// downSince is when the current outage began (the first failed call
	// since the last one that succeeded), zero while the ledger answers.
	// Protected by mu (every ledger call of the settler runs under it).
	downSince time.Time
	// beatLog samples the failed-heartbeat warnings (every 2 s would flood
	// the log in an outage).
	beatLog logsample.Sampler
	stats   SettlerStats
	// drain is the point the next batch that reaches drain.seq claims the
	// log drained at (Batch.DrainedAt). Protected by mu.
	drain drainMark

	kick   chan struct{}
	cancel context.CancelFunc
	done   chan struct{}
}

// SettlerStats are counters for metrics.
type SettlerStats struct {
	Settles, Errors, Records, Duplicates, DuplicateRefunds atomic.Int64
	// UnbilledReplays counts replays the ledger did not bill again for a
	// hard limit without free units (SettleResult.UnbilledReplays).
	UnbilledReplays atomic.Int64
}

type logView interface {
	SettledSeq() uint64
	DurableSeq() uint64
	LastSeq() uint64
	Scan(after, upto uint64, fn func(seq uint64, payload []byte) error) error
	NodeID() string
	Incarnation() string
	NoteSettleSent(seq uint64)
	Vouched() uint64
	metaStore
}

// NewSettler checks the options. Start runs the loop; SettleOnce is the step.
func NewSettler(opts SettlerOptions) (*Settler, error) {
	if opts.Ledger == nil || opts.Engine == nil {
		return nil, errors.New("flush: a Settler needs a Ledger and an Engine")
	}
	if opts.Heartbeat <= 0 {
		opts.Heartbeat = HeartbeatEvery
	}
	if opts.Process == "" {
		opts.Process = opts.Start.Process
	}
	if opts.Interval <= 0 {
		opts.Interval = time.Second
	}
	if opts.MaxBatch <= 0 {
		opts.MaxBatch = 100_000
	}
	if opts.MaxBackoff <= 0 {
		opts.MaxBackoff = 30 * time.Second
	}
	if opts.CallTimeout <= 0 {
		opts.CallTimeout = DefaultCallTimeout
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	l := opts.Engine.Log()
	return &Settler{opts: opts, log: l, node: l.NodeID(), inc: l.Incarnation(), limit: opts.MaxBatch, kick: make(chan struct{}, 1), born: time.Now()}, nil
}

// stamp is now for lastOK, lastErr, beatOK and beatErr: nanoseconds since
// born on the monotonic clock, plus one (0 is "never").
func (s *Settler) stamp() int64 { return int64(time.Since(s.born)) + 1 }

// Stats are the settler's counters.
func (s *Settler) Stats() *SettlerStats { return &s.stats }

// LastSuccess is when the last settle succeeded (zero if never).
func (s *Settler) LastSuccess() time.Time {
	if ns := s.lastOK.Load(); ns > 0 {
		return s.born.Add(time.Duration(ns - 1)).Round(0)
	}
	return time.Time{}
}

// Healthy reports whether the last settle attempt succeeded, the last
// heartbeat reached the ledger (true before any failure), and no call to
// the ledger has been waiting for its answer for CallTimeout or more.
// Before the heartbeat counted, a node with nothing to settle looked
// healthy through a ledger outage: a drain then handed its reservations
// back to a ledger that refused them, and quotaring_ledger_up read 1.
// Before the wait counted, a ledger that hung (no error, no answer) kept
// every node healthy for as long as it hung: a call that hangs has neither
// failed nor succeeded.
func (s *Settler) Healthy() bool {
	if t := s.calling.Load(); t != 0 && s.opts.Now().UnixNano()-t >= int64(s.opts.CallTimeout) {
		return false
	}
	return s.lastErr.Load() <= s.lastOK.Load() && s.beatErr.Load() <= s.beatOK.Load()
}

// DefaultCallTimeout is how long one call of the settler to the ledger (a
// settle's batch, a heartbeat) may take by default
// (SettlerOptions.CallTimeout, quotad serve --ledger-timeout): a batch of
// 100,000 records settles in well under a second on a healthy Postgres, and
// one that times out is retried at half the size.
const DefaultCallTimeout = 10 * time.Second

// errCallTimedOut marks a ledger call the settler cancelled at CallTimeout.
var errCallTimedOut = errors.New("the ledger did not answer in time")

// CallTimedOut reports whether err is, or wraps, a ledger call the settler
// cancelled for taking longer than its CallTimeout.
func CallTimedOut(err error) bool { return errors.Is(err, errCallTimedOut) }

// WhatToCheckWhenHung is what an operator checks when the ledger does not
// answer at all (no error): the log line and the runbook say it.
const WhatToCheckWhenHung = "a lock held on the ledger's tables (pg_locks, pg_stat_activity: a long transaction, a migration, " +
	"LOCK TABLE, VACUUM FULL), the database server (a stopped or paused process, CPU, disk I/O, a failover under way) " +
	"and the network to it"

// call runs fn, one call to the ledger, under CallTimeout; its first
// failure since the ledger last looked healthy starts an outage
// (backUp ends it). REQUIRES: s.mu held.
func (s *Settler) call(ctx context.Context, what string, fn func(context.Context) error) error {
	cctx, cancel := context.WithTimeout(ctx, s.opts.CallTimeout)
	defer cancel()
	start := s.opts.Now()
	s.calling.Store(start.UnixNano())
	err := fn(cctx)
	if err != nil && ctx.Err() == nil && errors.Is(cctx.Err(), context.DeadlineExceeded) {
		// NB: calling stays set, so Healthy stays false until the caller
		// has recorded the failure and the next call starts.
		err = fmt.Errorf("%w: a %s got no answer within %s (--ledger-timeout), cancelled: %w", errCallTimedOut, what, s.opts.CallTimeout, err)
	} else {
		s.calling.Store(0)
	}
	if err != nil && ctx.Err() == nil && s.downSince.IsZero() && !errors.Is(err, ErrMarkConflict) {
		// NB: a mark conflict is an answer (settled elsewhere), not an
		// outage.
		s.downSince = start
	}
	return err
}

// backUp ends the current outage, with an INFO line, once the ledger
// looks healthy again: the settles and the heartbeats both answer. Not on
// any answer: with a lock held on grants the heartbeats (nodes) answer and
// the settles hang, and "answers again" between two "has not answered"
// WARNs misled. REQUIRES: s.mu held.
func (s *Settler) backUp() {
	if s.downSince.IsZero() || !s.Healthy() {
		return
	}
	s.opts.Logger.Info("the ledger answers again", "down_for", s.opts.Now().Sub(s.downSince).Round(time.Millisecond),
		"unsettled", s.log.DurableSeq()-s.log.SettledSeq())
	s.downSince = time.Time{}
}

// downFor is how long the current outage has lasted, 0 when the ledger
// answers. REQUIRES: s.mu held.
func (s *Settler) downFor() time.Duration {
	if s.downSince.IsZero() {
		return 0
	}
	return s.opts.Now().Sub(s.downSince)
}

// Register tells the ledger about this (node, incarnation) and catches the
// local settled mark up with the ledger's: a crash between a ledger commit
// and the local mark leaves the ledger ahead.
func (s *Settler) Register(ctx context.Context) error {
	mark, err := s.opts.Ledger.RegisterNode(ctx, s.node, s.inc)
	if err != nil {
		return fmt.Errorf("flush: register node %s: %w", s.node, err)
	}
	if s.opts.Start.Process != "" {
		// NB: a dir the ledger is ahead of is refused before its start is
		// recorded: recorded, the ledger refused the settles of the
		// process that runs on the original dir (ErrOtherProcess), for a
		// copy that never served.
		if s.behind(mark) {
			return s.staleDir(mark)
		}
		prev, err := s.opts.Ledger.LastStart(ctx, s.node)
		if err != nil {
			return fmt.Errorf("flush: register node %s: %w", s.node, err)
		}
		if err := s.opts.Ledger.RecordStart(ctx, s.node, s.inc, s.opts.Start); err != nil {
			return fmt.Errorf("flush: register node %s: %w", s.node, err)
		}
		// The mark again, now that the ledger refuses an earlier
		// process's settles (ErrOtherProcess): one that settled between
		// the two reads moved it over records this process numbers alike,
		// and a mark within what this process sent later reads as its own.
		if mark, err = s.opts.Ledger.RegisterNode(ctx, s.node, s.inc); err != nil {
			return fmt.Errorf("flush: register node %s: %w", s.node, err)
		}
		if s.behind(mark) {
			// That process settled past this dir in between: it runs on,
			// with its start recorded again (best effort: refused at once,
			// it stops as fenced).
			if prev.Incarnation == s.inc && prev.Process != "" {
				_ = s.opts.Ledger.RecordStart(ctx, s.node, s.inc, prev)
			}
			return s.staleDir(mark)
		}
	}
	s.mu.Lock()
	s.lastBeat = time.Now()
	s.mu.Unlock()
	return s.catchUp(ctx, mark)
}

// otherProcess handles ErrOtherProcess: a later process started as this
// node and incarnation, on a copy of this data dir, and settles its own
// records under the numbers this one's have. This process's records past
// its settled mark can never be settled: it records that in the data dir
// (StaleDir, with them as the ones to bill by hand: quotad reconcile
// --data-dir lists them, and a start on this dir is refused) and returns
// err with what to do. vouched is what the log vouched for before the
// refused batch was sent (Log.Vouched).
func (s *Settler) otherProcess(ctx context.Context, err error, vouched uint64) error {
	settled, durable := s.log.SettledSeq(), s.log.DurableSeq()
	var mark uint64
	_ = s.call(ctx, "settle", func(ctx context.Context) (err error) {
		mark, err = s.opts.Ledger.RegisterNode(ctx, s.node, s.inc)
		return err
	})
	lost := ""
	if vouched > settled { // NB: not the refused batch, which the ledger did not apply
		lost = fmt.Sprintf(" (those to %d were in the dir when this process opened it, or sent in a settle whose answer never came: they may be billed already)", min(vouched, durable))
	}
	sd := StaleDir{Node: s.node, Incarnation: s.inc, LedgerMark: mark, Billed: settled, Durable: durable, Found: time.Now(), OtherProcess: true}
	if rerr := recordStaleDir(s.log, sd); rerr != nil {
		return fmt.Errorf("%w; recording it in the data dir failed too (%v): records %d to %d of this dir can never settle from it%s", err, rerr, settled+1, durable, lost)
	}
	if durable <= settled {
		return fmt.Errorf("%w: this process stops; it holds no unsettled record. Give each process a --node-id and data dir of its own", err)
	}
	return fmt.Errorf("%w: this process stops; records %d to %d of this dir can never settle from it: those the two dirs held in common when the copy was made are "+
		"the other process's to settle, the rest are in no ledger%s. quotad reconcile --data-dir lists them, to bill by hand those the ledger's event log lacks. "+
		"Start nothing more on this dir (a start is refused), and give each process a --node-id and data dir of its own",
		err, settled+1, durable, lost)
}

// behind says the ledger's mark is beyond what this log can vouch for (see
// staleDir).
func (s *Settler) behind(mark uint64) bool {
	return mark > s.log.SettledSeq() && (mark > s.log.DurableSeq() || mark > s.log.Vouched())
}

func (s *Settler) catchUp(ctx context.Context, mark uint64) error {
	local := s.log.SettledSeq()
	switch {
	case mark <= local:
		return nil
	case s.behind(mark):
		return s.staleDir(mark)
	}
	s.opts.Logger.Info("the ledger had settled further than this node's log knew; marking locally", "ledger", mark, "local", local)
	b, err := s.batch(local, mark, false)
	if err != nil {
		return err
	}
	if err := s.takeBackUnanswered(ctx, b); err != nil {
		return err
	}
	return s.opts.Engine.Settle(ctx, mark)
}

// staleDir reports a ledger mark beyond what this log can vouch for: the
// data dir is older than the ledger (restored from a copy), or another
// process settles as this node. Nothing is marked settled: the records this
// process took since it opened sit under sequence numbers the ledger settled
// for other charges, and marking them would drop them. Before it returns,
// it records in the data dir which records the ledger billed already
// (StaleDir), for quotad reconcile --data-dir and for the next start, which
// refuses the dir.
func (s *Settler) staleDir(mark uint64) error {
	vouched, durable := s.log.Vouched(), s.log.DurableSeq()
	billed := min(vouched, durable)
	taken := "no charge was taken since this log opened, so there is nothing to bill by hand"
	if durable > billed {
		taken = fmt.Sprintf("records %d to %d are charges taken since it opened, under sequence numbers the ledger settled for other charges: "+
			"quotad reconcile --data-dir lists them as the ones to bill by hand (and the records up to %d, which the ledger billed from the original dir, apart)",
			billed+1, durable, billed)
	}
	sd := StaleDir{Node: s.node, Incarnation: s.inc, LedgerMark: mark, Billed: billed, Durable: durable, Found: time.Now()}
	if err := recordStaleDir(s.log, sd); err != nil {
		return fmt.Errorf("%w: %w: the ledger has node %s (incarnation %s) settled to %d, beyond the %d records this log held when it opened, "+
			"and recording that in the data dir failed: %w", ErrMarkConflict, ErrStaleDataDir, s.node, s.inc, mark, billed, err)
	}
	return fmt.Errorf("%w: %w: the ledger has node %s (incarnation %s) settled to %d, but this log held records only to %d when it opened and sent none past that "+
		"to the ledger since (its log ends at %d): the dir was restored from a copy or a snapshot, or another process runs "+
		"as this node with a copy of it. Nothing is marked settled, and this dir can never settle: %s. Stop this node; if another process runs as it, "+
		"stop one of them; if the node's current data dir still exists (this one a copy restored by mistake, a wrong --data-dir), start the node on that one; "+
		"otherwise bill what reconcile lists to bill by hand (if anything), then run quotad revoke --node %s and start the node with an empty data dir (README: the ledger)",
		ErrMarkConflict, ErrStaleDataDir, s.node, s.inc, mark, billed, durable, taken, s.node)
}

// takeBackUnanswered is for a batch b, the range (b.Prev, b.Next], that an
// earlier attempt settled without this node hearing the answer (the
// commit's reply lost, or a crash between the commit and the local mark):
// which of its refunds the ledger found to be duplicates, whose units it
// never credited back to this node's reservation
// (SettleResult.DuplicateRefunds), is not known any more. Every refund of reserved units in the range is taken back from the
// allowance, as a duplicate's is: left, a duplicate's units were spendable
// here and not backed there (G1). A refund that was not a duplicate leaves
// its units reserved in the ledger and unused here until the node hands
// everything back (its drain, its next start): safe, only not spendable
// meanwhile.
func (s *Settler) takeBackUnanswered(ctx context.Context, b *Batch) error {
	var units int64
	for _, r := range b.Refunds {
		if !r.Reserved {
			continue
		}
		// Counted in doubt (quotaring_reservations_uncertain_units): the
		// ledger holds the units of those it credited.
		if err := s.opts.Engine.TakeBackUncertain(ctx, r.Account, r.Allocs); err != nil {
			return err
		}
		for _, a := range r.Allocs {
			units += a.Units
		}
	}
	if units > 0 {
		s.opts.Logger.Warn("refunds settled by an attempt whose answer was lost: their units are taken back from this node's allowance, since the ledger may have found them duplicates; "+
			"those it did credit stay reserved for this node until it hands everything back (drain, next start)", "from_seq", b.Prev+1, "to_seq", b.Next, "units", units)
	}
	return nil
}

// minBatch is the fewest records a settle is cut down to after timeouts.
const minBatch = 1000

// SettleOnce settles what is durable and unsettled now, in batches of at
// most MaxBatch, and returns the number of records settled.
func (s *Settler) SettleOnce(ctx context.Context) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	total := 0
	for {
		n, more, err := s.settleBatch(ctx)
		total += n
		if err != nil {
			s.opts.Engine.SettleFailed(err) // charges waiting for a refund's settle answer now
			return total, err
		}
		if n > 0 {
			s.lastBeat = time.Now() // the settle refreshed heartbeat_at
			s.beatOK.Store(s.stamp())
		}
		if !more {
			break
		}
	}
	if err := s.heartbeatLocked(ctx); err != nil {
		return total, err
	}
	s.backUp()
	return total, nil
}

// drainMark is a time, at, and the log's last record then, seq: every
// record made before at has a seq up to seq (give or take drainSlack), so
// once the log is settled through seq the node holds nothing unsettled made
// before at. The durable end is no such mark: a record made before it is
// read may still wait for the disk (a charge in the middle of its fsync, or
// a disk that stalls across midnight), and settles after. The last record
// is, but under steady traffic the log is never settled through the one
// appended as the settle starts; so a round takes a mark and a later batch
// that reaches it claims it.
type drainMark struct {
	at  time.Time
	seq uint64
}

// drainSlack is how much earlier than a mark's time a batch claims: a
// decision takes its record's time, then waits for its account's lock and
// the log's before its record gets a seq.
const drainSlack = time.Second

// heartbeat refreshes this node's heartbeat_at in the ledger unless a
// settle or an earlier heartbeat did within the last Heartbeat.
func (s *Settler) heartbeat(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.heartbeatLocked(ctx)
}

// heartbeatLocked is heartbeat. REQUIRES: s.mu held.
func (s *Settler) heartbeatLocked(ctx context.Context) error {
	if time.Since(s.lastBeat) < s.opts.Heartbeat {
		return nil
	}
	// An idle node still says it is alive, so that quotad revoke can tell a
	// running node from a lost one.
	var drainedAt time.Time
	if looked := time.Now(); s.log.LastSeq() == s.log.SettledSeq() { // NB: the time before the look (drainMark)
		drainedAt = looked.Add(-drainSlack)
	}
	if err := s.call(ctx, "heartbeat", func(ctx context.Context) error {
		_, err := s.opts.Ledger.Heartbeat(ctx, s.node, s.inc, s.opts.Process, drainedAt)
		return err
	}); err != nil {
		s.beatErr.Store(s.stamp())
		return fmt.Errorf("flush: heartbeat of node %s: %w", s.node, err)
	}
	s.lastBeat = time.Now()
	s.beatOK.Store(s.stamp())
	s.backUp()
	return nil
}

// warnBeat logs a failed heartbeat: the first of an outage, then once a
// minute.
func (s *Settler) warnBeat(err error) {
	if ok, held := s.beatLog.Allow(time.Now(), time.Minute); ok {
		s.mu.Lock()
		down := s.downFor()
		s.mu.Unlock()
		if CallTimedOut(err) {
			s.opts.Logger.Warn(fmt.Sprintf("the ledger has not answered a heartbeat for %s: it counts as down (quotaring_ledger_up 0); retried every %s (logged once a minute)",
				s.opts.CallTimeout, s.opts.Heartbeat), "down_for", down.Round(time.Millisecond), "err", err,
				"what_to_check", WhatToCheckWhenHung, "similar_lines_held_back", held)
			return
		}
		s.opts.Logger.Warn("heartbeat to the ledger failed; retried every "+s.opts.Heartbeat.String()+" (logged once a minute)",
			"err", err, "down_for", down.Round(time.Millisecond), "similar_lines_held_back", held)
	}
}

// HeartbeatEvery is how often at least a running node refreshes its
// heartbeat_at in the ledger by default (every settle of records does too;
// SettlerOptions.Heartbeat). Short, so that a node starting can tell within
// a few seconds whether another process still runs as its node id (one
// small UPDATE every 2 s per node).
const HeartbeatEvery = 2 * time.Second

func (s *Settler) settleBatch(ctx context.Context) (n int, more bool, err error) {
	readAt := time.Now() // NB: before the last record is read (drainMark)
	last := s.log.LastSeq()
	prev, durable := s.log.SettledSeq(), s.log.DurableSeq()
	if s.drain.at.IsZero() || s.drain.seq <= prev {
		s.drain = drainMark{at: readAt, seq: last} // none waits: a new one
	}
	if durable <= prev {
		return 0, false, nil
	}
	next := min(durable, prev+uint64(s.limit))
	b, err := s.batch(prev, next, true)
	if err != nil {
		return 0, false, err
	}
	next = b.Next // NB: cut before a charge of an event the batch refunds
	mark := s.drain
	if next >= mark.seq {
		b.DrainedAt = mark.at.Add(-drainSlack)
	}
	t0 := s.opts.Now()
	vouched := s.log.Vouched() // before this batch: for otherProcess
	s.log.NoteSettleSent(next)
	var res SettleResult
	err = s.call(ctx, "settle", func(ctx context.Context) error {
		// NB: a settle cancelled here may have committed all the same (the
		// COMMIT went out, its answer did not come back): the retry sends
		// the same range, the ledger's mark makes it a no-op
		// (!res.Applied), and afterCommit takes back what that attempt's
		// answer would have said.
		var err error
		res, err = s.opts.Ledger.Settle(ctx, b)
		return err
	})
	rep := SettleReport{Records: int(next - prev), Charges: len(b.Charges), Duplicates: len(res.Duplicates),
		Applied: res.Applied, Took: s.opts.Now().Sub(t0), RoundTrips: res.RoundTrips, Err: err}
	switch {
	case errors.Is(err, ErrOtherProcess):
		// NB: never caught up with: the mark counts the other process's
		// records, under the numbers of this one's.
		err = s.otherProcess(ctx, err, vouched)
	case errors.Is(err, ErrMarkConflict):
		var mark uint64
		rerr := s.call(ctx, "settle", func(ctx context.Context) (err error) {
			mark, err = s.opts.Ledger.RegisterNode(ctx, s.node, s.inc)
			return err
		})
		if rerr == nil && mark > prev && mark <= durable {
			err = s.catchUp(ctx, mark) // the ledger is ahead within our log: mark locally and go on
			return 0, err == nil, err
		}
	}
	if err == nil {
		if s.opts.AfterCommit != nil {
			s.opts.AfterCommit()
		}
		err = s.afterCommit(ctx, b, res)
	}
	s.report(rep, err)
	if err != nil {
		switch {
		case statementTimedOut(err) && s.limit > minBatch:
			// A role's statement_timeout shorter than one settle failed the
			// same range at the same size for ever.
			s.limit, s.growBelow = max(minBatch, s.limit/2), rep.Took/4
			s.opts.Logger.Warn("the ledger cancelled a settle for taking too long (its statement_timeout?): settling in smaller batches",
				"records", next-prev, "took", rep.Took.Round(time.Millisecond), "batch", s.limit,
				"what_to_do", "raise statement_timeout for the nodes' role, or leave it: smaller batches cost more round trips, and the batch grows back after settles quicker than a quarter of that")
		case CallTimedOut(err) && s.limit > minBatch:
			// The same for our own bound: a ledger slow rather than hung
			// gets through in smaller batches.
			s.limit, s.growBelow = max(minBatch, s.limit/2), s.opts.CallTimeout/4
		}
		return 0, false, fmt.Errorf("flush: settle (%d, %d] of node %s: %w", prev, next, s.node, err)
	}
	if next >= mark.seq {
		s.drain = drainMark{} // claimed: the next round takes a new one
	}
	if s.limit < s.opts.MaxBatch && rep.Took < s.growBelow {
		s.limit = min(s.opts.MaxBatch, 2*s.limit)
	}
	// One round more when the records the mark waits for are durable by
	// now (they were on their way to the disk): a settle asked for (a
	// drain, SettleNow) then ends with the log drained.
	more = next < durable || (next < mark.seq && s.log.DurableSeq() >= mark.seq)
	return int(next - prev), more, nil
}

func (s *Settler) afterCommit(ctx context.Context, b *Batch, res SettleResult) error {
	if !res.Applied {
		// Applied before, by an attempt whose answer was lost.
		if err := s.takeBackUnanswered(ctx, b); err != nil {
			return err
		}
	}
	if len(res.Duplicates) > 0 {
		s.opts.Logger.Warn("charges already billed were not billed again: retries that reached a new owner, or an Idempotency-Key used again after its 24 hours at an owner that got the account after its earlier use (README: A key used again after 24 hours)", "count", len(res.Duplicates))
	}
	for _, r := range res.DuplicateRefunds {
		if r.Reserved {
			if err := s.opts.Engine.TakeBack(ctx, r.Account, r.Allocs); err != nil {
				return err
			}
		}
	}
	if n := len(res.UnbilledReplays); n > 0 {
		s.opts.Logger.Warn("retries answered Replayed after their charge had been refunded through another owner were served for free: billing them again would have taken the account past its hard limit, whose units others had reserved since (an owner restarted with its data dir, or cut off from the ring, answered from its memory of the charge)",
			"count", n, "account", res.UnbilledReplays[0].Account, "event", res.UnbilledReplays[0].EventID)
	}
	s.stats.UnbilledReplays.Add(int64(len(res.UnbilledReplays)))
	s.stats.Duplicates.Add(int64(len(res.Duplicates)))
	s.stats.DuplicateRefunds.Add(int64(len(res.DuplicateRefunds)))
	return s.opts.Engine.Settle(ctx, b.Next)
}

func (s *Settler) report(rep SettleReport, err error) {
	rep.Err = err
	if err != nil {
		s.stats.Errors.Add(1)
		s.lastErr.Store(s.stamp())
	} else {
		s.stats.Settles.Add(1)
		s.stats.Records.Add(int64(rep.Records))
		s.lastOK.Store(s.stamp())
	}
	if s.opts.OnSettle != nil {
		s.opts.OnSettle(rep)
	}
}

// batch reads (prev, next] into a Batch. Reservation records stay local: the
// ledger changed them when they were made. Replay records, and the replay
// a released refund takes back, go to Batch.Replays.
func (s *Settler) batch(prev, next uint64, cut bool) (*Batch, error) {
	b := &Batch{Node: s.node, Incarnation: s.inc, Process: s.opts.Process, Prev: prev, Next: next, Events: s.opts.Events}
	var rec shard.Record
	var refunded map[eventKey]bool // cut: the events this batch refunds so far
	err := s.log.Scan(prev, next, func(seq uint64, p []byte) error {
		if err := rec.Decode(p); err != nil {
			return fmt.Errorf("record %d: %w", seq, err)
		}
		switch rec.Type {
		case shard.RecCharge:
			if cut && rec.ClientID && refunded[eventKey{rec.Account, shard.LedgerEventID(rec.EventID, rec.Gen)}] {
				// A charge of an event this batch refunded before it (the
				// node had forgotten the id: its dedup window passed, or
				// DedupMax evicted it): settled with the refund, it met the
				// event still billed and was taken for a duplicate, then the
				// refund left it billed zero times (Postgres applies a
				// batch's charges before its refunds). The batch ends
				// before it; the next one bills it as the retry it is.
				b.Next = seq - 1
				return errCutBatch
			}
			b.Charges = append(b.Charges, Charge{Seq: seq, Account: rec.Account, EventID: shard.LedgerEventID(rec.EventID, rec.Gen), ClientID: rec.ClientID,
				Key: rec.Key, Route: rec.Route, Units: rec.Units, Wall: rec.Wall, Period: rec.Period, Reserved: rec.Reserved,
				Allocs: append([]shard.Alloc(nil), rec.Allocs...)})
		case shard.RecReplay:
			b.Replays = append(b.Replays, Replay{Seq: seq, Account: rec.Account, EventID: shard.LedgerEventID(rec.EventID, rec.Gen),
				Period: rec.Period, Wall: rec.Wall, Delta: rec.Delta, Origin: rec.Origin, ReplaySeq: rec.ReplaySeq})
		case shard.RecRefund:
			if rec.Released {
				// The take-back of the charge's last replay, counted off
				// before the refund it released.
				b.Replays = append(b.Replays, Replay{Seq: seq, Account: rec.Account, EventID: shard.LedgerEventID(rec.EventID, rec.Gen),
					Period: rec.Period, Wall: rec.Wall, Delta: -1, Released: true, ReplaySeq: rec.ReplaySeq})
			}
			b.Refunds = append(b.Refunds, Refund{Seq: seq, Account: rec.Account, EventID: shard.LedgerEventID(rec.EventID, rec.Gen), Key: rec.Key, Route: rec.Route,
				Units: rec.Units, Wall: rec.Wall, ChargeWall: rec.ChargeWall, Period: rec.Period, Reserved: rec.Reserved,
				Attempt: rec.Attempt, Origin: rec.Origin, Released: rec.Released, Allocs: append([]shard.Alloc(nil), rec.Allocs...)})
			if cut {
				if refunded == nil {
					refunded = map[eventKey]bool{}
				}
				refunded[eventKey{rec.Account, shard.LedgerEventID(rec.EventID, rec.Gen)}] = true
			}
		}
		return nil
	})
	if errors.Is(err, errCutBatch) {
		err = nil
	}
	if err != nil {
		return nil, err
	}
	return b, nil
}

// errCutBatch ends a batch's scan early (batch).
var errCutBatch = errors.New("flush: batch cut")

// Kick asks the loop to settle now (the unsettled log grew past MaxBatch).
func (s *Settler) Kick() {
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// Start runs the settle loop until Close.
func (s *Settler) Start() {
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel, s.done = cancel, make(chan struct{})
	go s.loop(ctx)
}

func (s *Settler) loop(ctx context.Context) {
	defer close(s.done)
	wait := s.opts.Interval
	t := time.NewTimer(wait)
	defer t.Stop()
	// check looks at the log's size between settles: a log that reached
	// MaxBatch records settles at once rather than at the next tick.
	check := time.NewTicker(max(s.opts.Interval/10, 10*time.Millisecond))
	defer check.Stop()
	// beat keeps the heartbeat going when the settle interval is longer
	// than the heartbeat's (quotad revoke reads it).
	beat := time.NewTicker(s.opts.Heartbeat)
	defer beat.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-beat.C:
			if err := s.heartbeat(ctx); err != nil && ctx.Err() == nil {
				s.warnBeat(err)
			}
			continue
		case <-t.C:
		case <-s.kick:
		case <-check.C:
			if s.failed.Load() > 0 || s.log.DurableSeq()-s.log.SettledSeq() < uint64(s.opts.MaxBatch) {
				continue
			}
		}
		if _, err := s.SettleOnce(ctx); err != nil && ctx.Err() == nil {
			if errors.Is(err, ErrMarkConflict) && s.opts.OnRefused != nil {
				s.refused.Do(func() { s.opts.OnRefused(err) })
			}
			fails := s.failed.Add(1)
			wait = backoff(s.opts.Interval, s.opts.MaxBackoff, fails)
			s.warnSettle(err, wait)
		} else {
			s.failed.Store(0)
			wait = s.opts.Interval
		}
		if !t.Stop() {
			select {
			case <-t.C:
			default:
			}
		}
		t.Reset(wait)
	}
}

// warnSettle logs a failed settle of the loop.
func (s *Settler) warnSettle(err error, retryIn time.Duration) {
	s.mu.Lock()
	down, unsettled, batch := s.downFor(), s.log.DurableSeq()-s.log.SettledSeq(), s.limit
	s.mu.Unlock()
	if CallTimedOut(err) {
		s.opts.Logger.Warn(fmt.Sprintf("the ledger has not answered a settle for %s: it counts as down (quotaring_ledger_up 0); the records stay in the log and are retried", s.opts.CallTimeout),
			"down_for", down.Round(time.Millisecond), "unsettled", unsettled, "next_batch", batch, "retry_in", retryIn, "err", err,
			"what_to_check", WhatToCheckWhenHung)
		return
	}
	s.opts.Logger.Warn("settle failed; the records stay in the log and are retried", "err", err, "retry_in", retryIn,
		"down_for", down.Round(time.Millisecond), "unsettled", unsettled)
}

// backoff doubles from base per failure up to max, with jitter.
func backoff(base, maxWait time.Duration, fails int64) time.Duration {
	d := base << min(fails, 16)
	d = min(d, maxWait)
	return d/2 + time.Duration(rand.Int64N(int64(d/2)+1))
}

// Close stops the loop and waits for it. It does not settle: call
// SettleOnce for the final settle.
func (s *Settler) Close() {
	if s.cancel == nil {
		return
	}
	s.cancel()
	<-s.done
}
