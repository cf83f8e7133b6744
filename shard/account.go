package shard

import (
	"slices"
	"strconv"
	"strings"
	"time"
)

// Receipt is what a charge's caller keeps to refund it later: the event and
// which grants paid how much. Refunds of client ids need no receipt (the
// account remembers them); generated ids are not remembered, so their refund
// carries the receipt the charge returned.
type Receipt struct {
	EventID string
	// Account is the account charged (set by the engine): a refund with
	// the receipt for another account is refused (Invalid). Empty in
	// receipts of older builds, which are not checked.
	Account string
	// Node is the node that charged (set by the engine): an attempt's refund
	// that reaches another owner names it (Record.Origin).
	Node   string
	Gen    uint32 // the charge's generation of a client id (see Record.Gen)
	Units  int64
	Period Period
	Wall   int64
	Key    string
	Route  string
	Allocs []Alloc
	// ReplaySeq, on a Replayed answer's receipt, is the seq of the replay's
	// own log record at Node: it names that replay, so that RefundReplay
	// takes it back once however often it is asked (a retry after a lost
	// answer counted it off twice, and could release the attempt's refund
	// while another replay was served). 0 on a charge's receipt, and in
	// receipts of older builds, whose take-backs are not told apart.
	ReplaySeq uint64
}

// Refundable reports whether a charge of period charged may still be
// refunded by its receipt in period now: in its own month and the next,
// never later. The ledger may drop the event log of the months before
// (quotad prune), and a refund it could not match to its event would
// return units twice or not at all; a receipt that old is refused
// (UnknownEvent), as a client id older than the dedup window is.
func Refundable(charged, now Period) bool { return charged >= now-1 }

// RefundedWindow is how long an account remembers the events it refunded
// (up to Params.DedupMax of them), so that a receipt is refunded once: as
// long as Refundable takes it, its charge's month and the next, which is at
// most 62 days after the charge. It was the dedup window (24 h), after
// which the same receipt was refunded again.
const RefundedWindow = int64(62 * 24 * time.Hour)

// elsewhereKey is the key in Account.refunded of an attempt's refund of
// another node's charge (RefundAttempt): per node, since each attempt
// charged at its own.
func elsewhereKey(eventID string, gen uint32, chargeWall int64, node string) string {
	return refundedKey(eventID, gen, chargeWall) + "\x00@" + node
}

// refundedKey is the key of a charge's refund in Account.refunded: its
// event id, generation and time, which name one charge (a client id used
// again after its dedup window starts at generation 0 again, and its new
// charge must stay refundable). A NUL never occurs in an event id: see
// storable.
func refundedKey(eventID string, gen uint32, chargeWall int64) string {
	return eventID + "\x00" + strconv.FormatUint(uint64(gen), 10) + "\x00" + strconv.FormatInt(chargeWall, 10)
}

// takeBackKey is the key in Account.refunded of a replay taken back: the
// event id and generation, the node that answered the replay ("" for this
// one: records name another node only, in Origin) and the seq of the
// replay's record there, which names that replay.
func takeBackKey(eventID string, gen uint32, node string, replaySeq uint64) string {
	return eventID + "\x00" + strconv.FormatUint(uint64(gen), 10) + "\x00#" + node + "\x00" + strconv.FormatUint(replaySeq, 10)
}

// fits reports whether r can be a receipt of a charge of account: its
// account (when it names one) is account, and its units are those of a
// charge, all allocated. The engine trusts receipts as the proof of a
// charge it does not remember (a generated id); these checks catch one
// passed with the wrong account, or altered.
func (r *Receipt) fits(account string) bool {
	if (r.Account != "" && r.Account != account) || r.Units <= 0 || r.Units > MaxUnits {
		return false
	}
	var sum int64
	for _, al := range r.Allocs {
		if al.Units <= 0 || al.Units > MaxUnits {
			return false
		}
		sum += al.Units
	}
	return sum == r.Units
}

// holds reports whether this owner's use of each of allocs' grants that it
// has covers the units to give back: a charge made here was counted here
// (or settled, which the use includes), so a refund of more than a grant's
// use names a charge that never was.
func (a *Account) holds(allocs []Alloc) bool {
	for _, al := range allocs {
		if g := a.grant(al.Grant); g != nil && g.used < al.Units {
			return false
		}
	}
	return true
}

// fromElsewhere reports whether r is the receipt of eventID from another
// node than self (the account moved since): nothing of that charge, or of
// that replay, is in this node's state.
func (r *Receipt) fromElsewhere(eventID, self string) bool {
	return r != nil && r.Node != "" && r.Node != self && r.EventID == eventID
}

// event is what the dedup window remembers of a client-id charge.
type event struct {
	gen      uint32 // generation: a refunded client id charged again is a new one
	units    int64
	seq      uint64
	period   Period
	chargeAt int64
	// chargeMono is the monotonic clock at the charge, when this process
	// made it (0: logged before a restart): see nextGen. Not stored.
	chargeMono int64
	refunded   bool
	// replays counts retries answered Replayed whose requests may have been
	// served under this charge (RefundReplay takes back a failed one); while
	// it is above zero an attempt's refund (RefundAttempt) is held as
	// pending, and applies when the last replay is refunded too.
	replays int32
	pending bool
	key     string
	route   string
	target  uint64 // Charge.Target of the charge; 0: none, or logged by a quotad that did not keep it
	allocs  []Alloc
}

// spentID is what an account keeps of a client id its dedup window let go
// in the current period: the generation of the id's last charge, and
// whether that charge was refunded.
type spentID struct {
	gen      uint32
	refunded bool
	mono     int64 // event.chargeMono; not stored
}

// spentWindow bounds how long a spent id is kept by time; rollTo drops them
// all at the end of their period anyway (the ledger names events per period).
const spentWindow = int64(32 * 24 * time.Hour)

