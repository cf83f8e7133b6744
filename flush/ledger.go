package flush

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

// Ledger is the shared store every node settles into: config (plans,
// accounts, keys, grants, route weights), grants with their used and
// reserved units, each node's reservations and settled mark, daily usage
// aggregates, the event log and the alerts sent. Postgres (pgx) and SQLite
// (modernc.org/sqlite) implement it and pass one conformance suite
// (RunConformance).
//
// Every method is safe for concurrent use. Errors from an unreachable
// database wrap ErrUnavailable; a commit whose outcome is unknown (the
// connection broke during COMMIT) is reported as an error too: the caller
// retries the same batch, and the settled mark makes the retry a no-op.
type Ledger interface {
	// Migrate applies the embedded migrations up to this binary's version,
	// under a lock (an advisory lock on Postgres). A ledger at a newer
	// version than this binary knows fails with ErrSchemaTooNew.
	Migrate(ctx context.Context) error
	// SchemaVersion is the ledger's applied migration version.
	SchemaVersion(ctx context.Context) (int, error)
	// Clock reads the ledger's clock: the database server's on Postgres
	// (clock_timestamp()), this machine's on SQLite (an embedded ledger has
	// no other). Nodes compare theirs with it and export the difference
	// (quotaring_clock_offset_seconds): each decides the month from its own.
	Clock(ctx context.Context) (time.Time, error)

	// RegisterNode records (node, incarnation) if new and returns its settled
	// mark (0 for a new incarnation). It refreshes heartbeat_at.
	RegisterNode(ctx context.Context, node, incarnation string) (settled uint64, err error)
	// Heartbeat is RegisterNode for a running node. drainedAt, when not
	// zero, is when the node found its log held nothing unsettled (its own
	// clock): settled_through (NodeRow.SettledThrough) then moves to the
	// earlier of it and the ledger's now, so that a heartbeat that waited
	// for the ledger (a slow ledger, a busy pool) claims no more than the
	// node knew. process names the process that beats (SettlerOptions.
	// Process); drainedAt counts only while it is the last recorded start
	// of (node, incarnation) or process is empty, as for a batch: a process
	// on a copy of the data dir that lost to a later one has nothing to say
	// about what the later one holds.
	Heartbeat(ctx context.Context, node, incarnation, process string, drainedAt time.Time) (settled uint64, err error)
	// NodeStopped records that (node, incarnation) stopped cleanly with its
	// log settled up to settled, all it holds: its months need not wait for
	// it to come back (SettledMonth). It reports false, changing nothing,
	// when the ledger's settled mark is not settled, or when process is not
	// empty and another process started as (node, incarnation) after it
	// (the earlier of two processes on copies of one data dir). RegisterNode
	// and every settle of the incarnation clear it.
	NodeStopped(ctx context.Context, node, incarnation, process string, settled uint64) (bool, error)
	// RecordStart records the process that runs (node, incarnation),
	// registered before: its build (NodeRow.Build), the newest ledger
	// schema that build knows (NodeRow.SchemaKnown), its name, and the
	// ledger's time. An incarnation restarted records it again.
	RecordStart(ctx context.Context, node, incarnation string, s NodeStart) error
	// LastStart is what the latest RecordStart of any incarnation of node
	// recorded; zero when none did.
	LastStart(ctx context.Context, node string) (NodeStart, error)

	// Settle applies one batch exactly once, in one transaction (see Batch).
	Settle(ctx context.Context, b *Batch) (SettleResult, error)

	// Reserve reserves up to Need units of the account's grants active at
	// Wall for node, soonest-expiring first, creating the period's monthly
	// grant from the plan if it does not exist yet. It keeps
	// used + reserved <= units per grant with a conditional update. When
	// the account has a monthly grant of a later month than Wall's (a node
	// whose clock ran ahead reserved or billed there), it reserves at that
	// month's start instead: the account's period never goes back (G9),
	// and the node moves the account there when it gets that grant.
	Reserve(ctx context.Context, node string, req ReserveRequest) (ReserveResult, error)
	// Release hands units of node's reservations back, and notes the
	// account as handed off (Handoffs): an owner releases when it loses an
	// account or stops. A release with a key (ReleaseKey) applies once:
	// retried after a lost answer, it is skipped where that key, or a later
	// one of the same incarnation, already applied. A negative count is
	// ErrInvalid (it would add to the reservation).
	Release(ctx context.Context, node, account string, allocs []shard.Alloc, key ReleaseKey) error
	// Handoffs lists the accounts released since the given time with the units
	// released: the next owner reserves ahead for them.
	Handoffs(ctx context.Context, since time.Time) ([]Handoff, error)
	// ReleaseNode frees every reservation node holds (quotad revoke, and a
	// node's reset at start) and reports the units per account.
	ReleaseNode(ctx context.Context, node string) ([]Released, error)
	// Reservations lists the reservations held, for the status page, revoke
	// and the chaos checkers.
	Reservations(ctx context.Context) ([]Reservation, error)
	// ReservationsOf lists the reservations node holds (units > 0), for
	// its reservation audit.
	ReservationsOf(ctx context.Context, node string) ([]Reservation, error)

	// Snapshot reads the config a node serves from at wall: plans, accounts
	// with their credit grants (and the settled use of credit grants and of
	// the monthly grants of the period of wall, the one before and any later
	// one a node whose clock ran ahead billed in), keys by hash, and the
	// active route weights.
	Snapshot(ctx context.Context, wall time.Time) (*snapshot.Snapshot, error)

	// Admin changes the config; each bumps the config version.
	UpsertPlan(ctx context.Context, p snapshot.Plan) error
	UpsertAccount(ctx context.Context, id, plan string) error
	// AddKey stores a key by the hex SHA-256 of its plaintext.
	AddKey(ctx context.Context, k snapshot.Key) error
	RevokeKey(ctx context.Context, keyID string) error
	AddGrant(ctx context.Context, account string, g snapshot.Grant) error
	// SetRoutes makes a new version of the route weights the active one and
	// returns its version.
	SetRoutes(ctx context.Context, defaultUnits int64, weights map[string]int64) (version int64, err error)

	// Usage reads the settled usage of an account for a period, by route.
	Usage(ctx context.Context, account string, period shard.Period) (AccountUsage, error)
	// BillingUsage reads one page of a period's usage of every account, for
	// billing: the accounts with settled usage in the period or its
	// monthly grant, by account id, after q.After, at most q.Limit of
	// them (see BillingRow). An account with neither is left out: nothing
	// of that month was billed to it. The page is read in one transaction.
	BillingUsage(ctx context.Context, q BillingQuery) (BillingPage, error)
	// Grants lists an account's grants with used and reserved units.
	Grants(ctx context.Context, account string) ([]GrantRow, error)
	// Reconcile proves "counter equals log" (G6): for every grant, its used
	// units against the sum of the event log's unrefunded allocations to it;
	// for every account and period, the daily usage aggregates against the
	// event log's unrefunded charges of that period. It calls each for every
	// row as the ledger streams it (grants, then usage, each by account and
	// scope), so that a ledger of millions of accounts is checked in constant
	// memory; Diff marks the rows that disagree. It stops at each's first
	// error and returns it. After PruneEvents, a grant's used units are
	// compared with the log plus what was pruned from it
	// (pruned_allocations), and the months pruned are not compared.
	// ReconcileRows collects the rows of a small ledger.
	Reconcile(ctx context.Context, each func(ReconcileRow) error) error
	// PruneEvents drops the event log of the months before o.Before, oldest
	// first, once nothing can change them any more (see prune.go); the
	// grants, daily aggregates and alerts stay, and reconcile still checks
	// every grant. A month that is not over and final is refused
	// (ErrInvalid, naming the nodes that hold it back).
	PruneEvents(ctx context.Context, o PruneOptions) (PruneResult, error)
	// EventsPrunedBefore is the month before which the event log was
	// pruned (0: never).
	EventsPrunedBefore(ctx context.Context) (shard.Period, error)
	// Events lists the event log of an account (tests, chaos checkers).
	Events(ctx context.Context, account string) ([]EventRow, error)
	// Nodes lists the nodes and their settled marks.
	Nodes(ctx context.Context) ([]NodeRow, error)

	// RecordAlert claims the alert (Account, Period, Threshold) for a.Claim
	// (a token unique to this claim), recording its figures (Used, Limit,
	// CrossedAt) as pending; it reports false if another claim recorded it
	// first (the cluster sends each alert once). A call repeated with the
	// same claim (its reply was lost) reports true again.
	RecordAlert(ctx context.Context, a AlertRecord) (bool, error)
	// FinishAlert records the end of a round of deliveries of a pending
	// alert under a.Claim: AlertDelivered (also once that claim's round
	// was recorded pending: its report of the delivery came late),
	// AlertGivenUp (only while a.Claim holds it) or AlertPending (a round
	// that failed: only the attempts and the error are recorded, and the
	// alert waits for a takeover). attempts adds to the row's webhook calls.
	// A pending round ends its claim (it becomes Claim + claimEnded), so
	// that recording it again (its reply was lost) changes nothing and
	// reports true, and the claim can no longer give the alert up.
	// It reports false when the row was not pending under those terms: a
	// claim taken over since speaks for nothing (after a resend or a
	// re-arm, its delivery was of the alert before: recorded, the new one
	// was never sent); the takeover sends it again (at least once).
	FinishAlert(ctx context.Context, a AlertRecord, state AlertState, attempts int, lastErr string) (bool, error)
	// TakeOverAlerts claims for claim up to limit pending alerts whose claim
	// is older than lease by the ledger's clock (their node died or gave up
	// a round), and gives up the pending ones older than giveUpAfter (and
	// past their lease). Concurrent callers take distinct alerts.
	TakeOverAlerts(ctx context.Context, claim string, lease, giveUpAfter time.Duration, limit int) (taken, givenUp []AlertRecord, err error)
	// ResendAlert makes a delivered or given-up alert pending again, with a
	// claim old enough that the next sweep (TakeOverAlerts) takes it over
	// and sends it, and a fresh give-up age. It fails with ErrNotFound for
	// no such alert, and ErrInvalid for one pending already or recorded
	// before delivery was tracked (its figures are unknown).
	ResendAlert(ctx context.Context, account string, period shard.Period, threshold int) (AlertRecord, error)
	// Alerts lists the alerts recorded that match q, by account, period and
	// threshold.
	Alerts(ctx context.Context, q AlertQuery) ([]AlertRecord, error)
	// MissedAlerts lists up to limit crossings, by the settled use of
	// period's monthly grants, of thresholds (percent of the grant's units,
	// 1 to 100) that no alert records, by account and threshold. They are
	// the crossings no owner saw in a decision: the charges that crossed
	// were another owner's (an account that moved while a node was down or
	// cut off), and the owner learns of them only once they settle.
	MissedAlerts(ctx context.Context, period shard.Period, thresholds []int, limit int) ([]MissedAlert, error)

	Close() error
}

