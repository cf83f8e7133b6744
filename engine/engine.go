package engine

import (
	"context"
	"crypto/rand"
	"encoding/base32"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/quotaring/quotaring/internal/logsample"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
	"github.com/quotaring/quotaring/wal"
)

// Errors a caller can act on.
var (
	// ErrNotOwner: this node does not own the account (any more). Retry at the
	// owner; never charge here.
	ErrNotOwner = errors.New("engine: not the owner of this account")
	// ErrQuotaUnavailable: the account cannot be decided now (its
	// reservation could not be made, the node holds every decision during
	// a pause, a charge was taken back): the wrapping error says which.
	// Answer quota-unavailable (503) and retry later.
	ErrQuotaUnavailable = errors.New("engine: quota unavailable")
	// ErrClosed: the engine is closed.
	ErrClosed = errors.New("engine: closed")
)

// Reserver reserves and releases units of an account's grants in the ledger
// for this node. Implementations are safe for concurrent use and may block
// on the network.
type Reserver interface {
	// Reserve reserves up to req.Need more units of the account's grants
	// active at req.Wall, soonest-expiring first. It may reserve less (what is
	// free); Exhausted names grants with nothing free left.
	Reserve(ctx context.Context, req ReserveRequest) (ReserveResult, error)
	// Release hands allowances back to the ledger. seq is the log record
	// that zeroed them: a release retried with the same seq (its first
	// answer lost) must not apply twice. Seq 0 is a release never retried
	// (units the node could not use the moment it got them).
	Release(ctx context.Context, account string, allocs []shard.Alloc, seq uint64) error
}

// ReserveRequest asks for units.
type ReserveRequest struct {
	Account string
	Wall    int64
	Need    int64
}

// ReserveResult is what the ledger reserved.
type ReserveResult struct {
	Granted   []shard.Alloc
	Exhausted []string
	// HeldElsewhere are grants with nothing free while other nodes hold
	// reservations on them: a charge short of units answers
	// ErrQuotaUnavailable, not QuotaExceeded.
	HeldElsewhere []string
}

// Options configure an Engine.
type Options struct {
	Log *wal.Log // required
	// Clock defaults to a SystemClock.
	Clock Clock
	// Stripes is the number of lock stripes (default 256).
	Stripes int
	// Params are shared by all accounts; Params.Reservations is set from
	// Reserver != nil. Zero DedupWindow/DedupMax/MaxReplays take
	// shard.DefaultParams; a negative MaxReplays bounds no replays.
	Params shard.Params
	// Reserver, when set, makes hard limits spend only reserved units.
	Reserver Reserver
	// ReserveWindow is the span of recent use a reservation should cover
	// twice over (about the settle interval; default 1 s).
	ReserveWindow time.Duration
	// ExhaustedBackoff is how long a grant the ledger called exhausted is not
	// asked about again (default 1 s).
	ExhaustedBackoff time.Duration
	// LedgerTimeout bounds each call the engine makes to the Reserver on
	// its own, with no caller waiting: a background top-up (and the
	// hand-back of units it could not use), a round of retried releases
	// (default DefaultLedgerTimeout; quotad serve --ledger-timeout, the
	// bound of a settle). A call past it is cancelled and counted
	// (Stats.ReserveTimeouts). Without it a Reserver that never answered
	// held the top-up loop, and with it every later top-up and release
	// retry, for as long as the ledger hung.
	LedgerTimeout time.Duration
	// ReserveTimeout bounds how long a charge waits for a reservation,
	// its own or one in flight for its account (default
	// DefaultReserveTimeout), before it answers ErrQuotaUnavailable: a
	// charge that joins a background top-up must not wait LedgerTimeout.
	ReserveTimeout time.Duration
	// Owns reports whether this node owns an account now. It is called under
	// the account's stripe lock; nil means every account.
	Owns func(account string) bool
	// Tenure, when set, names the stretch of time over which this node has
	// owned account without a break (ring.Ring.Tenure; 0: it does not own
	// it). Called like Owns. An account found under another tenure than the
	// one it last decided under went to another node and came back, whether
	// or not the node let it go meanwhile (its ring's changes can come too
	// late for that): it is regained (see regainLocked), since the other
	// owner may have refunded or charged its events meanwhile.
	Tenure func(account string) uint64
	// ReseedWindow is how long after an account comes (back) here its use
	// follows the ledger's at every config refresh that holds all its
	// records here, down as well as up (default DefaultReseedWindow;
	// negative: at the first such refresh only). The account's last owner
	// may settle its last records a while after the account left it (a
	// draining node settles after it announced draining): a refund of a
	// charge settled then would stay counted here for the month, since
	// after the window refreshes only raise use. Set it to the time a node
	// takes from letting accounts go to its last settle (its drain and
	// settle timeouts).
	ReseedWindow time.Duration
	// MayRefund, when set, lets refunds through for an account Owns says
	// this node does not own: a draining node's accounts while no member
	// serves them (the whole cluster stopping at once). Called like Owns.
	MayRefund func(account string) bool
	// Hold, when set, is asked after Owns, under the same lock, before every
	// charge, refund, usage read and reservation: a non-nil error (saying
	// why) makes the engine decide nothing and answer an error wrapping
	// ErrQuotaUnavailable and it, which callers retry. The node holds so
	// while it does not trust its own view of the ring (after a pause of its
	// process). It must not block; nil decides as usual.
	Hold func() error
	// SettleSoon, when set, asks the settler to settle the log now (it
	// must not block): a charge short of units calls it while it waits
	// for a refund of its account to settle (the refund's units are the
	// ledger's to reserve once it has). Unset, the charge waits for the
	// settler's next round.
	SettleSoon func()
	// Logger defaults to discarding.
	Logger *slog.Logger
	// OnCharge, when set, hears every charge once it is answered (after
	// durability): its decision, or the error, and how long it took. For
	// metrics and alerts; it must not block.
	OnCharge func(account string, d *shard.Decision, err error, took time.Duration)
}

// Result is the answer to a charge.
type Result struct {
	shard.Decision
	EventID string
	// Receipt refunds this charge later (nil unless it charged units), or,
	// on Replayed, takes the replay back (RefundReplay).
	Receipt *shard.Receipt
}