// grant is one spendable pot: the plan's monthly quota for a period, or bought
// credits.
type grant struct {
	id        string
	monthly   bool
	startsAt  int64
	expiresAt int64 // 0: never
	units     int64
	used      int64 // settled use seeded from the ledger plus this owner's own
	allowance int64 // reservations mode: reserved for this node and not spent
	// exhaustedUntil (Now.Mono) is set when the ledger had no free units: until
	// then a shortfall answers QuotaExceeded without asking again. Volatile.
	exhaustedUntil int64
	// unseen is use this owner cannot count itself, as the ledger last
	// showed it: when the ledger found the grant exhausted (every unit used
	// or reserved by this node), units - allowance - used; cleared when the
	// ledger grants more. It is what other nodes charged and had not
	// settled when this owner seeded the account (an owner that died, say).
	// Views only (Remaining, MonthUsed, Usage): allocate goes by used, so
	// the ledger is still asked once units are freed elsewhere. Volatile.
	unseen int64
}

func (g *grant) active(wall int64) bool {
	return g.startsAt <= wall && (g.expiresAt == 0 || wall < g.expiresAt)
}

func (g *grant) free() int64 { return max(0, g.units-g.used) }

// creditsAt sums what the account's bought credits (not monthly grants)
// still have free that are active at wall, or start later and have not
// expired by then.
func (a *Account) creditsAt(wall int64) int64 {
	var n int64
	for i := range a.grants {
		g := &a.grants[i]
		if !g.monthly && (g.expiresAt == 0 || wall < g.expiresAt) {
			n += g.free() // NB: at most 10^18 together (the admin API's bound)
		}
	}
	return n
}

// creditStartFits is the earliest start of a credit grant that has not
// started at wall, before end, from which on the grants active have free
// units for the charge; 0 when none does. A refusal told to come back at
// the month's end (or never, with no monthly quota) when bought credits
// start within the hour was retried weeks late, or not at all.
func (a *Account) creditStartFits(units, wall, end int64) int64 {
	var best int64
	for i := range a.grants {
		t := a.grants[i].startsAt
		if a.grants[i].monthly || t <= wall || t >= end || best != 0 && t >= best {
			continue
		}
		var free int64
		for j := range a.grants {
			if g := &a.grants[j]; g.active(t) {
				free += g.free()
			}
		}
		if free >= units {
			best = t
		}
	}
	return best
}

// settledAtLeast raises the grant's use to what the ledger has settled
// (every node's charges), when that is more than this owner counted: after
// the account moved away and back, the other owner's charges are settled
// there and were never counted here. Settled use is a lower bound of the
// true use when the ledger holds every record this owner logged for the
// account (Configure checks), so this never counts a unit twice; and it
// only lowers free(), which stays above what the ledger has free, so the
// ledger is still asked whenever it has units. What it adds comes off unseen, which estimated
// the same use.
func (g *grant) settledAtLeast(settled int64) {
	if d := settled - g.used; d > 0 {
		g.used = settled
		g.unseen = max(0, g.unseen-d)
	}
}

// settled takes the ledger's settled use: raised to it (settledAtLeast),
// or, with reseed, set to it when lower (refunds another owner settled of
// charges this owner counted); what the ledger showed that this owner
// never counted stays unseen.
func (g *grant) settled(settled int64, reseed bool) {
	if reseed && settled < g.used {
		g.used = max(settled, 0)
		return
	}
	g.settledAtLeast(settled)
}

// shownUsed and shownFree are the use and what is left as answers show
// them: with the use the ledger showed that this owner did not count.
func (g *grant) shownUsed() int64 { return g.used + g.unseen }
func (g *grant) shownFree() int64 { return max(0, g.units-g.shownUsed()) }

// Account is the state of one account at its owner. The zero value is not
// usable: make one with NewAccount.
type Account struct {
	cfg    AccountConfig
	period Period // the latest period seen; never goes back
	// seen is the latest wall reading seen (Unix ns), the account's own
	// clock: it never goes back. The dedup window is measured from it, so a
	// clock that jumps back neither revives an id that was forgotten nor
	// forgets one early, and records carry it as their wall, so an account's
	// records are in order even when the node's clock steps back (a refund
	// is never dated before a charge it preceded). The node's clock itself
	// may step back: a month's jump and its correction leave only the
	// accounts billed meanwhile in the later month.
	seen     int64
	bucket   Bucket
	grants   []grant // sorted by expiry (never last), then id
	routes   map[string]int64
	dedup    idWindow[event]
	refunded idWindow[struct{}] // ids refunded through a receipt
	// spent keeps, for the rest of the period, the generation of each
	// client id the dedup window let go (see nextGen).
	spent idWindow[spentID]
	// LastSeq is the log sequence of the last record this account emitted or
	// replayed; a checkpoint covers the records up to it.
	LastSeq uint64
}

// NewAccount makes the state for cfg. The first operation opens its period,
// unless the ledger already billed the account in a later month than this
// node's clock reads (see Configure).
func NewAccount(cfg AccountConfig) *Account {
	a := &Account{}
	a.Configure(cfg)
	return a
}

// ID is the account's id.
func (a *Account) ID() string { return a.cfg.ID }

// Plan is the account's current plan.
func (a *Account) Plan() Plan { return a.cfg.Plan }

// Period is the latest period the account has seen (it never goes back).
func (a *Account) Period() Period { return a.period }

// Configure applies a new config: an upgrade applies at once, a downgrade
// below what is used blocks further charges and erases nothing. When the
// ledger has billed the account in a later month than its period
// (cfg.MonthlyUsed: a node whose clock ran ahead owned it meanwhile), the
// account moves there, since a period never goes back (G9): a new owner
// starts there, and one that kept the account in memory catches up at its
// next config refresh. Likewise a grant's use never reads less than the
// ledger has settled (cfg.MonthlyUsed, Credit.Used): what another owner
// charged while the account was away is counted from the next refresh
// that includes every record this owner logged for the account (not
// cfg.UseBehind): settled use is a lower bound of the true use only then.
func (a *Account) Configure(cfg AccountConfig) {
	defer func() {
		a.catchUp(cfg)
		a.settledRoutes(cfg)
	}()
	a.cfg = cfg
	if !cfg.Plan.Rate.Unlimited() && a.bucket.init {
		a.bucket.reconfigure(&a.cfg.Plan)
	}
	kept := a.grants[:0]
	for _, g := range a.grants {
		units := g.units
		if g.monthly {
			g.units = cfg.Plan.MonthlyQuota
			if !cfg.UseBehind {
				g.settled(cfg.MonthlyUsed[g.id], cfg.Reseed)
			}
		} else if c, ok := findCredit(cfg.Credits, g.id); ok {
			g.units, g.startsAt, g.expiresAt = c.Units, c.StartsAt, c.ExpiresAt
			if !cfg.UseBehind {
				g.settled(c.Used, cfg.Reseed)
			}
		} else {
			continue
		}
		if g.units > units {
			// The ledger called the grant exhausted at fewer units: an
			// upgrade asks it again at once, rather than refusing until the
			// mark ends with Retry-After the month's end.
			g.exhaustedUntil = 0
		}
		kept = append(kept, g)
	}
	clear(a.grants[len(kept):])
	a.grants = kept
	for _, c := range cfg.Credits {
		if a.grant(c.ID) == nil {
			a.grants = append(a.grants, grant{id: c.ID, startsAt: c.StartsAt, expiresAt: c.ExpiresAt, units: c.Units, used: c.Used})
		}
	}
	a.sortGrants()
}