// Errors.
var (
	// ErrUnavailable wraps failures to reach the database.
	ErrUnavailable = errors.New("flush: ledger unavailable")
	// ErrSchemaTooNew: the ledger was migrated by a newer quotad.
	ErrSchemaTooNew = errors.New("flush: the ledger's schema is newer than this quotad")
	// ErrMarkConflict: the settled mark of (node, incarnation) is neither the
	// batch's Prev nor at or past its Next: another process settles as this
	// node. The node must stop.
	ErrMarkConflict = errors.New("flush: settled mark conflict: the ledger and this node's log disagree on what was settled")
	// ErrOtherProcess: the batch's Process is not the process the ledger
	// last recorded starting as its (node, incarnation) (RecordStart): a
	// later process runs on a copy of this one's data dir, and settles its
	// own records under the same sequence numbers. Nothing is applied, and
	// the mark is not taken as this process's even when it is at or past
	// the batch. It matches ErrMarkConflict too.
	ErrOtherProcess = errors.New("flush: another process started as this node and incarnation after the settling one")
	// ErrNotFound: no such account, plan, key or grant.
	ErrNotFound = errors.New("flush: not found")
	// ErrInvalid: a config change that would make the config invalid.
	ErrInvalid = errors.New("flush: invalid")
)

// Batch is the records of one node in (Prev, Next] of its log.
//
// Settle, in one transaction:
//  1. UPDATE nodes SET settled_seq = Next WHERE node = Node AND incarnation =
//     Incarnation AND settled_seq = Prev (and the process last recorded is
//     Process, when both are set). No row: a later process recorded,
//     ErrOtherProcess; if the mark is already >= Next the batch was applied
//     before (SettleResult.Applied = false, nothing else happens); otherwise
//     ErrMarkConflict.
//  2. With Events on: insert the charges into the event log, ON CONFLICT
//     (account, event id) DO NOTHING; a charge whose event id the log already
//     holds from another origin (node, incarnation, seq) is a Duplicate: a
//     client's retry that reached another owner after a failover. It is not
//     billed (no usage, no used units) but its Reserved units still leave
//     this node's reservation, and it counts on the event as a retry served
//     again (served_again). If the event was refunded (its attempt failed)
//     the served retry takes the event over and is billed instead; but not
//     a retry charged (Charge.Wall) before the event's own refund was
//     decided (Refund.Wall of a refund that is not an Attempt's, kept as
//     refund_wall): that refund covers every attempt charged before it.
//     Refunds: an event found unrefunded is marked refunded and its units
//     return to its grants (used -=), unless the refund is an Attempt's and
//     retries were served under the event: the event's own node's attempt
//     refund is then kept and pending, and another node's attempt refund (of
//     its own retry, never billed) counts one served retry off and applies
//     the pending refund when it was the last. Kept and
//     repeated refunds are DuplicateRefunds and change nothing here (the node
//     takes the units back out of its allowance). Not found (its charge is
//     still in another node's unsettled log), a refunded tombstone row is
//     inserted with the units, grants untouched, so that the charge arriving
//     later is a Duplicate. An attempt's refund naming another node's charge
//     (Origin) stands for that charge only: found, it does not refund a row
//     another node charged while that charge has not settled (served_again
//     goes below zero instead, and events.owed names that node: see
//     owed.go; so that the charge is no served retry when it arrives, even
//     after the event was refunded, and only that node's charge pays the
//     debt back: another node's served retry still takes a refunded event
//     over; served retries are named too, events.served_by, and an
//     attempt's refund counts off only its own node's); not found, its
//     tombstone names that node, and a charge from any other node (another
//     attempt, served) takes the event over and is billed, the tombstone's
//     node then owed; that node's own charge, settling on its tombstone
//     first, makes it a plain refunded row. Replays (see replay.go) count
//     as served retries too (their own count, events.replays, named by node
//     in events.replayed_by: a take-back counts off its own node's), in log
//     order with the batch's charges and refunds. So an event is billed
//     exactly when some attempt under it was served.
//     With Events off: charges and refunds all apply, no dedup, and replays
//     change nothing.
//  3. Daily usage aggregates (account, key, route, UTC day): units and
//     requests, one upsert of all rows (UNNEST on Postgres); refunds
//     subtract on the day of the charge.
//  4. Grants, locked in (account, grant) order: used += billed units per
//     allocation (monthly grants are created from the plan if missing);
//     for Reserved allocations this node's reservation and the grant's
//     reserved total move by the same units (never below zero).
type Batch struct {
	Node, Incarnation string
	// Process, when set, is the settling process's name (NodeStart.Process):
	// the batch applies only while the ledger has no later process recorded
	// as started for (Node, Incarnation) (else ErrOtherProcess). Two
	// processes on copies of one data dir share an incarnation, and each
	// numbers its own charges from the copied end: a settle of one moved
	// the mark over the other's records, which the other then took as
	// settled (its own answer lost, it thought) and dropped.
	Process    string
	Prev, Next uint64
	Events     bool // keep the event log (default on; --events=off)
	// DrainedAt, when not zero, says Next was the log's durable end when
	// the batch was read, at that time (the node's clock): once it commits,
	// the node holds nothing unsettled made before, and the settle moves
	// settled_through (NodeRow.SettledThrough) to the earlier of it and the
	// ledger's now.
	DrainedAt time.Time
	Charges   []Charge
	Refunds   []Refund
	// Replays are the retries answered Replayed and taken back, in log
	// order (see replay.go).
	Replays []Replay
}