// Engine owns the accounts of one node. Its methods are safe for concurrent
// use.
type Engine struct {
	opts   Options
	log    *wal.Log
	clock  Clock
	params shard.Params
	snap   atomic.Pointer[snapshot.Snapshot]
	kept   atomic.Bool // snap is the one kept in the log
	// snapSettled is the log's settled mark read before snap was: snap's
	// settled use includes this node's records up to it (SetSnapshot).
	snapSettled atomic.Uint64
	// reads counts the ledger reads begun (ReadMark): an account reseeded
	// (entry.reseed) takes its use only from a snapshot read after it
	// came here.
	reads atomic.Uint64
	// keptMarkKnown: recover read snapSettled with the kept snapshot
	// (metaSnapshotSettled). Written and read by Open only.
	keptMarkKnown bool
	stripes       []stripe
	idPrefix      string
	idSeq         atomic.Uint64
	flights       flightGroup
	stats         Stats
	// unreleased are hand-backs the ledger refused, retried (reserve.go).
	unreleased unreleased
	// forgotten holds the last state of accounts Forget dropped while they
	// had changes not yet checkpointed, for the next settle to write
	// (settle.go): otherwise a restart would bring back an older checkpoint
	// whose records that settle deleted.
	forgotMu  sync.Mutex // protects forgotten
	forgotten map[string]wal.Checkpoint
	// ckptMu serializes taking checkpoints and writing them (Settle,
	// storeForgotten).
	ckptMu sync.Mutex

	topups chan string
	// hungLog samples the WARNs of background calls the ledger left
	// unanswered.
	hungLog logsample.Sampler
	// stalledAt is the monotonic reading when the ledger last left a
	// reservation unanswered past its bound; 0 while it answers. While it
	// is set, a charge that needs a reservation is refused at once and the
	// background top-up asks the ledger instead (reserveForCharge).
	stalledAt atomic.Int64
	// settled is closed, and replaced, each time Settle moves the log's
	// settled mark or the settler reports a failed settle (waitSettled);
	// settleFails counts those failures, settleErr is the last.
	settledMu   sync.Mutex // protects settled, settleFails and settleErr
	settled     chan struct{}
	settleFails uint64
	settleErr   error
	ctx         context.Context // canceled by Close: stops the top-up loop and its ledger calls
	cancel      context.CancelFunc
	wg          sync.WaitGroup
	closed      atomic.Bool
}

// stripe is one lock's worth of accounts.
type stripe struct {
	mu sync.Mutex // protects accounts, rec and buf, and every *entry in accounts
	// accounts holds the state of the accounts hashed to this stripe.
	accounts map[string]*entry
	rec      shard.Record // scratch, reused for every decision
	buf      []byte       // scratch for encoding
}

// entry is an account plus what the driver keeps beside it.
type entry struct {
	acct  *shard.Account
	dirty bool // changed since its last checkpoint
	// broken is set when the log refused a record whose change the account
	// already holds in memory (the log failed or is closing): the account
	// then answers this error, never a decision that rests on that change.
	broken error
	// letGo is set when Forget was asked while the snapshot lacked some of
	// the account's records: the first snapshot that includes them drops it.
	letGo bool
	// reseed is set when the account came here (a new entry), came back
	// while letGo (regainLocked) or was restored (armReseed): each
	// snapshot with all its records, read after reseedAfter, sets its use
	// to the ledger's, until one does at or after reseedUntil
	// (Options.ReseedWindow, on the clock's Mono). One read before
	// (Engine.reads) may lack what the account's other owner settled
	// before it let the account go, and one read soon after what it
	// settled after (a draining node's last settle): the refund of a charge
	// made here, which would stay counted for the month.
	reseed      bool
	reseedAfter uint64
	reseedUntil int64
	// tenure is Options.Tenure's at the account's last decision (0: none yet).
	tenure  uint64
	chunk   int64 // size of its last reservation
	topping bool  // a top-up is queued
	// waiting is the units of charges blocked on a reservation right now: a
	// reservation asks for all of them, so concurrent first charges share
	// one round trip instead of taking turns.
	waiting int64
	// use in the current and previous ReserveWindow, for sizing reservations
	winStart, winUnits, prevUnits int64
	// refundSeq is the seq of the account's last refund that gave reserved
	// units back to its allowance (its record moves the ledger's
	// reservation up when it settles). A hand-back of the allowance waits
	// until the log is settled that far: see Release. Only records of older
	// versions do that now (shard.Record.Reserved).
	refundSeq uint64
	// freedSeq is the seq of the account's last refund that gave hard
	// units back to the ledger's grant (reservations on): the ledger has
	// them free once the log is settled that far. A charge short of units
	// waits for that settle before it asks for a reservation
	// (reserveOnce), so that a refunded unit can be spent again at once.
	freedSeq uint64
}

// Stats are counters for metrics.
type Stats struct {
	Charges, Refunds, Replayed, Refused, Reservations, ReserveErrors, TopUps atomic.Int64
	// ReserveTimeouts counts the reservations and releases the engine gave
	// up on at LedgerTimeout or ReserveTimeout (a reservation among
	// ReserveErrors too). A reservation cancelled that way may have
	// committed in the ledger (outcome unknown): its units stay reserved
	// for this node, unused, until its next start or stop frees them all
	// (flush.Ledger.ReleaseNode).
	ReserveTimeouts atomic.Int64
	// UncertainUnits bounds what the ledger may hold reserved for this node
	// beyond its allowances: the units of reservations whose outcome is
	// unknown (ReserveUncertainError), of hand-backs of units it could not
	// use that the ledger did not take, and of refunds taken back whose
	// credit in the ledger is not known (TakeBackUncertain, and what
	// TakeBack overdraws). Nobody can spend those units
	// (G1 holds) until the node's next start or stop frees them all.
	UncertainUnits atomic.Int64
}

// ReserveUncertainError is a Reserver's error for a reservation whose
// outcome is unknown (its commit was cut off): the ledger may have
// reserved Units for this node, which the node does not hold. The engine
// counts them in Stats.UncertainUnits.
type ReserveUncertainError struct {
	Units int64
	Err   error
}

func (e *ReserveUncertainError) Error() string { return e.Err.Error() }
func (e *ReserveUncertainError) Unwrap() error { return e.Err }

// DefaultLedgerTimeout is Options.LedgerTimeout's default, the ledger call
// bound of quotad serve (flush.DefaultCallTimeout; flush imports engine).
const DefaultLedgerTimeout = 10 * time.Second

// DefaultReseedWindow is Options.ReseedWindow's default.
const DefaultReseedWindow = 30 * time.Second