// reach moves the account to the month of a later month's monthly grant
// the ledger named (see Reserve).
func (a *Account) reach(grantID string) {
	if p, ok := MonthlyPeriod(grantID); ok {
		a.moveTo(p)
	}
}

// moveTo opens period p if it is later than the account's (never back).
func (a *Account) moveTo(p Period) {
	if p > a.period {
		a.rollTo(p)
		a.seen = max(a.seen, p.Start())
	}
}

// catchUp moves the account to the latest month cfg says it has use in,
// if that is later than its period.
func (a *Account) catchUp(cfg AccountConfig) {
	var latest Period
	for id, used := range cfg.MonthlyUsed {
		if p, ok := MonthlyPeriod(id); ok && used > 0 && p > latest {
			latest = p
		}
	}
	a.moveTo(latest)
}

// settledRoutes takes the ledger's split by route of the account's period
// (cfg.RouteUsed) as the grants take their settled use: each route raised
// to it, or with cfg.Reseed set to it; and only from a config read after
// every record this owner logged for the account settled (not UseBehind),
// so that the ledger's figures hold this owner's charges too. Until then
// the split counts what this owner charged since the account came here.
func (a *Account) settledRoutes(cfg AccountConfig) {
	if cfg.UseBehind {
		return
	}
	settled := cfg.RouteUsed[a.period.String()]
	if cfg.Reseed {
		for r := range a.routes {
			if _, ok := settled[r]; !ok {
				delete(a.routes, r) // its charges were refunded elsewhere
			}
		}
	}
	for r, n := range settled {
		if cur := a.routes[r]; n > cur || (cfg.Reseed && n < cur) {
			a.addRoute(r, n-cur)
		}
	}
}

func findCredit(cs []GrantConfig, id string) (GrantConfig, bool) {
	for _, c := range cs {
		if c.ID == id {
			return c, true
		}
	}
	return GrantConfig{}, false
}

func (a *Account) sortGrants() {
	slices.SortFunc(a.grants, func(x, y grant) int {
		return CompareSpending(x.id, x.expiresAt, y.id, y.expiresAt)
	})
}

// CompareSpending orders two grants, given by id and expiry (Unix ns, 0 for
// never), in spending order: the one that expires sooner first, a grant that
// never expires last; of two that expire together, the month's quota before
// credits (a credit bought "until the end of the year" must not be spent
// while December's quota, which lapses at the same instant, is untouched),
// then by id. The ledger reserves in the same order (flush).
func CompareSpending(xID string, xExpires int64, yID string, yExpires int64) int {
	if xExpires != yExpires {
		switch {
		case xExpires == 0:
			return 1
		case yExpires == 0:
			return -1
		case xExpires < yExpires:
			return -1
		}
		return 1
	}
	xm, ym := strings.HasPrefix(xID, "m:"), strings.HasPrefix(yID, "m:")
	switch {
	case xm && !ym:
		return -1
	case ym && !xm:
		return 1
	}
	return strings.Compare(xID, yID)
}

func (a *Account) grant(id string) *grant {
	for i := range a.grants {
		if a.grants[i].id == id {
			return &a.grants[i]
		}
	}
	return nil
}

// advance moves the account to the period of wall unless it has seen a later
// one, and returns the period and the wall reading to use: never before the
// period's start, so a clock that jumped back cannot reactivate old grants.
func (a *Account) advance(wall int64) (Period, int64) {
	if p := PeriodOf(wall); p > a.period {
		a.rollTo(p)
	}
	a.seen = max(a.seen, wall)
	return a.period, max(wall, a.period.Start())
}

// rollTo opens period p: a fresh monthly grant and zeroed route usage. Monthly
// grants of periods before the previous one are dropped (refunds of them are
// still logged and settled; there is just nothing left here to credit).
func (a *Account) rollTo(p Period) {
	a.period = p
	clear(a.routes)
	a.settledRoutes(a.cfg) // what other owners settled in p
	if a.spent.len() > 0 {
		// The ledger names events per period: a client id's first charge
		// in the new one is generation 0 again.
		a.spent = idWindow[spentID]{}
		a.RewriteIDs()
	}
	id := MonthlyGrantID(p)
	if a.grant(id) == nil {
		a.grants = append(a.grants, grant{id: id, monthly: true, startsAt: p.Start(), expiresAt: p.End(),
			units: a.cfg.Plan.MonthlyQuota, used: a.cfg.MonthlyUsed[id]})
	}
	a.grants = slices.DeleteFunc(a.grants, func(g grant) bool {
		return g.monthly && g.expiresAt <= (p-1).Start() && g.allowance == 0
	})
	a.sortGrants()
}