// Charge is a settled charge record.
type Charge struct {
	Seq      uint64
	Account  string
	EventID  string
	ClientID bool
	Key      string
	Route    string
	Units    int64
	Wall     int64 // Unix ns
	Period   shard.Period
	Reserved bool
	Allocs   []shard.Alloc
}

// Refund is a settled refund record.
type Refund struct {
	Seq        uint64
	Account    string
	EventID    string
	Key        string
	Route      string
	Units      int64
	Wall       int64
	ChargeWall int64
	Period     shard.Period
	Reserved   bool
	// Attempt: the refund of one attempt's charge (the HTTP front's); kept
	// when retries were served under the event elsewhere (see Batch). A
	// refund without it returns the event's units whatever retries did.
	Attempt bool
	// Origin: the node that charged the refunded attempt when it is not the
	// batch's node (the account moved since); empty: the batch's node.
	Origin string
	// Released: the attempt's refund again, released by the take-back of
	// its charge's last replay; the same attempt logged it before, kept
	// (pending). On another node's row (this node's charge was a retry,
	// not billed) that first record counted the retry off already, so
	// this one changes nothing there.
	Released bool
	Allocs   []shard.Alloc
}

// EventRef names an event.
type EventRef struct {
	Account, EventID string
	Units            int64
	Allocs           []shard.Alloc
	Reserved         bool
}