// DefaultReserveTimeout is Options.ReserveTimeout's default.
const DefaultReserveTimeout = 2 * time.Second

// Open recovers the engine from its log: the last good snapshot, the
// checkpoints, then every record above them.
func Open(opts Options) (*Engine, error) {
	if opts.Log == nil {
		return nil, errors.New("engine: Options.Log is required")
	}
	e := &Engine{opts: opts, log: opts.Log, clock: opts.Clock, params: opts.Params}
	e.ctx, e.cancel = context.WithCancel(context.Background())
	e.fillDefaults()
	prefix := make([]byte, 5)
	if _, err := rand.Read(prefix); err != nil {
		return nil, fmt.Errorf("engine: event id prefix: %w", err)
	}
	e.idPrefix = base32.HexEncoding.WithPadding(base32.NoPadding).EncodeToString(prefix) + "-"
	if err := e.recover(); err != nil {
		e.cancel()
		return nil, err
	}
	if opts.Reserver != nil {
		e.topups = make(chan string, 4096)
		e.wg.Add(1)
		go e.topupLoop()
	}
	return e, nil
}

func (e *Engine) fillDefaults() {
	if e.clock == nil {
		e.clock = NewSystemClock()
	}
	if e.opts.Stripes <= 0 {
		e.opts.Stripes = 256
	}
	def := shard.DefaultParams()
	if e.params.DedupWindow <= 0 {
		e.params.DedupWindow = def.DedupWindow
	}
	if e.params.DedupMax <= 0 {
		e.params.DedupMax = def.DedupMax
	}
	if e.params.MaxReplays == 0 {
		e.params.MaxReplays = def.MaxReplays
	}
	e.params.Reservations = e.opts.Reserver != nil
	if e.opts.ReserveWindow <= 0 {
		e.opts.ReserveWindow = time.Second
	}
	if e.opts.ExhaustedBackoff <= 0 {
		e.opts.ExhaustedBackoff = time.Second
	}
	if e.opts.LedgerTimeout <= 0 {
		e.opts.LedgerTimeout = DefaultLedgerTimeout
	}
	if e.opts.ReseedWindow == 0 {
		e.opts.ReseedWindow = DefaultReseedWindow
	}
	if e.opts.ReserveTimeout <= 0 {
		e.opts.ReserveTimeout = DefaultReserveTimeout
	}
	if e.opts.Logger == nil {
		e.opts.Logger = slog.New(slog.DiscardHandler)
	}
	e.stripes = make([]stripe, e.opts.Stripes)
	for i := range e.stripes {
		e.stripes[i].accounts = make(map[string]*entry)
	}
}

// Close stops the top-up loop. It does not close the log (its opener does).
func (e *Engine) Close() error {
	if e.closed.Swap(true) {
		return nil
	}
	e.cancel()
	e.wg.Wait()
	return nil
}

// Log is the engine's log.
func (e *Engine) Log() *wal.Log { return e.log }

// Clock is the engine's clock.
func (e *Engine) Clock() Clock { return e.clock }

// Stats are the engine's counters.
func (e *Engine) Stats() *Stats { return &e.stats }

// Snapshot is the config the engine serves from (nil before the first).
func (e *Engine) Snapshot() *snapshot.Snapshot { return e.snap.Load() }

func (e *Engine) stripeFor(account string) *stripe {
	return &e.stripes[xxhash.Sum64String(account)%uint64(len(e.stripes))]
}

// entryLocked finds or makes the account's entry from the snapshot. t is
// the account's tenure as this call read it (tenureLocked, or what
// mayDecideLocked returned): the ownership a decision is let through under
// and the tenure it is compared by come from one reading of the ring, since
// between two the account could go and come back. REQUIRES: st.mu held.
func (e *Engine) entryLocked(st *stripe, account string, t uint64) (*entry, bool) {
	snap := e.snap.Load()
	if snap == nil || !snap.HasAccount(account) {
		return nil, false
	}
	if ent, ok := st.accounts[account]; ok {
		if t != 0 {
			if ent.tenure != 0 && ent.tenure != t {
				ent.letGo = true // away and back: regained below
			}
			ent.tenure = t
		}
		if ent.letGo && e.ownsAtLocked(account, t) {
			e.regainLocked(ent)
		}
		return ent, true
	}
	cfg, _ := snap.AccountConfig(account)
	// reseed: the snapshot's use may count a charge whose refund another
	// owner (the account's last) had not settled when it was read; a refresh
	// only raises use, so those read after it came that hold every record of
	// this node's of the account set it to the ledger's (armReseed), as for
	// an account regained (regainLocked) or restored.
	ent := &entry{acct: shard.NewAccount(cfg), tenure: t}
	e.armReseed(ent)
	st.accounts[account] = ent
	return ent, true
}

// armReseed has ent's use follow the ledger's from the next refresh read
// (see entry.reseed).
func (e *Engine) armReseed(ent *entry) {
	ent.reseed, ent.reseedAfter = true, e.reads.Load()
	ent.reseedUntil = e.clock.Now().Mono
	if e.opts.ReseedWindow > 0 {
		ent.reseedUntil += int64(e.opts.ReseedWindow)
	}
}

func (e *Engine) ownsLocked(account string) bool {
	return e.opts.Owns == nil || e.opts.Owns(account)
}

// tenureLocked is Options.Tenure's answer (0 when it is not set).
// REQUIRES: the account's stripe mu held.
func (e *Engine) tenureLocked(account string) uint64 {
	if e.opts.Tenure == nil {
		return 0
	}
	return e.opts.Tenure(account)
}

// ownsAtLocked is ownsLocked where the tenure read as t says so too (0
// with Options.Tenure set: not this node's). REQUIRES: the account's
// stripe mu held.
func (e *Engine) ownsAtLocked(account string, t uint64) bool {
	return (e.opts.Tenure == nil || t != 0) && e.ownsLocked(account)
}

// mayDecideLocked returns nil when this node may decide for account now:
// it owns it (else ErrNotOwner) and Hold does not hold (else
// ErrQuotaUnavailable); and the account's tenure as read for it, for
// entryLocked. REQUIRES: the account's stripe mu held.
func (e *Engine) mayDecideLocked(account string) (uint64, error) {
	t := e.tenureLocked(account)
	if !e.ownsAtLocked(account, t) {
		return 0, fmt.Errorf("%w: %q", ErrNotOwner, account)
	}
	return t, e.holdLocked(account)
}