// Charge decides req at now. On OK it fills rec with the charge to log, on
// Replayed with the replay (RecReplay); otherwise rec is left with Type 0 and
// the state is unchanged, except that a new period may have opened and the
// bucket refilled.
func (a *Account) Charge(req *Charge, now Now, params *Params, rec *Record) Decision {
	rec.Type = 0
	p, wall := a.advance(now.Wall)
	d := Decision{Reset: p.End() / 1e9}
	if req.Units < 0 || req.Units > MaxUnits || req.EventID == "" || !storable(req.EventID) || !storable(req.Key) || !storable(req.Route) ||
		req.ClientID && ClientIDProblem(req.EventID) != "" {
		d.Reason = Invalid
		return d
	}
	plan := &a.cfg.Plan
	var gen uint32
	var replay event // the charge this one replays, when replaying is set
	replaying := false
	if req.ClientID {
		a.expireIDs(params)
		if e, ok := a.dedup.get(req.EventID, a.seen, params.DedupWindow); !ok {
			gen = a.nextGen(req.EventID, now.Mono, params)
		} else {
			switch {
			case e.refunded:
				// Refunded (the work failed): a retry with the same id is a
				// new charge, the id's next generation, not a free replay.
				gen = e.gen + 1
			case (e.target != 0 && req.Target != 0 && e.target != req.Target) ||
				(e.route != req.Route && (e.target == 0 || e.target != req.Target)):
				// The id names a charge for another route, or another
				// request: a client bug (one key for two requests), never a
				// retry. Replaying it would serve the new request for the
				// old one's units, or for nothing. The same request (its
				// Target) under another route name is a retry across a
				// change of the route table (or a node that has not read it
				// yet): refused, a client that believed "a new request
				// needs a new key" ran the work twice.
				d.Reason = IDReused
				a.fill(&d, now, wall)
				return d
			case params.MaxReplays > 0 && e.replays >= params.MaxReplays:
				// Served that often already: a retry loop sends far fewer,
				// so this is one key reused for new work (new bodies on the
				// same request), each run of which would be free.
				d.Reason = ReplayLimit
				a.fill(&d, now, wall)
				return d
			default:
				replay, replaying = e, true
			}
		}
	}
	if !plan.Rate.Unlimited() {
		a.bucket.refill(plan, now.Mono)
		if ok, wait := a.bucket.allow(plan); !ok {
			d.Reason, d.RetryAfter = RateLimited, wait
			a.fill(&d, now, wall)
			return d
		}
	}
	if replaying {
		// A replay is billed once but served again: it took the rate-limit
		// check above and takes a token like any request, so resending one
		// Idempotency-Key does not get around the rate limit.
		if !plan.Rate.Unlimited() {
			a.bucket.take(plan)
		}
		replay.replays++
		a.dedup.update(req.EventID, replay)
		// Logged like a charge: the count survives a restart, and the ledger
		// holds the charge billed while the replay may be served, even when
		// its attempt's refund reaches the account's next owner.
		rec.reset(RecReplay, a.cfg.ID, a.seen)
		rec.EventID, rec.Gen, rec.Period, rec.Delta = req.EventID, replay.gen, replay.period, 1
		// The charge replayed, for its receipt (not in the log's record).
		rec.Key, rec.Route, rec.Units, rec.ChargeWall = replay.key, replay.route, replay.units, replay.chargeAt
		rec.Allocs = append(rec.Allocs, replay.allocs...)
		d.Reason, d.Units, d.Seq = Replayed, replay.units, replay.seq
		a.fill(&d, now, wall)
		return d
	}
	rec.reset(RecCharge, a.cfg.ID, a.seen)
	if req.Units > 0 {
		if short, exhausted := a.allocate(req.Units, wall, now.Mono, params, rec); short > 0 {
			rec.Type = 0
			d.Reason, d.Shortfall = a.refusal(exhausted, params), short
			if d.Reason == QuotaExceeded {
				d.Shortfall = 0
				d.RetryAfter = Never
				if plan.MonthlyQuota > 0 && req.Units <= plan.MonthlyQuota+a.creditsAt(p.End()) {
					// NB: a request that costs more than the next month
					// gives (its quota, and the credits still active
					// then) is not helped by waiting: it was told to
					// come back next month, and refused again then.
					d.RetryAfter = p.End() - wall
				}
				if t := a.creditStartFits(req.Units, wall, p.End()); t != 0 {
					d.RetryAfter, d.CreditsStart = t-wall, true
				}
			}
			a.fill(&d, now, wall)
			return d
		}
		rec.Reserved = a.reserved(params)
		a.spend(rec.Allocs, 1, rec.Reserved)
	}
	if !plan.Rate.Unlimited() {
		a.bucket.take(plan)
	}
	if req.Units == 0 {
		rec.Type = 0 // rate limited but free: nothing to bill, nothing to log
	} else {
		a.addRoute(req.Route, req.Units)
		rec.EventID, rec.ClientID, rec.Key, rec.Route = req.EventID, req.ClientID, req.Key, req.Route
		rec.Units, rec.Period, rec.Gen = req.Units, p, gen
		if req.ClientID {
			rec.Target = req.Target
			a.dedup.put(req.EventID, a.seen, event{gen: gen, units: req.Units, period: p, chargeAt: a.seen, chargeMono: now.Mono,
				key: req.Key, route: req.Route, target: req.Target, allocs: slices.Clone(rec.Allocs)})
		}
	}
	d.Reason, d.Units = OK, req.Units
	a.fill(&d, now, wall)
	return d
}

// expireIDs lets go of the client ids older than the dedup window, and of
// the oldest beyond Params.DedupMax, keeping in spent the generation of
// those charged in the current period.
func (a *Account) expireIDs(params *Params) {
	a.dedup.expireFn(a.seen, params.DedupWindow, params.DedupMax, func(id string, wall int64, e event) {
		if e.period == a.period {
			a.spent.put(id, wall, spentID{gen: e.gen, refunded: e.refunded, mono: e.chargeMono})
		}
	})
	a.spent.expire(a.seen, spentWindow, params.spentMax())
}

