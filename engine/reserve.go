package engine

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/wal"
)

// reserve asks the ledger for shortfall units plus a chunk sized to recent
// use, and logs what it got. Concurrent callers for one account share one
// round trip.
func (e *Engine) reserve(ctx context.Context, account string, shortfall int64) error {
	return e.flights.do(ctx, account, func() error { return e.reserveOnce(ctx, account, shortfall) })
}

func (e *Engine) reserveOnce(ctx context.Context, account string, shortfall int64) error {
	st := e.stripeFor(account)
	st.mu.Lock()
	t, err := e.mayDecideLocked(account)
	if err != nil {
		st.mu.Unlock()
		return err
	}
	ent, ok := e.entryLocked(st, account, t)
	if !ok {
		st.mu.Unlock()
		return nil
	}
	now := e.clock.Now()
	wall := ent.acct.Wall(now.Wall) // the account's month, which may be ahead of this clock
	need := addSat(max(shortfall, ent.waiting), max(ent.chunkLocked(now.Mono, int64(e.opts.ReserveWindow)), chunkFloor(ent.acct.Limit(wall))))
	freed := ent.freedSeq
	st.mu.Unlock()

	if shortfall > 0 && freed > e.log.SettledSeq() {
		// A refund gave units of this account back to the ledger's grant
		// (shard: Account.refund), and the ledger has them only once it
		// settles: asked before, it would answer the grant exhausted and
		// the charge would be refused while this node shows units left.
		if err := e.waitSettled(ctx, freed); err != nil {
			return fmt.Errorf("%w: account %q: a refund of its units is not settled in the ledger yet (log record %d): %v; retry shortly",
				ErrQuotaUnavailable, account, freed, err)
		}
	}

	e.stats.Reservations.Add(1)
	asked := e.log.SettledSeq() // the ledger's answer includes this node's refunds up to here
	res, err := e.opts.Reserver.Reserve(ctx, ReserveRequest{Account: account, Wall: wall, Need: need})
	if err != nil {
		e.stats.ReserveErrors.Add(1)
		if unc, ok := errors.AsType[*ReserveUncertainError](err); ok {
			e.stats.UncertainUnits.Add(unc.Units)
		}
		return fmt.Errorf("%w: the ledger could not reserve units: account %q: %v", ErrQuotaUnavailable, account, err)
	}
	giveBack, err := e.applyReservation(account, asked, res)
	if err != nil {
		// Granted in the ledger, and not (all) in the allowance: the log
		// did not take it.
		e.stats.UncertainUnits.Add(granted(res) - units(giveBack))
	}
	if len(giveBack) > 0 {
		if rerr := e.opts.Reserver.Release(ctx, account, giveBack, 0); rerr != nil {
			e.stats.UncertainUnits.Add(units(giveBack))
			e.opts.Logger.Warn("reservation left stranded in the ledger; it returns at this node's next restart or with quotad revoke",
				"account", account, "allocs", giveBack, "err", rerr)
		}
	}
	if err == nil && len(giveBack) > 0 && units(giveBack) == granted(res) {
		// Nothing the ledger granted could be used. An account that moved
		// away meanwhile answers NotOwner at the next try; one still here
		// holds grants older than the ledger's.
		st.mu.Lock()
		owned := e.ownsLocked(account)
		st.mu.Unlock()
		if owned {
			return fmt.Errorf("%w: account %q: the ledger granted units of grants this node does not hold (%v: its config snapshot is older than the ledger's); handed back, retry shortly",
				ErrQuotaUnavailable, account, giveBack)
		}
	}
	if err == nil && len(res.HeldElsewhere) > 0 && granted(res) < shortfall {
		return fmt.Errorf("%w: account %q: the units it lacks are reserved by other nodes (an owner handing over, or a lost node: quotad revoke); retry shortly",
			ErrQuotaUnavailable, account)
	}
	return err
}