// SettleResult says what a Settle did.
type SettleResult struct {
	// Applied is false when the batch had been applied before.
	Applied bool
	// Duplicates are charges not billed because their event id was already
	// in the event log from elsewhere (a retry that reached a new owner).
	Duplicates []EventRef
	// DuplicateRefunds are refunds of events already refunded.
	DuplicateRefunds []EventRef
	// UnbilledReplays are replays of refunded events of a hard plan that
	// were not billed again for lack of free units (see replayFits): served
	// for free, in the customer's favour, rather than over the limit.
	UnbilledReplays []EventRef
	// RoundTrips is the number of statements sent (for benchmarks).
	RoundTrips int
}

// ReserveRequest asks for units for an account.
type ReserveRequest struct {
	Account string
	Wall    time.Time
	Need    int64
}

// ReserveResult is what Reserve did.
type ReserveResult struct {
	Granted   []shard.Alloc // per grant, in spending order; units > 0
	Exhausted []string      // active grants with nothing free left, nothing held by other nodes
	// HeldElsewhere are active grants with nothing free left while other
	// nodes still hold reservations on them (an owner that has not handed
	// its reservation back yet, or a lost node's frozen one): a charge that
	// needs them is unavailable for now, not over quota.
	HeldElsewhere []string
}

// Handoff is an account an owner handed back, and how many units it held.
type Handoff struct {
	Account string
	Units   int64
}