// nextGen is the generation of a charge of client id that the dedup window
// does not remember. The ledger bills an event id once a period
// (LedgerEventID(id, gen) is the event's name), so:
//
//   - An id never let go this period (or let go longer ago than spent
//     remembers) starts at generation 0, as a retry another owner charged
//     first would: the ledger finds that charge and bills it once.
//   - An id charged more than the window ago is new work under an
//     Idempotency-Key used again (the window is what clients are told a key
//     lasts): the next generation, billed apart from the earlier use. When
//     that use was refunded, its own generation: the ledger bills a charge
//     of a refunded event in its place, as it did before this was kept.
//   - An id let go early (beyond Params.DedupMax) and charged again within
//     the window is a retry of that charge, not new work: its generation,
//     which the ledger bills once (or the next after a refund, as the dedup
//     window would have given). So is one whose window the wall clock
//     passed but the monotonic clock did not (mono: a wall clock that
//     jumped forward), when this process made the earlier charge.
//
// Only ids this owner charged since it last got the account (ForgetIDs) are
// spent: a retry of a charge another owner made within the window takes
// generation 0 here, never a generation that owner did not give.
func (a *Account) nextGen(id string, mono int64, params *Params) uint32 {
	var last spentID
	var wall int64
	if e, ok := a.dedup.m[id]; ok {
		// Past the window, not expired yet (walls came out of order).
		last, wall = spentID{gen: e.v.gen, refunded: e.v.refunded, mono: e.v.chargeMono}, e.wall
	} else if s, ok := a.spent.m[id]; ok {
		last, wall = s.v, s.wall
	} else {
		return 0
	}
	past := a.seen-wall >= params.DedupWindow && (last.mono == 0 || mono-last.mono >= params.DedupWindow)
	if past != last.refunded {
		return last.gen + 1
	}
	return last.gen
}

func (a *Account) refusal(exhausted bool, params *Params) Reason {
	if a.cfg.Plan.Hard && params.Reservations && !exhausted {
		return NeedReservation
	}
	return QuotaExceeded
}

// reserved reports whether hard grants are spent from the allowance.
func (a *Account) reserved(params *Params) bool { return params.Reservations && a.cfg.Plan.Hard }

// allocate plans where units come from, soonest-expiring active grant first,
// into rec.Allocs, without changing anything. It returns what is missing, and
// whether every grant that could supply it is known to be exhausted.
func (a *Account) allocate(units, wall, mono int64, params *Params, rec *Record) (short int64, exhausted bool) {
	reserved := a.reserved(params)
	exhausted = true
	rest := units
	for i := range a.grants {
		g := &a.grants[i]
		if !g.active(wall) {
			continue
		}
		avail := g.free()
		if reserved {
			// What the ledger reserved for this node, but never more than
			// the grant has free: a plan lowered below use plus allowance
			// (a downgrade, a smaller quota) leaves the ledger's
			// reservations as they were, and must stop charges at once.
			avail = min(g.allowance, avail)
			if g.exhaustedUntil <= mono && g.free() > g.allowance {
				exhausted = false
			}
		}
		if take := min(avail, rest); take > 0 {
			rec.Allocs = append(rec.Allocs, Alloc{Grant: g.id, Units: take})
			rest -= take
		}
		if rest == 0 {
			return 0, exhausted
		}
	}
	if a.cfg.Plan.Hard {
		return rest, exhausted
	}
	// Soft: the overage goes on the current monthly grant, up to
	// MaxMonthUse.
	id := MonthlyGrantID(a.period)
	month := int64(0)
	if g := a.grant(id); g != nil {
		month = g.used
	}
	for _, al := range rec.Allocs {
		if al.Grant == id {
			month += al.Units
		}
	}
	if rest > MaxMonthUse-month {
		return rest, true
	}
	rec.Allocs = appendAlloc(rec.Allocs, id, rest)
	return 0, exhausted
}

func appendAlloc(as []Alloc, id string, units int64) []Alloc {
	for i := range as {
		if as[i].Grant == id {
			as[i].Units += units
			return as
		}
	}
	return append(as, Alloc{Grant: id, Units: units})
}

// spend applies allocations: sign 1 spends, -1 returns. reserved says the
// units come from (or go back to) this node's allowance.
func (a *Account) spend(allocs []Alloc, sign int64, reserved bool) {
	for _, al := range allocs {
		g := a.grant(al.Grant)
		if g == nil {
			continue
		}
		// Never below 0: a refund of a charge another owner made before a
		// handover may not be in the use this owner was seeded with (the
		// ledger's refresh raises it once both settle), and use below 0
		// would show more left than the grant has.
		g.used = max(0, g.used+sign*al.Units)
		if reserved {
			g.allowance -= sign * al.Units
		}
	}
}

func (a *Account) addRoute(route string, units int64) {
	if a.routes == nil {
		a.routes = make(map[string]int64)
	}
	a.routes[route] += units
}

// fill writes the balance and bucket views into d.
func (a *Account) fill(d *Decision, now Now, wall int64) {
	for i := range a.grants {
		if g := &a.grants[i]; g.active(wall) {
			d.Limit += g.units
			d.Remaining += g.shownFree()
			if g.monthly {
				d.MonthUnits, d.MonthUsed = g.units, g.shownUsed()
			}
		}
	}
	if plan := &a.cfg.Plan; !plan.Rate.Unlimited() {
		a.bucket.refill(plan, now.Mono)
		a.bucket.fill(plan, d)
	}
}

// Refund returns an event's units to the grants that paid them, once. The
// account finds the event in its dedup window (client ids) or takes it from
// receipt (which may be nil), checked: a receipt of another account, or
// altered, is refused Invalid (see Receipt.fits; self is this node's id,
// for a receipt of a charge it made, whose units its use must hold).
func (a *Account) Refund(eventID string, receipt *Receipt, self string, now Now, params *Params, rec *Record) Decision {
	return a.refund(eventID, receipt, self, false, now, params, rec)
}