// mayRefundLocked is mayDecideLocked for a refund: Options.MayRefund may
// let it through where Owns does not. A take-back (abandonLog) is not held
// (Options.Hold): it undoes this node's own charge that nobody heard of,
// and answers nobody; held, a charge answered after a pause of the process
// (to a caller gone since) stayed, and was billed for a request that had
// failed. REQUIRES: the account's stripe mu held.
func (e *Engine) mayRefundLocked(account string, takeBack bool) (uint64, error) {
	t := e.tenureLocked(account)
	if !e.ownsAtLocked(account, t) && (e.opts.MayRefund == nil || !e.opts.MayRefund(account)) {
		return 0, fmt.Errorf("%w: %q", ErrNotOwner, account)
	}
	if takeBack {
		return t, nil
	}
	return t, e.holdLocked(account)
}

// holdLocked is Options.Hold's answer, as an error wrapping
// ErrQuotaUnavailable. REQUIRES: the account's stripe mu held.
func (e *Engine) holdLocked(account string) error {
	if e.opts.Hold != nil {
		if err := e.opts.Hold(); err != nil {
			return fmt.Errorf("%w: account %q: %w", ErrQuotaUnavailable, account, err)
		}
	}
	return nil
}

func (e *Engine) newEventID() string {
	return e.idPrefix + strconv.FormatUint(e.idSeq.Add(1), 36)
}

// appendLocked logs st.rec for ent. REQUIRES: st.mu held, st.rec.Type != 0.
func (e *Engine) appendLocked(st *stripe, ent *entry) (uint64, error) {
	st.buf = st.rec.AppendEncode(st.buf[:0])
	seq, err := e.log.Append(st.buf)
	if err != nil {
		err = fmt.Errorf("engine: log %s for account %q: %w", st.rec.Type, st.rec.Account, err)
		ent.broken = fmt.Errorf("%w (the account's state in memory is ahead of its log: it answers nothing until the node restarts from the log)", err)
		return 0, err
	}
	ent.acct.LastSeq = seq
	ent.dirty = true
	ent.noteRefund(seq, &st.rec, e.params.Reservations)
	return seq, nil
}

// noteRefund keeps seq as the account's last refund into its allowance
// (entry.refundSeq) or into the ledger's hard grants (entry.freedSeq) if
// rec is one.
func (ent *entry) noteRefund(seq uint64, rec *shard.Record, reservations bool) {
	switch {
	case rec.Type != shard.RecRefund || rec.Kept:
	case rec.Reserved:
		ent.refundSeq = max(ent.refundSeq, seq)
	case reservations: // only hard accounts reserve: a soft one's is never read
		ent.freedSeq = max(ent.freedSeq, seq)
	}
}

// maxBatchReserves bounds the accounts of one ChargeMany batch that ask the
// ledger for reservations at the same time.
const maxBatchReserves = 16

// maxReserveRounds bounds how often one charge asks the ledger: after a
// reservation the next decision is OK or QuotaExceeded unless concurrent
// charges took the units first (each round reserves for every charge
// waiting, so that takes a burst of first charges).
const maxReserveRounds = 5

// wait adds delta to the units of the account's charges waiting for a
// reservation.
func (e *Engine) wait(account string, delta int64) {
	st := e.stripeFor(account)
	st.mu.Lock()
	if ent, ok := st.accounts[account]; ok {
		ent.waiting = max(0, ent.waiting+delta) // NB: a sum addSat saturated comes back short: it only undersizes a reservation
	}
	st.mu.Unlock()
}

// Charge decides req for account and, when it charged, waits until the
// record is durable. An empty EventID gets a unique generated one. Errors are
// ErrNotOwner, ErrQuotaUnavailable, log failures and ctx's. A charge whose
// wait ctx ends first is taken back (abandon): the caller hears an error
// wrapping ErrQuotaUnavailable and nothing stays charged.
func (e *Engine) Charge(ctx context.Context, account string, req shard.Charge) (Result, error) {
	t0 := time.Now()
	res, err := e.decide(ctx, account, req)
	if err == nil && res.Seq > 0 {
		if werr := durableInTime(ctx, e.log.WaitDurable(ctx, res.Seq)); werr != nil {
			res, err = Result{}, e.abandon(account, res, werr)
		}
	}
	e.heard(account, &res.Decision, err, t0)
	return res, err
}

// errAnsweredLate is why a charge durable in time for nobody is taken back
// (durableInTime).
var errAnsweredLate = errors.New("durable only once the caller's context had ended (a pause of this process, or a deadline shorter than the wait for the disk)")

// durableInTime is werr, the wait for a charge's record, or, when the
// record became durable but the caller's context has ended by now, an
// error wrapping errAnsweredLate and ctx's: the answer would go to a caller
// gone (an RPC's deadline passed while the process was stopped, say) that
// retries elsewhere or reports a failure, while the charge stood and was
// billed for a request that failed. abandon takes such a charge back.
//
// The deadline is read as well as Err: a process resumed after a stop runs
// its goroutines before the timer that ends the context does, and Err was
// still nil for most of a second past the deadline.
func durableInTime(ctx context.Context, werr error) error {
	if werr != nil {
		return werr
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("%w: %w", errAnsweredLate, err)
	}
	if d, ok := ctx.Deadline(); ok && !time.Now().Before(d) {
		return fmt.Errorf("%w: %w", errAnsweredLate, context.DeadlineExceeded)
	}
	return nil
}

// abandon is the error of a charge whose durability wait failed (werr). When
// the wait's ctx ended (the caller's deadline: a disk slower than it, or a
// caller that left), the record will still become durable and settle, while
// the caller hears an error and keeps no receipt to refund it with: so the
// charge is taken back here, by a refund record logged after it, unless a
// retry was served under its event id meanwhile. The error then wraps
// ErrQuotaUnavailable and says a retry is safe, once the take-back is
// durable: a crash between the charge's record and its refund's bills the
// charge while the caller, told to retry, is charged again (without an
// Idempotency-Key); if it does not become durable within abandonWait (the
// caller is gone or late already), the error says the charge may be
// billed. Other failures (a failed or closed log) are returned as they
// are: the log takes nothing more.
func (e *Engine) abandon(account string, res Result, werr error) error {
	tb := e.abandonLog(account, res, werr)
	return tb.outcome(e.waitTakeBack(tb.seq))
}