// addSat is a+b for non-negative a and b, or math.MaxInt64 when that
// overflows. A reservation asks for as much as can be had: wrapped to a
// negative Need, a charge near the int64 limit got nothing from the ledger
// and ended ErrQuotaUnavailable, retried forever, instead of QuotaExceeded.
func addSat(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

func granted(res ReserveResult) int64 { return units(res.Granted) }

func units(allocs []shard.Alloc) int64 {
	var n int64
	for _, a := range allocs {
		n += a.Units
	}
	return n
}

// applyReservation logs the granted units as allowance. Units for a grant
// this node does not know (its snapshot is older than the ledger's) or for an
// account it no longer owns are handed back. asked is the log's settled mark
// when the ledger was asked: a grant it called exhausted is not marked so
// when a refund of the account was unsettled then (entry.freedSeq), since
// the refund's units are free there once it settles (a top-up answered
// after a refund marked the grant exhausted again, and the next charge was
// refused without asking).
func (e *Engine) applyReservation(account string, asked uint64, res ReserveResult) (giveBack []shard.Alloc, err error) {
	st := e.stripeFor(account)
	st.mu.Lock()
	defer st.mu.Unlock()
	// NB: ownership first: entryLocked makes the entry of an account
	// forgotten since the reservation was asked, and it stayed, owned by
	// nobody here and never dropped.
	t := e.tenureLocked(account)
	if !e.ownsAtLocked(account, t) {
		return res.Granted, nil
	}
	ent, ok := e.entryLocked(st, account, t)
	if !ok {
		return res.Granted, nil
	}
	now := e.clock.Now()
	var total int64
	for _, g := range res.Granted {
		if g.Units == 0 {
			continue
		}
		if !ent.acct.Reserve(g.Grant, g.Units, now, &st.rec) {
			giveBack = append(giveBack, g)
			continue
		}
		if _, err := e.appendLocked(st, ent); err != nil {
			return giveBack, err
		}
		total += g.Units
	}
	if total > 0 {
		ent.chunk = total
	}
	if ent.freedSeq > asked {
		return giveBack, nil
	}
	for _, id := range res.Exhausted {
		ent.acct.MarkExhausted(id, now.Mono+int64(e.opts.ExhaustedBackoff))
	}
	return giveBack, nil
}

// maxChunkFloor caps chunkFloor.
const maxChunkFloor = 1000

// chunkFloor is the least a reservation asks for beyond what is short: 1 %
// of the account's active grants, at most 1,000 units. Without it an account
// charged a few times a second would go back to the ledger every couple of
// charges (a busy node with thousands of such accounts would spend itself
// on reservation round trips). What it costs: a node that dies holds at most
// that much of the account frozen until it restarts or is revoked.
func chunkFloor(limit int64) int64 {
	return min(maxChunkFloor, max(1, limit/100))
}

// chunkLocked is twice the units the account used in the last window (a
// reservation that lasts about two settle intervals), and at least half the
// last reservation: after a pause the account's recent use reads zero, and
// reserving only what one charge lacks would make every charge after it wait
// for the ledger. So the size decays by half per reservation instead.
func (ent *entry) chunkLocked(mono, window int64) int64 {
	ent.rollLocked(mono, window)
	return max(2*max(ent.winUnits, ent.prevUnits), ent.chunk/2)
}

func (ent *entry) rollLocked(mono, window int64) {
	switch {
	case mono-ent.winStart >= 2*window:
		ent.prevUnits, ent.winUnits, ent.winStart = 0, 0, mono
	case mono-ent.winStart >= window:
		ent.prevUnits, ent.winUnits, ent.winStart = ent.winUnits, 0, ent.winStart+window
	}
}

// noteSpendLocked tracks use and queues a top-up when less than half of the
// last reservation is left. REQUIRES: the stripe lock.
func (e *Engine) noteSpendLocked(account string, ent *entry, units int64, now shard.Now) {
	ent.rollLocked(now.Mono, int64(e.opts.ReserveWindow))
	ent.winUnits += units
	if ent.topping || ent.chunk == 0 || !ent.acct.Plan().Hard || ent.acct.Allowance(ent.acct.Wall(now.Wall))*2 > ent.chunk {
		return
	}
	select {
	case e.topups <- account:
		ent.topping = true
	default: // the loop is behind; the next charge tries again
	}
}

// topupLoop reserves ahead for accounts that spent half their reservation,
// and retries the hand-backs the ledger refused.
func (e *Engine) topupLoop() {
	defer e.wg.Done()
	retry := time.NewTicker(retryReleaseEvery)
	defer retry.Stop()
	for {
		select {
		case <-e.ctx.Done():
			return
		case <-retry.C:
			if !e.unreleased.empty() {
				e.retryReleasesOnce()
			}
		case account := <-e.topups:
			e.topUp(account)
		}
	}
}

// topUp reserves ahead for account, giving up after LedgerTimeout: the
// loop serves every account and the release retries, so one call left
// unanswered must not hold it. REQUIRES: the top-up loop's goroutine.
func (e *Engine) topUp(account string) {
	e.stats.TopUps.Add(1)
	ctx, cancel := context.WithTimeout(e.ctx, e.opts.LedgerTimeout)
	err := e.reserve(ctx, account, 0)
	switch {
	case err == nil:
		// The ledger answers: charges ask it again. (Only a success ends a
		// stall: a ledger that fails fast would refuse them anyway.)
		e.stalledAt.Store(0)
	case timedOut(e.ctx, ctx):
		e.stats.ReserveTimeouts.Add(1)
		e.noteStall()
		if ok, held := e.hungLog.Allow(time.Now(), time.Minute); ok {
			e.opts.Logger.Warn("the ledger did not answer a reservation top-up within --ledger-timeout; cancelled. "+
				"The node serves from the units it holds, charges past them answer quota-unavailable; "+
				"if the reserve committed after all, its units stay reserved for this node until its next start or stop frees them",
				"account", account, "ledger_timeout", e.opts.LedgerTimeout, "err", err, "similar_lines_held_back", held)
		}
	case err != nil:
		e.opts.Logger.Debug("top-up failed; the next charge that needs units will ask", "account", account, "err", err)
	}
	cancel()
	st := e.stripeFor(account)
	st.mu.Lock()
	if ent, ok := st.accounts[account]; ok {
		ent.topping = false
	}
	st.mu.Unlock()
}

// retryReleasesOnce is one round of the release retries, within
// LedgerTimeout. REQUIRES: the top-up loop's goroutine.
func (e *Engine) retryReleasesOnce() {
	ctx, cancel := context.WithTimeout(e.ctx, e.opts.LedgerTimeout)
	defer cancel()
	err := e.RetryReleases(ctx)
	switch {
	case err != nil && timedOut(e.ctx, ctx):
		e.stats.ReserveTimeouts.Add(1)
		if ok, held := e.hungLog.Allow(time.Now(), time.Minute); ok {
			e.opts.Logger.Warn("the ledger did not answer a retried hand-back within --ledger-timeout; cancelled and retried every second",
				"ledger_timeout", e.opts.LedgerTimeout, "err", err, "similar_lines_held_back", held)
		}
	case err != nil:
		e.opts.Logger.Debug("hand-back still refused by the ledger; retrying", "err", err)
	}
}

// timedOut reports whether cctx, derived from ctx, ended at its own
// deadline while ctx goes on: a call given up for its bound, not for its
// caller (a Close, a client gone).
func timedOut(ctx, cctx context.Context) bool {
	return ctx.Err() == nil && errors.Is(cctx.Err(), context.DeadlineExceeded)
}

// bookkeeping is the time at which allowances are zeroed, handed back or
// taken back: none (the account's own latest). Those are no decisions, and
// must not move the account to the month of the clock: zeroing what a node
// kept at start ran before the node had checked its clock against the
// ledger's, and a node restarted with its clock a month ahead moved every
// account it held an allowance of into that month, where it then billed
// them (a period never goes back, G9), beside the others' this month (G3:
// chaos --faults all --seed 7).
func bookkeeping() shard.Now { return shard.Now{} }

// LetGo is Release then Forget, for an account the ring took from this
// node. It lets the account go even when the hand-back fails (the
// allowance is zeroed in the log first, and the ledger's half is retried
// in the background): kept as an ordinary account, it would answer from
// its state of before the loss if the ring gave it back (see
// regainLocked). It returns Release's error.
func (e *Engine) LetGo(ctx context.Context, account string) error {
	err := e.Release(ctx, account)
	e.Forget(account)
	return err
}

// releaseTimeout bounds a hand-back once the allowance is zeroed.
const releaseTimeout = 5 * time.Second

// Release hands the account's allowance back to the ledger: first logged
// here (so a crash can only strand units, never let this node spend units
// the ledger gave back), then released there. Used on handoff. Once the
// allowance is zeroed, the hand-back runs to its end (within
// releaseTimeout) even if ctx ends.
//
// An allowance that holds units a refund gave back is handed back only
// once that refund is settled (the top-up loop sends it then, and Release
// returns nil meanwhile): the ledger adds those units to the reservation
// when the refund settles, and a hand-back that came first was floored at
// zero there, so the refund's units then stayed reserved for a node that
// held none, until its next drain or start (see entry.refundSeq).
func (e *Engine) Release(ctx context.Context, account string) error {
	if e.opts.Reserver == nil {
		return nil
	}
	allocs, seq, after, err := e.zeroAllowance(account)
	if err != nil || len(allocs) == 0 {
		return err
	}
	// NB: the allowance is zeroed in the log now, so the hand-back must
	// finish even if the caller gives up: a node that gets SIGTERM while it
	// hands back the accounts a ring change took from it cancels the
	// context here, and the units would stay reserved in the ledger for
	// nobody until it restarts or an operator revokes them.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
	defer cancel()
	// Queued first, then sent with any earlier release of the account still
	// waiting, in seq order: sent straight away, a newer release could
	// apply before an older one, whose retry the ledger would then skip as
	// applied (its key is older than the row's) though it never was.
	//
	// Queued even when the zeroing record is not durable within the bound
	// (a slow fsync, or this process stopped by SIGSTOP past it): the retry
	// loop sends it once the record is (sendReleases). Returned unqueued,
	// the account was let go (LetGo) with nothing left to hand its units
	// back, and the ledger kept them reserved for a node that held none
	// until it stopped (quotad chaos --faults pause,kill --seed 21, RES
	// before the drain).
	e.unreleased.add(account, pendingRelease{seq: seq, allocs: allocs, after: after})
	if err := e.log.WaitDurable(ctx, seq); err != nil {
		return fmt.Errorf("engine: release of account %q: the record zeroing its allowance is not durable yet (%w); the hand-back is retried in the background once it is", account, err)
	}
	if err := e.sendReleases(ctx, account); err != nil && !waiting(err) {
		return fmt.Errorf("engine: release of account %q in the ledger (retried in the background; the units stay reserved until then): %w", account, err)
	}
	return nil
}

// errRefundUnsettled stops sendReleases at a hand-back that waits for a
// refund to settle (pendingRelease.after).
var errRefundUnsettled = errors.New("engine: the hand-back waits until the refunds before it are settled")

// errZeroingNotDurable stops sendReleases at a hand-back whose zeroing
// record is not durable yet: sent before, a crash would restart this node
// with the allowance in its log while the ledger gave the units to others
// (G1).
var errZeroingNotDurable = errors.New("engine: the hand-back waits until the record zeroing the allowance is durable")

// waiting reports whether sendReleases stopped at a hand-back that waits
// for this node's log (errRefundUnsettled, errZeroingNotDurable), not for
// the ledger: no failure, the retry loop sends it when it may go.
func waiting(err error) bool {
	return errors.Is(err, errRefundUnsettled) || errors.Is(err, errZeroingNotDurable)
}

// sendReleases sends the queued releases of account to the ledger in seq
// order, stopping at the first that fails (it and the rest stay queued for
// the retry loop). One sender at a time (unreleased.send), so that a
// release and the retry loop never send one account's releases out of
// order.
func (e *Engine) sendReleases(ctx context.Context, account string) error {
	sem := e.unreleased.sendSem()
	select {
	case sem <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("%w (the release stays queued)", ctx.Err())
	}
	defer func() { <-sem }()
	pending := e.unreleased.takeAccount(account)
	defer e.unreleased.sent()
	for i, p := range pending {
		var err error
		switch {
		case p.seq > e.log.DurableSeq():
			err = errZeroingNotDurable
		case p.after > e.log.SettledSeq():
			err = errRefundUnsettled
		default:
			err = e.opts.Reserver.Release(ctx, account, p.allocs, p.seq)
		}
		if err != nil {
			for _, q := range pending[i:] { // in order: the rest waits
				e.unreleased.add(account, q)
			}
			return err
		}
	}
	return nil
}

// retryReleaseEvery is how often the top-up loop retries hand-backs the
// ledger refused.
const retryReleaseEvery = time.Second

// unreleased holds allowances zeroed in the log whose release in the ledger
// failed (the ledger down or slow): their units are nobody's until released,
// so they are retried every retryReleaseEvery by the top-up loop and first
// thing in ReleaseAll, rather than left until this node restarts or an
// operator runs quotad revoke.
//
// A failed release may have applied (its answer was lost), so each keeps
// the seq of the record that zeroed it, the key under which the ledger
// applies it once (Reserver.Release), and the releases of one account are
// retried in seq order, never merged: merged under the later seq, an
// earlier release that had applied would apply again.
type unreleased struct {
	mu sync.Mutex // protects m, sending and send
	m  map[string][]pendingRelease
	// sending is the account whose releases the sender took out of m and
	// is sending now ("" when none): they are on their way, not done.
	sending string
	send    chan struct{} // holds a token while one goroutine sends releases (sendReleases)
}

// sendSem is the one-token semaphore of the release sender.
func (u *unreleased) sendSem() chan struct{} {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.send == nil {
		u.send = make(chan struct{}, 1)
	}
	return u.send
}

// takeAccount removes and returns account's queued releases, in seq order.
// REQUIRES: the send token; sent ends the send.
func (u *unreleased) takeAccount(account string) []pendingRelease {
	u.mu.Lock()
	defer u.mu.Unlock()
	p := u.m[account]
	delete(u.m, account)
	u.sending = account
	return p
}

// sent marks the end of the send takeAccount began: what failed is in m
// again.
func (u *unreleased) sent() {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.sending = ""
}

// handingBack lists the accounts with releases queued or being sent.
func (u *unreleased) handingBack() []string {
	u.mu.Lock()
	defer u.mu.Unlock()
	ids := make([]string, 0, len(u.m)+1)
	for id := range u.m {
		ids = append(ids, id)
	}
	if u.sending != "" {
		ids = append(ids, u.sending)
	}
	return ids
}

// accounts lists the accounts with queued releases.
func (u *unreleased) accounts() []string {
	u.mu.Lock()
	defer u.mu.Unlock()
	var ids []string
	for id := range u.m {
		ids = append(ids, id)
	}
	return ids
}

// pendingRelease is one release not applied yet: the allocations, the seq
// of the log record that zeroed them, and the seq the log must be settled
// to before it is sent (the account's last refund into its allowance, see
// Release; 0: none).
type pendingRelease struct {
	seq, after uint64
	allocs     []shard.Alloc
}

func (u *unreleased) add(account string, p pendingRelease) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.m == nil {
		u.m = map[string][]pendingRelease{}
	}
	u.m[account] = append(u.m[account], p)
	slices.SortFunc(u.m[account], func(a, b pendingRelease) int { return cmp.Compare(a.seq, b.seq) })
}