// RefundAttempt refunds the charge one attempt made (receipt is what its
// charge returned): like Refund, except that it keeps the charge, answering
// Kept, when a retry with the same client id was served under it since, or
// when the id has moved on to a later generation. The HTTP front refunds
// this way when its own attempt failed or its client went away: the retry
// that was answered Replayed and served must stay billed.
//
// self is this node's id: a receipt of a charge another node made (the
// account moved since) changes nothing here, since this node's entry for the
// id is a different attempt's; the record only tells the ledger
// (Record.Origin), which decides.
func (a *Account) RefundAttempt(eventID string, receipt *Receipt, self string, now Now, params *Params, rec *Record) Decision {
	if receipt.fromElsewhere(eventID, self) {
		p, wall := a.advance(now.Wall)
		d := Decision{Reason: Refunded, Units: receipt.Units, Reset: p.End() / 1e9}
		if !receipt.fits(a.cfg.ID) {
			rec.Type, d.Reason, d.Units = 0, Invalid, 0
			a.fill(&d, now, wall)
			return d
		}
		if !Refundable(receipt.Period, p) {
			rec.Type, d.Reason, d.Units = 0, UnknownEvent, 0
			a.fill(&d, now, wall)
			return d
		}
		// Once: a retry of this refund (its reply lost) lowered the use
		// here again, and logged a second refund (which the ledger
		// credited twice with the event log off).
		key := elsewhereKey(eventID, receipt.Gen, receipt.Wall, receipt.Node)
		a.refunded.expire(a.seen, RefundedWindow, params.DedupMax)
		if _, done := a.refunded.get(key, a.seen, RefundedWindow); done {
			rec.Type, d.Reason, d.Units = 0, AlreadyRefunded, 0
			a.fill(&d, now, wall)
			return d
		}
		a.refunded.put(key, a.seen, struct{}{})
		rec.reset(RecRefund, a.cfg.ID, a.seen)
		rec.EventID, rec.Attempt, rec.Origin = eventID, true, receipt.Node
		rec.Units, rec.Period, rec.ChargeWall, rec.Key, rec.Route, rec.Gen = receipt.Units, receipt.Period, receipt.Wall, receipt.Key, receipt.Route, receipt.Gen
		rec.Allocs = append(rec.Allocs, receipt.Allocs...)
		a.unspendElsewhere(rec, params)
		a.fill(&d, now, wall)
		return d
	}
	return a.refund(eventID, receipt, self, true, now, params, rec)
}

// RefundReplay takes back a retry that was answered Replayed and then not
// served (the HTTP front's upstream failed for it): one replay fewer relies
// on the charge (a RecReplay record with Delta -1). When it was the last and
// the charge's own attempt had asked for its refund meanwhile (pending), the
// refund applies now (a refund record marked Released); otherwise it answers
// Kept and changes nothing billed.
//
// receipt is the replay's (ChargeResult.Receipt of the Replayed answer; nil
// from older callers). When it names another node than self (the account
// moved since), nothing of that replay is here: the record (Origin) only
// tells the ledger, which counts the replay off the event there.
//
// A receipt that names its replay (ReplaySeq) is taken back once: asked
// again (a retry whose first answer was lost), it changes nothing, logs
// nothing and answers Kept, or AlreadyRefunded when the event is refunded.
// The record names the replay too (Record.ReplaySeq), so that a restart
// remembers it and the ledger counts it off once when a retry reaches
// another owner.
func (a *Account) RefundReplay(eventID string, receipt *Receipt, self string, now Now, params *Params, rec *Record) Decision {
	key := ""
	if receipt != nil && receipt.ReplaySeq != 0 && receipt.EventID == eventID && receipt.Node != "" {
		node := receipt.Node
		if node == self {
			node = ""
		}
		key = takeBackKey(eventID, receipt.Gen, node, receipt.ReplaySeq)
		a.refunded.expire(a.seen, RefundedWindow, params.DedupMax)
		if _, done := a.refunded.get(key, a.seen, RefundedWindow); done {
			rec.Type = 0
			p, wall := a.advance(now.Wall)
			d := Decision{Reset: p.End() / 1e9, Reason: Kept}
			if e, ok := a.dedup.get(eventID, a.seen, params.DedupWindow); ok && e.refunded && e.gen == receipt.Gen {
				d.Reason = AlreadyRefunded
			}
			a.fill(&d, now, wall)
			return d
		}
	}
	d := a.refundReplay(eventID, receipt, self, now, params, rec)
	if key != "" && rec.Type != 0 {
		rec.ReplaySeq = receipt.ReplaySeq
		a.refunded.put(key, a.seen, struct{}{})
	}
	return d
}

func (a *Account) refundReplay(eventID string, receipt *Receipt, self string, now Now, params *Params, rec *Record) Decision {
	rec.Type = 0
	p, wall := a.advance(now.Wall)
	d := Decision{Reset: p.End() / 1e9, Reason: Kept}
	if receipt.fromElsewhere(eventID, self) {
		rec.reset(RecReplay, a.cfg.ID, a.seen)
		rec.EventID, rec.Gen, rec.Period, rec.Origin, rec.Delta = eventID, receipt.Gen, receipt.Period, receipt.Node, -1
		a.fill(&d, now, wall)
		return d
	}
	e, ok := a.dedup.get(eventID, a.seen, params.DedupWindow)
	switch {
	case !ok && receipt != nil && receipt.EventID == eventID && (receipt.Account == "" || receipt.Account == a.cfg.ID) && Refundable(receipt.Period, p):
		// This node's replay, its id no longer remembered here (the
		// account let go and come back, ForgetIDs): the ledger counts it
		// off, as it does another node's, and applies a refund the
		// attempt left pending when it was the last. Answered
		// UnknownEvent and logged nothing, the event stayed billed though
		// nothing was served.
		rec.reset(RecReplay, a.cfg.ID, a.seen)
		rec.EventID, rec.Gen, rec.Period, rec.Delta = eventID, receipt.Gen, receipt.Period, -1
	case !ok:
		d.Reason = UnknownEvent
	case e.refunded || (receipt != nil && receipt.EventID == eventID && receipt.Gen != e.gen):
		d.Reason = AlreadyRefunded // that generation was refunded: the id moved on
	case e.replays > 0:
		e.replays--
		a.dedup.update(eventID, e)
		if e.replays == 0 && e.pending {
			d = a.refund(eventID, nil, self, true, now, params, rec)
			rec.Released = rec.Type == RecRefund
			return d
		}
		rec.reset(RecReplay, a.cfg.ID, a.seen)
		rec.EventID, rec.Gen, rec.Period, rec.Delta = eventID, e.gen, e.period, -1
	}
	a.fill(&d, now, wall)
	return d
}