// ReleaseKey names one hand-back: the releasing node's incarnation and the
// seq of the log record that zeroed its allowance. A hand-back is retried
// when its answer is lost, and applied twice it took units off the
// reservation that backed the node's spent, unsettled charges, which other
// nodes could then reserve (G1). Each reservation row keeps the key of the
// last release applied to it; a release whose key is not newer (same
// incarnation, seq not greater) is skipped. The zero key (Seq 0) always
// applies and is not recorded: a release that is never retried (units a
// node could not use the moment it got them).
type ReleaseKey struct {
	Incarnation string
	Seq         uint64
}

// Released is what ReleaseNode freed for one account.
type Released struct {
	Account string
	Grant   string
	Units   int64
}

// Reservation is one node's hold on one grant.
type Reservation struct {
	Node, Account, Grant string
	Units                int64
}

// GrantRow is a grant as the ledger has it.
type GrantRow struct {
	Account, Grant string
	Monthly        bool
	Period         string // monthly grants
	Units          int64
	Used           int64
	Reserved       int64
	StartsAt       time.Time
	ExpiresAt      time.Time // zero: never
}

// AccountUsage is settled usage for one period.
type AccountUsage struct {
	Account string
	Period  shard.Period
	Units   int64
	ByRoute map[string]int64
}

// ReconcileRows collects every row of l.Reconcile: for tests and small
// ledgers (the demo's, chaos's); a ledger of many accounts is better
// streamed.
func ReconcileRows(ctx context.Context, l Ledger) ([]ReconcileRow, error) {
	var rows []ReconcileRow
	err := l.Reconcile(ctx, func(r ReconcileRow) error {
		rows = append(rows, r)
		return nil
	})
	return rows, err
}

// ReconcileRow compares one counter with the event log.
type ReconcileRow struct {
	Account string
	// Kind is "grant" (Scope is a grant id; Counter is its used units) or
	// "usage" (Scope is a period "2026-06"; Counter is the sum of its daily
	// aggregates).
	Kind    string
	Scope   string
	Counter int64
	Events  int64 // the event log's unrefunded units for the same scope
	Diff    bool
}