func (u *unreleased) empty() bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	return len(u.m) == 0
}

// Reserving lists the accounts with a reservation on its way: asked of the
// ledger, and its answer not yet in the allowance or, for an account the
// node lost meanwhile, not yet handed back. The ledger may hold its units
// for this node already: under a slow ledger, for seconds.
func (e *Engine) Reserving() []string { return e.flights.keys() }

// HandingBack lists the accounts with a hand-back queued (the ledger
// refused it, or it waits for this node's log) or on its way: the ledger
// still reserves their units for this node, which holds none of them,
// until it arrives.
func (e *Engine) HandingBack() []string { return e.unreleased.handingBack() }

// RetryReleases retries the hand-backs the ledger refused (see Release) and
// returns the first error; what fails again is kept for the next try.
func (e *Engine) RetryReleases(ctx context.Context) error {
	var first error
	for _, account := range e.unreleased.accounts() {
		if err := e.sendReleases(ctx, account); err != nil && !waiting(err) && first == nil {
			first = fmt.Errorf("engine: release of account %q in the ledger: %w", account, err)
		}
	}
	return first
}

// zeroAllowance zeroes the account's allowance in the log. It returns the
// units it held (the positive allowances: what goes back to the ledger),
// the seq of the last zeroing record, and the seq of the account's last
// refund into its allowance (entry.refundSeq).
func (e *Engine) zeroAllowance(account string) (allocs []shard.Alloc, seq, refundSeq uint64, err error) {
	st := e.stripeFor(account)
	st.mu.Lock()
	defer st.mu.Unlock()
	ent, ok := st.accounts[account]
	if !ok {
		return nil, 0, 0, nil
	}
	for _, a := range ent.acct.Allowances() {
		ent.acct.Reserve(a.Grant, -a.Units, bookkeeping(), &st.rec)
		s, err := e.appendLocked(st, ent)
		if err != nil {
			return nil, 0, 0, err
		}
		seq = s
		// Only units held go back to the ledger: an allowance below zero
		// (overdrawn by TakeBack) is zeroed here, and handed back it would
		// add to the reservation.
		if a.Units > 0 {
			allocs = append(allocs, a)
		}
	}
	ent.chunk = 0
	return allocs, seq, ent.refundSeq, nil
}