// namesOther says receipt r (of e's id) is of another charge than e, the
// one this account's window remembers. Of a charge this node made: another
// generation, period or charge time. Of another node's (the account moved
// since): another period, more than a dedup window from e, so no retry of
// one use (a retry across a month's edge that another owner charged again
// is the same event in the ledger, and refunds e); a June use's receipt
// refunded this node's July use of the id, and June's refund was lost.
func (r *Receipt) namesOther(e event, self string, params *Params) bool {
	if r.Node == "" || r.Node == self {
		return r.Gen != e.gen || r.Period != e.period || r.Wall != 0 && r.Wall != e.chargeAt
	}
	apart := r.Wall - e.chargeAt
	return r.Period != e.period && r.Wall != 0 && max(apart, -apart) > params.DedupWindow
}

func (a *Account) refund(eventID string, receipt *Receipt, self string, attempt bool, now Now, params *Params, rec *Record) Decision {
	rec.Type = 0
	p, wall := a.advance(now.Wall)
	d := Decision{Reset: p.End() / 1e9}
	a.expireIDs(params)
	a.refunded.expire(a.seen, RefundedWindow, params.DedupMax)
	rec.reset(RecRefund, a.cfg.ID, a.seen)
	rec.EventID = eventID
	e, ok := a.dedup.get(eventID, a.seen, params.DedupWindow)
	if ok && !attempt && receipt != nil && receipt.EventID == eventID && receipt.namesOther(e, self, params) {
		// The receipt of an earlier charge of the id here: one refunded
		// and charged again (a later generation now), or a use past the
		// dedup window (of this month or an earlier one). It refunds that
		// charge, by its receipt, not the one the window remembers. The
		// charge's time tells them apart too: a refunded id used again
		// after its window takes its generation over, so the first use's
		// receipt, sent again (a lost answer), refunded the second use.
		ok = false
	}
	if ok {
		switch {
		case e.refunded:
			d.Reason = AlreadyRefunded
		case attempt && receipt != nil && receipt.Gen != e.gen:
			d.Reason = Kept // the id moved on to a later generation
		case attempt && e.replays > 0 && e.pending:
			d.Reason = Kept // asked before, and logged then
		case attempt && e.replays > 0:
			// Kept until the replays are taken back too, and logged so: the
			// ledger holds the refund pending, so that the last replay's
			// take-back releases it even when it reaches the account's next
			// owner (and a restart remembers it). The units stay spent.
			e.pending = true
			a.dedup.update(eventID, e)
			rec.Attempt, rec.Kept = true, true
			rec.Units, rec.Period, rec.ChargeWall, rec.Key, rec.Route, rec.Gen = e.units, e.period, e.chargeAt, e.key, e.route, e.gen
			rec.Allocs = append(rec.Allocs, e.allocs...)
			d.Reason = Kept
			a.fill(&d, now, wall)
			return d
		default:
			e.refunded = true
			a.dedup.update(eventID, e)
			// Also by receipt, once the dedup entry has gone.
			a.refunded.put(refundedKey(eventID, e.gen, e.chargeAt), a.seen, struct{}{})
			rec.Units, rec.Period, rec.ChargeWall, rec.Key, rec.Route, rec.Gen = e.units, e.period, e.chargeAt, e.key, e.route, e.gen
			rec.Allocs = append(rec.Allocs, e.allocs...)
		}
	} else if receipt != nil && receipt.EventID == eventID {
		if _, done := a.refunded.get(refundedKey(eventID, receipt.Gen, receipt.Wall), a.seen, RefundedWindow); done {
			d.Reason = AlreadyRefunded
		} else if !receipt.fits(a.cfg.ID) || (receipt.Node == self && !a.holds(receipt.Allocs)) {
			// Another account's receipt, or altered. Only a charge this
			// node made is surely in its use: one another owner made
			// before a handover may not be in the use it was seeded with.
			d.Reason = Invalid
		} else if !Refundable(receipt.Period, p) {
			d.Reason = UnknownEvent // too old: see Refundable
		} else {
			a.refunded.put(refundedKey(eventID, receipt.Gen, receipt.Wall), a.seen, struct{}{})
			rec.Units, rec.Period, rec.ChargeWall, rec.Key, rec.Route, rec.Gen = receipt.Units, receipt.Period, receipt.Wall, receipt.Key, receipt.Route, receipt.Gen
			rec.Allocs = append(rec.Allocs, receipt.Allocs...)
		}
	} else {
		d.Reason = UnknownEvent
	}
	if d.Reason != Undecided { // refused above; otherwise rec holds the refund to apply
		rec.Type = 0
		a.fill(&d, now, wall)
		return d
	}
	// A refund's units go back to the grant in the ledger, free for any
	// node to reserve (Reserved false), never into this node's allowance:
	// credited here before the ledger had looked, a refund that turned out
	// a duplicate (two owners refunding one event during a handoff) left
	// units spendable here that the ledger did not back, and a charge
	// could spend them before the take-back (G1: quotad chaos --seed 12,
	// 21 of 20). Spending them again takes a reservation once the refund
	// is settled; the engine waits for that settle when a charge lacks
	// them (see engine.Engine's reserve). The grant is no longer known to
	// be exhausted, so the next charge short of units asks the ledger.
	rec.Attempt = attempt
	a.notExhausted(rec.Allocs, params)
	a.unspend(rec)
	d.Reason, d.Units = Refunded, rec.Units
	a.fill(&d, now, wall)
	return d
}

// unspendElsewhere lowers the use of the grants an attempt's refund of
// another node's charge names (Record.Origin). Nothing else of that charge
// is here (its dedup entry, its route count, its allowance are the other
// node's), but the use this owner was seeded or refreshed with from the
// ledger counts it once settled: kept, the refunded units stayed used here
// until the account moved again, and a hard account at its quota was
// refused units the ledger had free. Where the ledger keeps the event
// instead (a retry served under it) or this use never counted the charge,
// the next refresh raises the use back (settled use is a lower bound), and
// hard limits hold whatever this reads: charges spend reserved units only.
// So it does so in reservations mode only; without reservations the use
// here is what enforces. The grants count as exhausted no more (see
// refund).
func (a *Account) unspendElsewhere(rec *Record, params *Params) {
	if !params.Reservations {
		return
	}
	a.spend(rec.Allocs, -1, false)
	a.notExhausted(rec.Allocs, params)
}