// takenBack is a take-back logged by abandonLog, to wait for (seq, 0 for
// nothing logged) before saying what became of the charge (outcome).
type takenBack struct {
	err   error
	seq   uint64
	final bool // err is the answer as it is: nothing was taken back
}

func (e *Engine) abandonLog(account string, res Result, werr error) takenBack {
	err := fmt.Errorf("engine: charge %q of account %q not durable: %w", res.EventID, account, werr)
	if errors.Is(werr, errAnsweredLate) {
		err = fmt.Errorf("engine: charge %q of account %q %w", res.EventID, account, werr)
	}
	if !errors.Is(werr, context.Canceled) && !errors.Is(werr, context.DeadlineExceeded) {
		return takenBack{err: err, final: true}
	}
	if res.Receipt == nil {
		return takenBack{err: err}
	}
	before := e.log.LastSeq()
	d, _, rerr := e.refundLogged(account, res.EventID, true, func(a *shard.Account, now shard.Now, rec *shard.Record) shard.Decision {
		if res.Reason == shard.Replayed {
			return a.RefundReplay(res.EventID, res.Receipt, e.log.NodeID(), now, &e.params, rec)
		}
		return a.RefundAttempt(res.EventID, res.Receipt, e.log.NodeID(), now, &e.params, rec)
	})
	if rerr != nil {
		return takenBack{err: fmt.Errorf("%w; taking it back failed too (%v): it may be billed", err, rerr), final: true}
	}
	tb := takenBack{err: err}
	if d.Seq > before { // else no record (a retry was served under it, its refund asked before): nothing to wait for
		tb.seq = d.Seq
	}
	return tb
}

// waitTakeBack waits, within abandonWait, until seq (0: none) is durable.
func (e *Engine) waitTakeBack(seq uint64) error {
	if seq == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), abandonWait)
	defer cancel()
	return e.log.WaitDurable(ctx, seq)
}

// outcome is the take-back's error, given durable, the wait for its record.
func (tb takenBack) outcome(durable error) error {
	switch {
	case tb.final:
		return tb.err
	case tb.seq > 0 && durable != nil:
		return fmt.Errorf("%w: %w; taking it back did not become durable either (%v): it may be billed, "+
			"so retry only with the same event id (Idempotency-Key)", ErrQuotaUnavailable, tb.err, durable)
	}
	return fmt.Errorf("%w: %w; it was taken back, retry", ErrQuotaUnavailable, tb.err)
}

// abandonWait bounds abandon's wait for its take-back to be durable.
const abandonWait = 5 * time.Second

// ChargeEarly decides req like Charge but answers before the record is
// durable: the caller must call wait, and get nil from it, before it tells
// anyone outside the process that the charge happened. The HTTP front
// overlaps that wait with the upstream call: the decision (and the units it
// spent) is final in memory at once, and the client's answer waits for both.
func (e *Engine) ChargeEarly(ctx context.Context, account string, req shard.Charge) (Result, func(context.Context) error, error) {
	t0 := time.Now()
	res, err := e.decide(ctx, account, req)
	if err != nil {
		e.heard(account, &res.Decision, err, t0)
		return res, nil, err
	}
	wait := func(ctx context.Context) error {
		var werr error
		if res.Seq > 0 {
			if werr = e.log.WaitDurable(ctx, res.Seq); werr != nil {
				werr = fmt.Errorf("engine: charge %q of account %q not durable: %w", res.EventID, account, werr)
			}
		}
		e.heard(account, &res.Decision, werr, t0)
		return werr
	}
	return res, wait, nil
}

func (e *Engine) heard(account string, d *shard.Decision, err error, t0 time.Time) {
	if e.opts.OnCharge != nil {
		e.opts.OnCharge(account, d, err, time.Since(t0))
	}
}

// Request is one charge of a batch.
type Request struct {
	Account string
	Charge  shard.Charge
}

// Outcome is the answer to one charge of a batch.
type Outcome struct {
	Result
	Err error
}

// ChargeMany decides a batch of charges (any accounts), then waits once for
// the last record among them: one durability wait for the whole batch, as a
// forwarded batch from another node wants. The charges that need a
// reservation ask the ledger concurrently, after the others are decided.
func (e *Engine) ChargeMany(ctx context.Context, reqs []Request) []Outcome {
	t0 := time.Now()
	out := make([]Outcome, len(reqs))
	// Charges that need a reservation (a ledger round trip) are finished
	// after the first pass, one goroutine per account and at most
	// maxBatchReserves accounts at a time, so the batch waits for its slowest
	// round trip rather than for their sum (callers coalesce many accounts
	// into one batch). Within an account the batch's order holds: a charge
	// behind one that waits for the ledger waits with it, and is then paid
	// from the same reservation when it can be.
	var slow map[string][]int // account -> its waiting charges, in batch order; the first answered NeedReservation
	var accounts []string     // the keys of slow, in batch order
	reqCopies := make([]shard.Charge, len(reqs))
	for i := range reqs {
		reqCopies[i] = reqs[i].Charge
		acct := reqs[i].Account
		if waiting, ok := slow[acct]; ok {
			slow[acct] = append(waiting, i)
			continue
		}
		var needs bool
		out[i].Result, needs, out[i].Err = e.decideFirst(acct, &reqCopies[i])
		if needs {
			if slow == nil {
				slow = map[string][]int{}
			}
			slow[acct] = []int{i}
			accounts = append(accounts, acct)
		}
	}
	var wg sync.WaitGroup
	sem := make(chan struct{}, maxBatchReserves)
	for _, acct := range accounts {
		wg.Add(1)
		go func() { // ends when its account's charges are decided (ledger calls bounded by ctx)
			defer wg.Done()
			sem <- struct{}{} // NB: not abandoned on ctx: decideReserving must run to undo ent.waiting
			defer func() { <-sem }()
			idx := slow[acct]
			first := idx[0]
			out[first].Result, out[first].Err = e.decideReserving(ctx, acct, reqCopies[first], out[first].Result)
			for _, i := range idx[1:] {
				out[i].Result, out[i].Err = e.decide(ctx, acct, reqCopies[i])
			}
		}()
	}
	wg.Wait()
	var last uint64
	for i := range out {
		last = max(last, out[i].Seq)
	}
	if last > 0 {
		if err := durableInTime(ctx, e.log.WaitDurable(ctx, last)); err != nil {
			// Every charge taken back first, then one wait for them all
			// (abandon), not one fsync after another.
			tbs := make(map[int]takenBack)
			var back uint64
			for i := range out {
				if out[i].Err == nil && out[i].Seq > 0 {
					tbs[i] = e.abandonLog(reqs[i].Account, out[i].Result, err)
					back = max(back, tbs[i].seq)
				}
			}
			durable := e.waitTakeBack(back)
			for i, tb := range tbs {
				out[i] = Outcome{Err: tb.outcome(durable)}
			}
		}
	}
	for i := range out {
		e.heard(reqs[i].Account, &out[i].Decision, out[i].Err, t0)
	}
	return out
}