// AccountIDs lists the accounts this node holds state for.
func (e *Engine) AccountIDs() []string {
	var ids []string
	for i := range e.stripes {
		st := &e.stripes[i]
		st.mu.Lock()
		for id := range st.accounts {
			ids = append(ids, id)
		}
		st.mu.Unlock()
	}
	return ids
}

// flightGroup runs one call per key at a time; callers that arrive while it
// runs wait for it and share its error (groupcache's singleflight).
type flightGroup struct {
	mu    sync.Mutex // protects calls
	calls map[string]*flight
}

type flight struct {
	done chan struct{}
	err  error
}

// keys lists the keys with a call running.
func (g *flightGroup) keys() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	keys := make([]string, 0, len(g.calls))
	for k := range g.calls {
		keys = append(keys, k)
	}
	return keys
}

func (g *flightGroup) do(ctx context.Context, key string, fn func() error) error {
	g.mu.Lock()
	if f, ok := g.calls[key]; ok {
		g.mu.Unlock()
		select {
		case <-f.done:
			return f.err
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if g.calls == nil {
		g.calls = make(map[string]*flight)
	}
	f := &flight{done: make(chan struct{})}
	g.calls[key] = f
	g.mu.Unlock()
	f.err = fn()
	g.mu.Lock()
	delete(g.calls, key)
	g.mu.Unlock()
	close(f.done)
	return f.err
}

// TakeBack removes units from the account's allowance without asking the
// ledger: the settler calls it for a refund the ledger found to be a
// duplicate (the units had been credited here but not there). It logs the
// change like any reservation change. Only refund records older versions
// logged credit the allowance (shard.Record.Reserved): refunds now give
// their units to the ledger's grant.
//
// It may take the allowance below zero: a hand-back since gave the
// credited units back with the rest, and the ledger took them off the
// reservation (or floored it at zero). The allowance then owes them, and
// the account's next reservation repays them. An allowance below zero is
// never handed back (zeroAllowance): a hand-back of a negative amount
// added units to the ledger's reservation that the node did not hold,
// stranded until it stopped (quotad chaos --seed 12, RES before the
// drain). The units overdrawn count in doubt (Stats.UncertainUnits): where
// the ledger floored the hand-back at zero, it holds them reserved.
func (e *Engine) TakeBack(ctx context.Context, account string, allocs []shard.Alloc) error {
	return e.takeBack(ctx, account, allocs, false)
}

// TakeBackUncertain is TakeBack for refunds the ledger may or may not have
// credited (a settle applied by an attempt whose answer was lost): the
// units taken back are counted in Stats.UncertainUnits, since the ledger
// may hold them reserved for this node.
func (e *Engine) TakeBackUncertain(ctx context.Context, account string, allocs []shard.Alloc) error {
	return e.takeBack(ctx, account, allocs, true)
}

// takeBack is TakeBack, counting in doubt every unit it takes (uncertain)
// or only those it overdraws.
func (e *Engine) takeBack(ctx context.Context, account string, allocs []shard.Alloc, uncertain bool) error {
	st := e.stripeFor(account)
	st.mu.Lock()
	ent, ok := st.accounts[account]
	if !ok {
		st.mu.Unlock()
		return nil
	}
	held := map[string]int64{}
	for _, a := range ent.acct.Allowances() {
		held[a.Grant] = a.Units
	}
	var seq uint64
	var doubt int64
	for _, a := range allocs {
		if a.Units <= 0 || !ent.acct.Reserve(a.Grant, -a.Units, bookkeeping(), &st.rec) {
			continue
		}
		if uncertain {
			doubt += a.Units
		} else {
			doubt += a.Units - min(a.Units, max(held[a.Grant], 0)) // overdrawn
		}
		held[a.Grant] -= a.Units
		s, err := e.appendLocked(st, ent)
		if err != nil {
			st.mu.Unlock()
			return err
		}
		seq = s
	}
	st.mu.Unlock()
	e.stats.UncertainUnits.Add(doubt)
	if seq == 0 {
		return nil
	}
	return e.log.WaitDurable(ctx, seq)
}

// ReleaseAll hands every allowance back (graceful shutdown, and the reset at
// start once the log is settled). It returns the first error and goes on
// with the other accounts, until ctx ends.
func (e *Engine) ReleaseAll(ctx context.Context) error {
	first := e.RetryReleases(ctx)
	for _, id := range e.AccountIDs() {
		if err := ctx.Err(); err != nil {
			// Out of time (each Release may take releaseTimeout against a
			// ledger that hangs, one after another): the rest keep their
			// allowances, in the log and the ledger, for the next start
			// or the drain's releaseStranded.
			if first == nil {
				first = fmt.Errorf("engine: release of every account: %w (the rest keep their allowances)", err)
			}
			break
		}
		if err := e.Release(ctx, id); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// ZeroAllowances sets every local allowance to zero (logged) without telling
// the ledger: used at start, right before the ledger frees all of this
// node's reservations in one statement.
func (e *Engine) ZeroAllowances(ctx context.Context) error {
	var last uint64
	for _, id := range e.AccountIDs() {
		_, seq, _, err := e.zeroAllowance(id)
		if err != nil {
			return err
		}
		last = max(last, seq)
	}
	if last == 0 {
		return nil
	}
	return e.log.WaitDurable(ctx, last)
}

// Prefetch reserves units for an account ahead of its first charge (a new
// owner taking over an account that was active elsewhere). It does nothing
// for accounts this node does not own or whose plan is not hard.
func (e *Engine) Prefetch(ctx context.Context, account string, units int64) error {
	if e.opts.Reserver == nil || units <= 0 {
		return nil
	}
	st := e.stripeFor(account)
	st.mu.Lock()
	t := e.tenureLocked(account)
	hard := false
	if e.ownsAtLocked(account, t) { // not entryLocked first: see applyReservation
		ent, ok := e.entryLocked(st, account, t)
		hard = ok && ent.acct.Plan().Hard
	}
	st.mu.Unlock()
	if !hard {
		return nil
	}
	return e.reserve(ctx, account, units)
}

// Forget drops the state of an account this node no longer owns and holds
// no allowance for, so that if it comes back it starts from the config
// snapshot's settled use instead of this node's stale count. Records of it
// still in the log settle as usual. It reports whether it dropped anything.
//
// While the snapshot lacks some of the account's records (read before they
// settled), the state stays until one that includes them arrives: seeded
// from it, an account regained at once would miss its own unsettled charges
// or, worse, count a settled charge whose refund had not settled, for good
// (a refresh only raises use). Kept, it is the exact count of this node's
// own charges; if the account comes back meanwhile, its client ids go and
// the next complete refresh sets its use to the ledger's (regainLocked).
// The drop is written at once (storeForgotten).
func (e *Engine) Forget(account string) bool {
	st := e.stripeFor(account)
	st.mu.Lock()
	ent, ok := st.accounts[account]
	if !ok {
		st.mu.Unlock()
		return false
	}
	ent.letGo = true
	dropped := e.forgetLocked(st, account, ent)
	st.mu.Unlock()
	if dropped {
		e.storeForgotten()
	}
	return dropped
}

// regainLocked is an account let go (Forget kept it: the snapshot lacked
// its records) that is this node's again: what it remembers from before the
// loss is stale, since the other owner may have refunded or charged its ids
// and refunded its charges meanwhile. Its ids go (as Forget's would), and
// its use is set to the ledger's (not only raised) by the snapshots read
// after it came back that include every record of it (armReseed).
// REQUIRES: the account's stripe mu held.
func (e *Engine) regainLocked(ent *entry) {
	if !ent.letGo {
		return
	}
	ent.letGo = false
	ent.acct.ForgetIDs()
	ent.acct.ForgetRoutes()
	ent.dirty = true
	e.armReseed(ent)
}

// forgetLocked drops ent if Forget may now: see Forget. It clears letGo
// when the account is this node's again. REQUIRES: st.mu held.
func (e *Engine) forgetLocked(st *stripe, account string, ent *entry) bool {
	if e.ownsLocked(account) {
		e.regainLocked(ent)
		return false
	}
	if len(ent.acct.Allowances()) > 0 || ent.waiting > 0 || ent.acct.LastSeq > e.snapSettled.Load() {
		return false
	}
	// Forgotten, its dedup memory goes with it, as when it was never here:
	// back in memory it starts from the config snapshot, with no ids, and
	// a restart must not bring back ids another owner may have refunded or
	// replayed since. So its stored ids are dropped, whether its state
	// changed since its checkpoint (then stored too) or not.
	switch {
	case ent.dirty:
		cp := checkpointOf(account, ent.acct)
		cp.IDs, cp.ResetIDs = nil, true
		e.keepForgotten(cp, true)
	case ent.acct.MayHaveStoredIDs():
		e.keepForgotten(wal.Checkpoint{Account: account, Seq: ent.acct.LastSeq, IDsOnly: true, ResetIDs: true}, true)
	}
	delete(st.accounts, account)
	return true
}