// EventRow is one row of the event log.
type EventRow struct {
	Account, EventID string
	Key, Route       string
	Units            int64
	ChargedAt        time.Time
	Period           string
	Node             string
	Incarnation      string
	Seq              uint64
	Refunded         bool
	Tombstone        bool // inserted by a refund that arrived before its charge
}

// AlertRecord is a quota alert in the ledger: claimed when its owner saw
// the crossing, then delivered (at least once) or given up.
type AlertRecord struct {
	Account   string
	Period    shard.Period
	Threshold int       // percent of the month's quota
	Used      int64     // units of the month's quota used at the crossing
	Limit     int64     // units of the month's quota
	CrossedAt time.Time // when the owner saw the crossing, by its clock
	Claim     string    // the claim that holds it (a random token)

	// Kept by the ledger (read by Alerts and TakeOverAlerts).
	State      AlertState
	CreatedAt  time.Time // the first claim, by the ledger's clock
	ClaimedAt  time.Time // the latest claim or takeover, by the ledger's clock
	FinishedAt time.Time // delivered or given up; zero while pending
	Attempts   int       // webhook calls recorded so far
	LastError  string    // the last failed round's error
}

// MissedAlert is a threshold a monthly grant's settled use reached with no
// alert recorded for it (Ledger.MissedAlerts).
type MissedAlert struct {
	Account     string
	Threshold   int   // percent
	Used, Limit int64 // the grant's settled use and units
}

// checkMissed checks MissedAlerts' arguments.
func checkMissed(thresholds []int, limit int) error {
	if limit <= 0 {
		return fmt.Errorf("%w: missed alerts: limit %d: want at least 1", ErrInvalid, limit)
	}
	for _, t := range thresholds {
		if t < 1 || t > 100 {
			return fmt.Errorf("%w: missed alerts: threshold %d: want 1 to 100 (percent)", ErrInvalid, t)
		}
	}
	return nil
}

// AlertQuery selects alerts; a zero field matches every alert.
type AlertQuery struct {
	Account string
	Period  shard.Period
	State   AlertState
	Limit   int // at most this many (0: no limit)
}

// AlertState is where an alert's delivery stands.
type AlertState string

// Alert states.
const (
	AlertPending   AlertState = "pending"   // claimed, not delivered yet
	AlertDelivered AlertState = "delivered" // the receiver took it (2xx)
	AlertGivenUp   AlertState = "given_up"  // refused (3xx, 4xx but 429), or undelivered for too long
	AlertLegacy    AlertState = "legacy"    // recorded before delivery was tracked (schema 0005)
)

// NodeRow is one (node, incarnation).
type NodeRow struct {
	Node, Incarnation string
	Settled           uint64
	Heartbeat         time.Time
	// Stopped is when the incarnation stopped cleanly with nothing
	// unsettled (NodeStopped); zero while it runs, after a crash or an
	// unclean stop.
	Stopped time.Time
	// Build is the quotad build the incarnation last registered with
	// (RecordBuild), and SchemaKnown the newest ledger schema that build
	// knows; "" and 0 for an incarnation an older quotad registered.
	Build       string
	SchemaKnown int
	// SettledThrough is the ledger's time up to which the incarnation's log
	// held nothing unsettled (a settle that took all that was durable, or a
	// heartbeat with nothing to settle); zero when never, or for an
	// incarnation of a build before settledThroughSchema, whose months are
	// judged by its heartbeat.
	SettledThrough time.Time
	// Created is when the incarnation first registered (zero when not
	// known): it took no charge before (a new data dir registers before it
	// serves).
	Created time.Time
}

// Running reports whether the incarnation may still be running: it has
// not stopped cleanly since the ledger last heard from it (a heartbeat or a
// settle clears Stopped).
func (r NodeRow) Running() bool { return r.Stopped.IsZero() }

// NodeStart is a node process as RecordStart records it.
type NodeStart struct {
	// Build is the quotad build (internal/buildinfo's short form).
	Build string
	// Process is a random name the process gave itself at start: of two
	// processes running as one node id, the one that started first finds
	// the other's here (LastStart) and stops.
	Process string
	// Incarnation is the incarnation it registered (LastStart only).
	Incarnation string
}