// decide applies a charge and logs it, asking for a reservation when the
// account needs one, without waiting for durability.
func (e *Engine) decide(ctx context.Context, account string, req shard.Charge) (Result, error) {
	res, needs, err := e.decideFirst(account, &req)
	if !needs {
		return res, err
	}
	return e.decideReserving(ctx, account, req, res)
}

// decideFirst gives req an event id if it has none and tries it once
// against what the node holds. needs reports that it asked for a
// reservation (res.Shortfall units): finish it with decideReserving.
func (e *Engine) decideFirst(account string, req *shard.Charge) (res Result, needs bool, err error) {
	if req.EventID == "" {
		req.EventID, req.ClientID = e.newEventID(), false
	}
	res, err = e.chargeOnce(account, req)
	if err != nil {
		return res, false, err
	}
	if res.Reason == shard.NeedReservation {
		return res, true, nil
	}
	e.count(res.Reason)
	return res, false, nil
}

// decideReserving goes on after a try that answered NeedReservation (res):
// it reserves from the ledger and tries again, at most maxReserveRounds
// times.
func (e *Engine) decideReserving(ctx context.Context, account string, req shard.Charge, res Result) (Result, error) {
	for round := 1; ; round++ {
		err := e.reserveForCharge(ctx, account, res.Shortfall)
		e.wait(account, -res.Shortfall)
		if err != nil {
			return res, err
		}
		if res, err = e.chargeOnce(account, &req); err != nil {
			return res, err
		}
		if res.Reason != shard.NeedReservation {
			e.count(res.Reason)
			return res, nil
		}
		if round == maxReserveRounds {
			e.wait(account, -res.Shortfall)
			return res, fmt.Errorf("%w: account %q: units reserved were taken by concurrent charges %d times", ErrQuotaUnavailable, account, round)
		}
	}
}

// reserveForCharge is reserve for a charge waiting on it: within
// ReserveTimeout, whether its own round trip or one in flight for the
// account (a background top-up, bounded only by LedgerTimeout).
//
// A ledger that left one unanswered past ReserveTimeout is not asked again
// for a waiting charge: the charge is refused at once, quota-unavailable,
// and a background top-up of its account asks instead (one call at a time,
// within LedgerTimeout), whose answer ends the stall. Each charge used to
// wait ReserveTimeout again, and with it every charge batched with it
// (ChargeMany waits for its slowest reservation): soft accounts, which need
// no reservation, were answered late or, queued behind such batches at the
// callers, not at all while the ledger hung.
func (e *Engine) reserveForCharge(ctx context.Context, account string, shortfall int64) error {
	if at := e.stalledAt.Load(); at != 0 {
		e.askLedger(account)
		e.stats.ReserveErrors.Add(1)
		return fmt.Errorf("%w: account %q: the ledger left a reservation unanswered past its bound %s ago; refused at once until it answers the node's background one",
			ErrQuotaUnavailable, account, time.Duration(e.clock.Now().Mono-at).Round(time.Millisecond))
	}
	rctx, cancel := context.WithTimeout(ctx, e.opts.ReserveTimeout)
	defer cancel()
	err := e.reserve(rctx, account, shortfall)
	switch {
	case err != nil && timedOut(ctx, rctx):
		e.stats.ReserveTimeouts.Add(1)
		e.noteStall()
		if !errors.Is(err, ErrQuotaUnavailable) { // it waited for a round trip in flight
			err = fmt.Errorf("%w: account %q: no reservation within %s: %w", ErrQuotaUnavailable, account, e.opts.ReserveTimeout, err)
		}
	case err == nil:
		e.stalledAt.Store(0)
	}
	return err
}

// noteStall marks the ledger as leaving reservations unanswered.
func (e *Engine) noteStall() {
	e.stalledAt.Store(max(1, e.clock.Now().Mono)) // NB: 0 means no stall
}

// askLedger queues a top-up of account, unless one is queued, so that the
// ledger is asked in the background while charges are refused at once.
func (e *Engine) askLedger(account string) {
	st := e.stripeFor(account)
	st.mu.Lock()
	defer st.mu.Unlock()
	ent, ok := st.accounts[account]
	if !ok || ent.topping {
		return
	}
	select {
	case e.topups <- account:
		ent.topping = true
	default: // the loop is behind; the next charge tries again
	}
}

func (e *Engine) count(r shard.Reason) {
	switch r {
	case shard.OK:
		e.stats.Charges.Add(1)
	case shard.Replayed:
		e.stats.Replayed.Add(1)
	default:
		e.stats.Refused.Add(1)
	}
}

func (e *Engine) chargeOnce(account string, req *shard.Charge) (Result, error) {
	st := e.stripeFor(account)
	st.mu.Lock()
	defer st.mu.Unlock()
	t, err := e.mayDecideLocked(account)
	if err != nil {
		return Result{}, err
	}
	ent, ok := e.entryLocked(st, account, t)
	if !ok {
		return Result{Decision: shard.Decision{Reason: shard.UnknownAccount}, EventID: req.EventID}, nil
	}
	if ent.broken != nil {
		return Result{}, ent.broken
	}
	now := e.clock.Now()
	was := ent.acct.Period()
	d := ent.acct.Charge(req, now, &e.params, &st.rec)
	keepPeriodLocked(ent, was)
	res := Result{Decision: d, EventID: req.EventID}
	if d.Reason == shard.NeedReservation {
		ent.waiting = addSat(ent.waiting, d.Shortfall) // until the caller's reservation round trip ends (wait)
	}
	if st.rec.Type == 0 {
		return res, nil
	}
	seq, err := e.appendLocked(st, ent)
	if err != nil {
		return Result{}, err
	}
	// A replay's answer waits for its own record, after the charge it
	// replays (the log is durable in order). G2.
	res.Seq = seq
	r := &st.rec
	if r.Type == shard.RecReplay {
		// The replay's receipt is the charge's, from this node: with it
		// RefundReplay takes the replay back here or, after the account
		// moved, at its next owner.
		// Its record's seq names this replay (ReplaySeq): taken back twice,
		// it counts off once.
		res.Receipt = &shard.Receipt{EventID: r.EventID, Account: r.Account, Node: e.log.NodeID(), Gen: r.Gen, Units: r.Units, Period: r.Period, Wall: r.ChargeWall,
			Key: r.Key, Route: r.Route, Allocs: slices.Clone(r.Allocs), ReplaySeq: seq}
		return res, nil
	}
	res.Receipt = &shard.Receipt{EventID: r.EventID, Account: r.Account, Node: e.log.NodeID(), Gen: r.Gen, Units: r.Units, Period: r.Period, Wall: r.Wall, Key: r.Key, Route: r.Route, Allocs: slices.Clone(r.Allocs)}
	if e.params.Reservations {
		e.noteSpendLocked(account, ent, req.Units, now)
	}
	return res, nil
}