// notExhausted forgets that the ledger called the grants of allocs
// exhausted (reservations mode): a refund gives their units back there, so
// the next charge short of units asks the ledger again.
func (a *Account) notExhausted(allocs []Alloc, params *Params) {
	if !a.reserved(params) {
		return
	}
	for _, al := range allocs {
		if g := a.grant(al.Grant); g != nil {
			g.exhaustedUntil = 0
		}
	}
}

func (a *Account) unspend(rec *Record) {
	a.spend(rec.Allocs, -1, rec.Reserved)
	if rec.Period == a.period && a.routes != nil {
		// Never below zero: the routes count this owner's charges since the
		// account came (back) here, and the refund may be of one before.
		a.routes[rec.Route] = max(0, a.routes[rec.Route]-rec.Units)
	}
}

// Reserve changes this node's allowance on grant id by delta (positive: the
// ledger reserved more; negative: released). It reports false, with no
// record, when the account has no such grant.
//
// Units of a later month's monthly grant move the account to that month:
// the ledger reserves there when another node billed the account there (a
// node whose clock ran ahead), and a period never goes back (G9).
func (a *Account) Reserve(grantID string, delta int64, now Now, rec *Record) bool {
	rec.Type = 0
	a.advance(now.Wall)
	a.reach(grantID)
	g := a.grant(grantID)
	if g == nil {
		return false
	}
	g.allowance += delta
	if delta > 0 {
		g.exhaustedUntil, g.unseen = 0, 0
	}
	rec.reset(RecReserve, a.cfg.ID, a.seen)
	rec.Grant, rec.Delta = grantID, delta
	return true
}

// Allowance is this node's unspent reservation over the grants active at
// wall (reservations mode).
func (a *Account) Allowance(wall int64) int64 {
	return a.sumActive(wall, func(g *grant) int64 { return g.allowance })
}

// Wall is the wall time the account decides at when the clock reads wall:
// wall itself, or the start of the account's period when the account is
// ahead of it (this node's clock went back, or a node whose clock ran ahead
// billed the account in a later month): a period never goes back (G9).
// Reservations are asked for at this time, so that they come from the
// grants the account spends.
func (a *Account) Wall(wall int64) int64 { return max(wall, a.period.Start()) }

// Limit is the units of the grants active at wall.
func (a *Account) Limit(wall int64) int64 {
	return a.sumActive(wall, func(g *grant) int64 { return g.units })
}

func (a *Account) sumActive(wall int64, f func(*grant) int64) int64 {
	var n int64
	for i := range a.grants {
		if g := &a.grants[i]; g.active(wall) {
			n += f(g)
		}
	}
	return n
}

// Allowances lists every grant holding an allowance, active or not: what a
// release hands back.
func (a *Account) Allowances() []Alloc {
	var out []Alloc
	for _, g := range a.grants {
		if g.allowance != 0 {
			out = append(out, Alloc{Grant: g.id, Units: g.allowance})
		}
	}
	return out
}

// MarkExhausted records that the ledger had no free units for grant id (and
// no other node held any): until mono, a shortfall on it answers
// QuotaExceeded without asking again, and answers show the grant's use as
// the ledger does, units minus this node's allowance, so an account refused
// for its quota says 0 remaining (and reaches its 100 % alert) even when
// part of its use was charged by another node and not seeded here.
func (a *Account) MarkExhausted(grantID string, untilMono int64) {
	a.reach(grantID)
	if g := a.grant(grantID); g != nil {
		g.exhaustedUntil = untilMono
		g.unseen = max(0, g.units-g.allowance-g.used)
	}
}

// GrantView is a read-only view of one grant.
type GrantView struct {
	ID                string
	Monthly           bool
	StartsAt, Expires int64
	Units, Used       int64
	Allowance         int64
}

// Grants lists the account's grants, soonest-expiring first.
func (a *Account) Grants() []GrantView {
	out := make([]GrantView, len(a.grants))
	for i, g := range a.grants {
		out[i] = GrantView{ID: g.id, Monthly: g.monthly, StartsAt: g.startsAt, Expires: g.expiresAt, Units: g.units, Used: g.used, Allowance: g.allowance}
	}
	return out
}

// ActiveGrants lists the grants a charge at now could spend.
func (a *Account) ActiveGrants(now Now) []GrantView {
	_, wall := a.advance(now.Wall)
	var out []GrantView
	for _, g := range a.Grants() {
		if (&grant{startsAt: g.StartsAt, expiresAt: g.Expires}).active(wall) {
			out = append(out, g)
		}
	}
	return out
}

// Usage is the account's current period as its owner sees it.
type Usage struct {
	Period Period
	Limit  int64
	// Used is what the period used: the sum of Routes, or the monthly
	// grant's use when that is more (an account that moved here carries the
	// ledger's settled use at once; Routes takes the ledger's settled split
	// by route once this owner's own records of it are settled, and counts
	// what this owner charged until then: see settledRoutes).
	Used      int64
	Remaining int64
	Reset     int64 // Unix seconds
	Routes    map[string]int64
}

// ForgetRoutes drops the by-route counts of the period: the account came
// back from another owner, which may have refunded charges counted here, so
// these counts are stale. From here on they count what this owner charges
// (as for an account that moved here), and Usage's total is the monthly
// grant's, which the ledger reseeds.
func (a *Account) ForgetRoutes() { clear(a.routes) }

// Usage reports the current period's usage at now.
func (a *Account) Usage(now Now) Usage {
	p, wall := a.advance(now.Wall)
	u := Usage{Period: p, Reset: p.End() / 1e9, Routes: make(map[string]int64, len(a.routes))}
	for i := range a.grants {
		if g := &a.grants[i]; g.active(wall) {
			u.Limit += g.units
			u.Remaining += g.shownFree()
		}
	}
	for r, n := range a.routes {
		if n != 0 {
			u.Routes[r] = n
			u.Used += n
		}
	}
	// The routes count what this owner charged; after the account moved
	// here the monthly grant (seeded from the ledger) knows more.
	if g := a.grant(MonthlyGrantID(p)); g != nil && g.shownUsed() > u.Used {
		u.Used = g.shownUsed()
	}
	return u
}