// A quota raised mid-month (a bigger plan, the plan's quota raised) makes
// its thresholds new crossings: 80 % of 100 is not 80 % of 10. An alert
// delivered or given up for a lower limit is re-armed by RecordAlert for
// the new one (its row then records the latest: figures, claim, attempts);
// one still pending is left to its round. Without it a customer who
// upgraded mid-month used up the new quota with no alert at all. These are
// the clauses both dialects use.
const (
	// alertRearmSet replaces an alert's row with the new crossing's (the
	// INSERT's values: excluded).
	alertRearmSet = `crossed_at = excluded.crossed_at, claim = excluded.claim, used = excluded.used,
		limit_units = excluded.limit_units, state = 'pending', created_at = excluded.created_at,
		claimed_at = excluded.claimed_at, finished_at = NULL, attempts = 0, last_error = ''`
	// alertRearmWhere says which rows a new crossing re-arms.
	alertRearmWhere = `alerts.state IN ('delivered', 'given_up') AND alerts.limit_units < excluded.limit_units`
	// alertCovers says an alert row a (MissedAlerts) stands for the
	// crossing of grant g: made for its units or more, or one RecordAlert
	// does not re-arm (pending, or legacy: from before delivery was
	// tracked).
	alertCovers = `(a.limit_units >= g.units OR a.state NOT IN ('delivered', 'given_up'))`
)

// checkAlertKey checks what RecordAlert needs.
func checkAlertKey(a AlertRecord) error {
	if a.Account == "" || a.Claim == "" || a.Threshold < 1 || a.Threshold > 100 {
		return fmt.Errorf("%w: alert: account, claim and a threshold from 1 to 100 must be set (got %q, %q, %d)",
			ErrInvalid, a.Account, a.Claim, a.Threshold)
	}
	return nil
}

// checkTakeOver checks TakeOverAlerts' arguments.
func checkTakeOver(claim string, lease, giveUpAfter time.Duration, limit int) error {
	if claim == "" || lease <= 0 || giveUpAfter <= 0 || limit <= 0 {
		return fmt.Errorf("%w: take over alerts: claim, lease, give-up age and limit must be set", ErrInvalid)
	}
	return nil
}

// resendable checks what ResendAlert found for (account, period, threshold).
func resendable(found []AlertRecord, account string, period shard.Period, threshold int) error {
	if len(found) == 0 {
		return fmt.Errorf("%w: no %s %d%% alert of %s in the ledger", ErrNotFound, period, threshold, account)
	}
	switch found[0].State {
	case AlertPending:
		return fmt.Errorf("%w: the %s %d%% alert of %s is pending already: a node sends it at its next attempt or sweep",
			ErrInvalid, period, threshold, account)
	case AlertLegacy:
		return fmt.Errorf("%w: the %s %d%% alert of %s was recorded before delivery was tracked, without its figures: it cannot be sent again",
			ErrInvalid, period, threshold, account)
	}
	return nil
}

// args are q's filters as the alerts queries take them: "" matches any,
// and no limit is the largest LIMIT both ledgers take.
func (q AlertQuery) args() (period, state string, limit int64) {
	if q.Period != 0 {
		period = q.Period.String()
	}
	limit = int64(q.Limit)
	if limit <= 0 {
		limit = math.MaxInt64
	}
	return period, string(q.State), limit
}

// claimEnded marks a claim whose round ended without delivery (FinishAlert
// with AlertPending): the alert waits for a takeover. Claims are random
// tokens without '#'.
const claimEnded = "#ended"

// checkAlertFinish checks what FinishAlert needs.
func checkAlertFinish(a AlertRecord, state AlertState) error {
	switch state {
	case AlertDelivered, AlertGivenUp, AlertPending:
	default:
		return fmt.Errorf("%w: finish alert: state %q: want delivered, given_up or pending", ErrInvalid, state)
	}
	return checkAlertKey(a)
}

// sortAlerts orders alerts by account, period and threshold (RETURNING
// gives no order).
func sortAlerts(as []AlertRecord) {
	slices.SortFunc(as, func(a, b AlertRecord) int {
		return cmp.Or(strings.Compare(a.Account, b.Account), cmp.Compare(a.Period, b.Period), cmp.Compare(a.Threshold, b.Threshold))
	})
}

// prefixed qualifies each of a comma-separated column list with prefix.
func prefixed(prefix, columns string) string {
	cols := strings.Split(columns, ",")
	for i, c := range cols {
		cols[i] = prefix + strings.TrimSpace(c)
	}
	return strings.Join(cols, ", ")
}