// Refund returns the units of an event once and waits until the refund is
// durable. receipt may be nil for client-supplied event ids.
func (e *Engine) Refund(ctx context.Context, account, eventID string, receipt *shard.Receipt) (shard.Decision, error) {
	return e.refund(ctx, account, eventID, receipt, false)
}

// RefundAttempt refunds the charge one attempt made, unless a retry was
// served under it since (shard.Account.RefundAttempt): the HTTP front's
// refund of a failed or abandoned attempt.
func (e *Engine) RefundAttempt(ctx context.Context, account, eventID string, receipt *shard.Receipt) (shard.Decision, error) {
	return e.refund(ctx, account, eventID, receipt, true)
}

// RefundReplay takes back a retry that was answered Replayed and then not
// served (shard.Account.RefundReplay). receipt is the Replayed answer's (nil
// when the caller kept none: then only a replay this node answered is found).
func (e *Engine) RefundReplay(ctx context.Context, account, eventID string, receipt *shard.Receipt) (shard.Decision, error) {
	return e.refundWith(ctx, account, eventID, func(a *shard.Account, now shard.Now, rec *shard.Record) shard.Decision {
		return a.RefundReplay(eventID, receipt, e.log.NodeID(), now, &e.params, rec)
	})
}

func (e *Engine) refund(ctx context.Context, account, eventID string, receipt *shard.Receipt, attempt bool) (shard.Decision, error) {
	return e.refundWith(ctx, account, eventID, func(a *shard.Account, now shard.Now, rec *shard.Record) shard.Decision {
		if attempt {
			return a.RefundAttempt(eventID, receipt, e.log.NodeID(), now, &e.params, rec)
		}
		return a.Refund(eventID, receipt, e.log.NodeID(), now, &e.params, rec)
	})
}

// refundWith applies one kind of refund under the account's lock, logs its
// record and waits until it is durable.
func (e *Engine) refundWith(ctx context.Context, account, eventID string, apply func(*shard.Account, shard.Now, *shard.Record) shard.Decision) (shard.Decision, error) {
	d, wait, err := e.refundLogged(account, eventID, false, apply)
	if err != nil || !wait {
		return d, err
	}
	if err := e.log.WaitDurable(ctx, d.Seq); err != nil {
		return shard.Decision{}, fmt.Errorf("engine: refund %q of account %q not durable: %w", eventID, account, err)
	}
	return d, nil
}

// refundLogged applies one kind of refund under the account's lock and logs
// its record, without waiting; wait says whether the answer rests on a
// record (d.Seq) that may not be durable yet. takeBack: see mayRefundLocked.
func (e *Engine) refundLogged(account, eventID string, takeBack bool, apply func(*shard.Account, shard.Now, *shard.Record) shard.Decision) (d shard.Decision, wait bool, err error) {
	st := e.stripeFor(account)
	st.mu.Lock()
	t, err := e.mayRefundLocked(account, takeBack)
	if err != nil {
		st.mu.Unlock()
		return shard.Decision{}, false, err
	}
	ent, ok := e.entryLocked(st, account, t)
	if !ok {
		st.mu.Unlock()
		return shard.Decision{Reason: shard.UnknownAccount}, false, nil
	}
	if ent.broken != nil {
		st.mu.Unlock()
		return shard.Decision{}, false, ent.broken
	}
	was := ent.acct.Period()
	d = apply(ent.acct, e.clock.Now(), &st.rec)
	keepPeriodLocked(ent, was)
	if st.rec.Type == 0 && (d.Reason == shard.AlreadyRefunded || d.Reason == shard.Kept) {
		// Answers that rest on records that may not be durable yet (the
		// refund, or the retry served under the charge): wait for the
		// account's last record.
		d.Seq = max(d.Seq, ent.acct.LastSeq)
	}
	if st.rec.Type != 0 {
		seq, err := e.appendLocked(st, ent)
		if err != nil {
			st.mu.Unlock()
			return shard.Decision{}, false, err
		}
		d.Seq = seq
		if d.Reason == shard.Refunded {
			e.stats.Refunds.Add(1) // not a kept refund's or a replay's record
		}
	}
	st.mu.Unlock()
	return d, d.Seq > 0, nil
}

// Usage reports an account's current period from the state that enforces.
func (e *Engine) Usage(account string) (shard.Usage, bool, error) {
	st := e.stripeFor(account)
	st.mu.Lock()
	defer st.mu.Unlock()
	t, err := e.mayDecideLocked(account)
	if err != nil {
		return shard.Usage{}, false, err
	}
	ent, ok := e.entryLocked(st, account, t)
	if !ok {
		return shard.Usage{}, false, nil
	}
	was := ent.acct.Period()
	u := ent.acct.Usage(e.clock.Now())
	keepPeriodLocked(ent, was)
	return u, true, nil
}

// keepPeriodLocked marks ent for the next checkpoint when a decision moved
// the account to a later month than was, whether or not it logged a record:
// an answer that logged none (a refusal, a usage read) named that month too,
// and the account must not answer from an earlier one after a restart (G9;
// its clock may have been put right by then). REQUIRES: the stripe's mu.
func keepPeriodLocked(ent *entry, was shard.Period) {
	if ent.acct.Period() != was {
		ent.dirty = true
	}
}

// AllowanceHeld is the sum of the units this node holds reserved and has
// not spent, over every account (for metrics and the status page).
func (e *Engine) AllowanceHeld() int64 {
	var n int64
	for i := range e.stripes {
		st := &e.stripes[i]
		st.mu.Lock()
		for _, ent := range st.accounts {
			for _, a := range ent.acct.Allowances() {
				n += a.Units
			}
		}
		st.mu.Unlock()
	}
	return n
}

// Held is an allowance this node holds: units of an account's grant the
// ledger reserved for it and it has not spent (below zero: owed, see
// TakeBack).
type Held struct {
	Account, Grant string
	Units          int64
}

// Held lists every allowance this node holds, by account and grant: what
// the ledger's reservations for this node should show, beyond the units
// in doubt (Stats.UncertainUnits). quotad admin reservations compares the
// two, to name the accounts whose units are stranded.
func (e *Engine) Held() []Held {
	var out []Held
	for i := range e.stripes {
		st := &e.stripes[i]
		st.mu.Lock()
		for id, ent := range st.accounts {
			for _, a := range ent.acct.Allowances() {
				out = append(out, Held{Account: id, Grant: a.Grant, Units: a.Units})
			}
		}
		st.mu.Unlock()
	}
	slices.SortFunc(out, func(a, b Held) int {
		if c := cmpString(a.Account, b.Account); c != 0 {
			return c
		}
		return cmpString(a.Grant, b.Grant)
	})
	return out
}

// AccountView is an account as the status page and tests see it.
type AccountView struct {
	ID     string
	Usage  shard.Usage
	Grants []shard.GrantView
}

// Accounts lists the accounts this node holds state for, sorted by id.
func (e *Engine) Accounts() []AccountView {
	now := e.clock.Now()
	var out []AccountView
	for i := range e.stripes {
		st := &e.stripes[i]
		st.mu.Lock()
		for id, ent := range st.accounts {
			was := ent.acct.Period()
			out = append(out, AccountView{ID: id, Usage: ent.acct.Usage(now), Grants: ent.acct.Grants()})
			keepPeriodLocked(ent, was)
		}
		st.mu.Unlock()
	}
	slices.SortFunc(out, func(a, b AccountView) int { return cmpString(a.ID, b.ID) })
	return out
}

func cmpString(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// AllSettled is SetSnapshot's settled for a snapshot whose settled use
// counts every record this node logged: one made by hand (tests, bench).
const AllSettled = ^uint64(0)

// A ReadMark is taken (Engine.ReadMark) just before the ledger is asked for
// a snapshot, and handed with it to SetSnapshotRead: it tells what the
// snapshot can hold.
type ReadMark struct {
	// Settled is the log's settled mark (Log().SettledSeq()): the
	// snapshot's settled use includes this node's records up to it.
	Settled uint64
	// read numbers the read among those begun (Engine.reads): an account
	// that came here after it began gets no use set from it (entry.reseed).
	read uint64
}

// ReadMark marks a ledger read about to begin: see SetSnapshotRead.
func (e *Engine) ReadMark() ReadMark {
	return ReadMark{Settled: e.log.SettledSeq(), read: e.reads.Add(1)}
}

// SetSnapshot is SetSnapshotRead for a snapshot current when it is set (one
// made by hand: tests, bench), whose settled use counts this node's records
// up to settled.
func (e *Engine) SetSnapshot(s *snapshot.Snapshot, settled uint64) error {
	return e.SetSnapshotRead(s, ReadMark{Settled: settled, read: ^uint64(0)})
}

// SetSnapshotRead makes s the config to serve from, keeps it in the log as
// the last good one (when its version is new), and applies it to every
// account this node holds.
//
// m is the ReadMark taken before the ledger was asked for s. An account
// with records above m.Settled keeps its use as counted here
// (shard.AccountConfig.UseBehind): its charge may have settled and its
// refund not, and the ledger's figure would count that charge again. An
// account that came (back) here after m was taken keeps it too, raised at
// most: s may lack what its last owner settled before letting it go.
func (e *Engine) SetSnapshotRead(s *snapshot.Snapshot, m ReadMark) error {
	settled := m.Settled
	if old := e.snap.Load(); old != nil && old.Version == s.Version && e.kept.Load() {
		e.applySnapshot(s, m) // same config; fresher settled use for new accounts
		return nil
	}
	data, err := s.Encode()
	if err != nil {
		return fmt.Errorf("engine: encode snapshot %d: %w", s.Version, err)
	}
	if err := e.log.PutMeta(metaSnapshot, data); err != nil {
		return fmt.Errorf("engine: keep snapshot %d: %w", s.Version, err)
	}
	// After the snapshot: a crash in between pairs it with an older mark,
	// which counts its use for fewer accounts at the next start, never more.
	if err := e.log.PutMeta(metaSnapshotSettled, binary.BigEndian.AppendUint64(nil, settled)); err != nil {
		return fmt.Errorf("engine: keep snapshot %d's settled mark: %w", s.Version, err)
	}
	e.applySnapshot(s, m)
	e.kept.Store(true)
	return nil
}

func (e *Engine) applySnapshot(s *snapshot.Snapshot, m ReadMark) {
	settled := m.Settled
	e.snapSettled.Store(settled)
	e.snap.Store(s)
	mono := e.clock.Now().Mono
	dropped := false
	defer func() {
		if dropped {
			e.storeForgotten()
		}
	}()
	for i := range e.stripes {
		st := &e.stripes[i]
		st.mu.Lock()
		for id, ent := range st.accounts {
			if ent.letGo && e.forgetLocked(st, id, ent) {
				dropped = true
				continue
			}
			if cfg, ok := s.AccountConfig(id); ok {
				cfg.UseBehind = ent.acct.LastSeq > settled
				cfg.Reseed = ent.reseed && m.read > ent.reseedAfter
				ent.acct.Configure(cfg)
				if cfg.Reseed && !cfg.UseBehind && mono >= ent.reseedUntil {
					ent.reseed = false
				}
			}
		}
		st.mu.Unlock()
	}
}

// metaSnapshot keeps the last good config snapshot. (Data dirs written
// before the node's clock could step back also hold "engine.wall", a
// high-water mark of the clock that nothing reads any more.)
const metaSnapshot = "engine.snapshot"

// metaSnapshotSettled keeps the settled mark the kept snapshot was read at
// (8 bytes, big-endian): a restart counts the snapshot's settled use for an
// account whose checkpoint is not past it (restore). Absent (written by an
// earlier build), it counts for none until the first refresh.
const metaSnapshotSettled = "engine.snapshot.settled"
