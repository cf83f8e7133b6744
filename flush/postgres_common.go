package flush

// This file holds what both ledgers share: Open, which picks one from a
// --ledger string, and the settle plan, the pure part of a settle (batch
// checks and the usage and grant deltas worked out in Go before any SQL).
//
// NB: it is named postgres_common.go, not common.go, only because other
// engineers work in this directory at the same time and this ledger
// implementation keeps to the postgres_* and sqlite_* names; SQLite uses it
// as much as Postgres does.

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"math"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

// Open opens the ledger named by a --ledger string:
//
//	postgres://USER:PASSWORD@HOST:PORT/DB?sslmode=...  (or postgresql://) -> Postgres
//	sqlite:/path/to/file.db, or a plain path ending in .db  -> SQLite
//
// It does not migrate: call Migrate.
func Open(ctx context.Context, ledger string, logger *slog.Logger) (Ledger, error) {
	if err := CheckLedger(ledger); err != nil {
		return nil, err
	}
	if isPostgres(ledger) {
		p, err := OpenPostgres(ctx, ledger, PGOptions{Logger: logger})
		if err != nil {
			return nil, err
		}
		return p, nil
	}
	path, _ := SQLitePath(ledger)
	s, err := OpenSQLite(ctx, path, SQLiteOptions{Logger: logger})
	if err != nil {
		return nil, err
	}
	return s, nil
}

func isPostgres(ledger string) bool {
	return strings.HasPrefix(ledger, "postgres://") || strings.HasPrefix(ledger, "postgresql://")
}

// SQLitePath is the file of an SQLite --ledger (sqlite:PATH, or a path
// ending in .db), and whether ledger is one.
func SQLitePath(ledger string) (string, bool) {
	if isPostgres(ledger) {
		return "", false
	}
	if path, ok := strings.CutPrefix(ledger, "sqlite:"); ok {
		return path, true
	}
	return ledger, strings.HasSuffix(ledger, ".db") && !schemePrefix.MatchString(ledger)
}

// schemePrefix matches a URL scheme at the start of a --ledger string
// (file:, mysql://, Postgres://): not a plain path, though it ends in .db.
var schemePrefix = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9+.-]*:`)

// CheckLedger reports a --ledger string Open could never use (ErrInvalid):
// neither form, a Postgres DSN that does not parse, an SQLite path that is
// empty, an in-memory SQLite ledger (a process's own, gone when it exits:
// every plan, key and charge with it), a scheme in capitals (which pgx and
// the SQLite form do not take), another scheme whose string ends in .db. It
// does no I/O: a program checks it before it touches anything else (quotad
// serve, before it binds its data dir to its node id).
func CheckLedger(ledger string) error {
	scheme := schemePrefix.FindString(ledger)
	lower := strings.ToLower(scheme)
	path, isSQLite := SQLitePath(ledger)
	switch {
	case scheme != lower && (lower == "postgres:" || lower == "postgresql:" || lower == "sqlite:"):
		return fmt.Errorf("%w: ledger %q: write the scheme %q in lower case, %s", ErrInvalid, redactDSN(ledger), scheme, lower)
	case ledger == "sqlite::memory:" || ledger == ":memory:":
		return fmt.Errorf("%w: ledger %q is an in-memory SQLite database, private to this process and gone when it exits, with every plan, key and charge in it: "+
			"name a file, sqlite:/path/to/ledger.db (or a Postgres DSN)", ErrInvalid, ledger)
	case isPostgres(ledger):
		_, err := parsePGConfig(ledger)
		return err
	case isSQLite:
		return checkSQLitePath(path)
	case scheme != "":
		return fmt.Errorf("%w: ledger %q: this quotad takes no %s ledger: postgres://USER:PASSWORD@HOST:PORT/DB (or postgresql://...) for Postgres, "+
			"or sqlite:/path/to/file.db (or a path ending in .db) for SQLite; a path holding a colon goes after sqlite:", ErrInvalid, redactDSN(ledger), strings.TrimSuffix(scheme, ":"))
	}
	return fmt.Errorf("%w: ledger %q is neither form this quotad accepts: postgres://USER:PASSWORD@HOST:PORT/DB (or postgresql://...) for Postgres, "+
		"or sqlite:/path/to/file.db (or a path ending in .db) for SQLite", ErrInvalid, redactDSN(ledger))
}

// userinfoPassword finds ":password@" in a string that may not parse as a URL.
var userinfoPassword = regexp.MustCompile(`:[^:@/]*@`)

// keywordPassword finds "password=VALUE" (keyword/value DSNs), quoted or not.
var keywordPassword = regexp.MustCompile(`password=('[^']*'|\S+)`)

// RedactDSN hides the password of a connection string (a --ledger), for
// messages and logs.
func RedactDSN(dsn string) string { return redactDSN(dsn) }

// redactDSN hides the password of a connection string, for messages.
func redactDSN(dsn string) string {
	if u, err := url.Parse(dsn); err == nil && u.User != nil {
		if _, ok := u.User.Password(); ok {
			u.User = url.UserPassword(u.User.Username(), "xxxxx")
		}
		q := u.Query()
		for _, k := range []string{"password", "sslpassword"} {
			if q.Has(k) {
				q.Set(k, "xxxxx")
			}
		}
		u.RawQuery = q.Encode()
		return u.String()
	}
	if info := rawUserinfo(dsn); info != "" {
		// It does not parse, most likely for a character of the password
		// that needs percent-encoding: ":[^:@/]*@" missed a password
		// holding '/', ':' or '@' and printed it. Hide the user too.
		return keywordPassword.ReplaceAllString(strings.Replace(dsn, info+"@", "xxxxx@", 1), "password=xxxxx")
	}
	// Not a URL with a user: a keyword/value DSN ("host=db password=..."),
	// or something else that may still hold one.
	return keywordPassword.ReplaceAllString(userinfoPassword.ReplaceAllString(dsn, ":xxxxx@"), "password=xxxxx")
}

// WhatToCheck says what an operator should look at when the ledger
// answered err while a node connected to it: a server that refuses writes
// or a role without a privilege is reachable, and checking the address
// and credentials would not help.
func WhatToCheck(err error) string {
	if sqliteCode(err) != 0 || strings.Contains(fmt.Sprint(err), "SQLite ledger") {
		return "the SQLite file --ledger names: its directory exists, and this user may read and write both the file and the directory"
	}
	switch pgCode(err) {
	case sqlReadOnlyTransaction:
		return "the ledger refuses writes (read-only transaction): is --ledger a standby or a read-only replica, or the role set to default_transaction_read_only? point it at the primary"
	case sqlInsufficientPrivilege:
		return "the ledger's role lacks a privilege (see err): run quotad migrate as the owner of the ledger's schema, " +
			"and grant the nodes' role SELECT, INSERT, UPDATE and DELETE on its tables (deploy/README.md: the database roles)"
	case sqlInvalidPassword, sqlInvalidAuthorization:
		return "the credentials in --ledger (user and password), and pg_hba.conf on the server"
	case sqlInvalidCatalogName:
		return "the database name in --ledger: the server has no such database"
	case "53300": // too_many_connections
		return "the server's connections are used up: raise its max_connections, or lower each node's pool (pool_max_conns in --ledger) so that nodes x pool fits"
	case "57P03": // cannot_connect_now
		return "the server is starting up or in recovery: wait for it, or point --ledger at the primary"
	}
	return "the --ledger address, the database's reachability from this host, and its credentials"
}

// statementTimedOut reports a statement the server cancelled for time
// (statement_timeout).
func statementTimedOut(err error) bool { return pgCode(err) == sqlQueryCanceled }

// rawUserinfo is what a URL-form dsn holds between "://" and its last '@',
// "" when it holds none.
func rawUserinfo(dsn string) string {
	_, rest, ok := strings.Cut(dsn, "://")
	if !ok {
		return ""
	}
	if at := strings.LastIndex(rest, "@"); at > 0 {
		return rest[:at]
	}
	return ""
}

// orDiscard returns l, or a logger that drops everything.
func orDiscard(l *slog.Logger) *slog.Logger {
	if l == nil {
		return slog.New(slog.DiscardHandler)
	}
	return l
}

// validateBatch rejects a batch no correct node sends. Such a batch would
// fail the same way on every retry, so it is ErrInvalid, not a database
// error.
func validateBatch(b *Batch) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: batch %s/%s (%d, %d]: %s", ErrInvalid, b.Node, b.Incarnation, b.Prev, b.Next, fmt.Sprintf(format, args...))
	}
	switch {
	case b.Node == "" || b.Incarnation == "":
		return bad("node and incarnation must be set")
	case b.Next < b.Prev:
		return bad("Next is below Prev")
	case b.Next > math.MaxInt64:
		return bad("Next does not fit the ledger's bigint")
	}
	inRange := func(seq uint64) bool { return seq > b.Prev && seq <= b.Next }
	seqs := make([]uint64, 0, len(b.Charges)+len(b.Refunds))
	for i := range b.Charges {
		c := &b.Charges[i]
		if !inRange(c.Seq) || c.Account == "" || c.EventID == "" || c.Units < 0 || !validAllocs(c.Allocs) {
			return bad("charge seq %d (account %q, event %q): want a seq in the range, account and event id set, units and allocations >= 0 with grant ids", c.Seq, c.Account, c.EventID)
		}
		seqs = append(seqs, c.Seq)
	}
	for i := range b.Refunds {
		r := &b.Refunds[i]
		if !inRange(r.Seq) || r.Account == "" || r.EventID == "" || r.Units < 0 || !validAllocs(r.Allocs) {
			return bad("refund seq %d (account %q, event %q): want a seq in the range, account and event id set, units and allocations >= 0 with grant ids", r.Seq, r.Account, r.EventID)
		}
		seqs = append(seqs, r.Seq)
	}
	for i := range b.Replays {
		r := &b.Replays[i]
		if !inRange(r.Seq) {
			return bad("replay seq %d is out of the range", r.Seq)
		}
		if err := validReplay(r); err != nil {
			return bad("%v", err)
		}
		if !r.Released {
			seqs = append(seqs, r.Seq) // a released refund's shares its seq
		}
	}
	if !slices.IsSorted(seqs) {
		slices.Sort(seqs)
	}
	for i := 1; i < len(seqs); i++ {
		if seqs[i] == seqs[i-1] {
			return bad("seq %d appears twice", seqs[i])
		}
	}
	return nil
}

func validAllocs(as []shard.Alloc) bool {
	for _, a := range as {
		if a.Grant == "" || a.Units < 0 {
			return false
		}
	}
	return true
}

// dayOf is the UTC day of a wall reading (Unix ns), counted from 1970-01-01.
func dayOf(wall int64) int32 {
	const day = int64(24 * time.Hour)
	d := wall / day
	if wall%day < 0 {
		d--
	}
	return int32(d)
}

// dayString formats a day from dayOf as "2026-06-15".
func dayString(d int32) string {
	return time.Unix(int64(d)*86400, 0).UTC().Format(time.DateOnly)
}

type usageKey struct {
	account, key, route string
	day                 int32 // dayOf
}

type usageDelta struct{ units, requests int64 }

type grantKey struct{ account, grant string }

// grantDelta is what a batch does to one grant: used units, and the change
// of the settling node's reservation on it (the grant's reserved total
// follows, as the sum of the reservations).
type grantDelta struct{ used, reserved int64 }

// settlePlan gathers a batch's effects on the aggregates and grants, so that
// each dialect writes them with one statement per table.
//
// Where the deltas come from (see Batch):
//   - a billed charge adds its units and one request to usage, and its
//     allocations to used;
//   - a duplicate charge adds nothing;
//   - any charge with Reserved takes its allocations off the node's
//     reservation;
//   - an applied refund takes the event's units off usage (on the day of the
//     charge) and the event's allocations off used;
//   - a refund with Reserved gives its allocations back to the node's
//     reservation, except a DuplicateRefund, which changes nothing.
type settlePlan struct {
	usage  map[usageKey]usageDelta
	grants map[grantKey]grantDelta
}

func newSettlePlan() *settlePlan {
	return &settlePlan{usage: make(map[usageKey]usageDelta), grants: make(map[grantKey]grantDelta)}
}

func (p *settlePlan) addUsage(account, key, route string, day int32, units, requests int64) {
	k := usageKey{account, key, route, day}
	d := p.usage[k]
	d.units += units
	d.requests += requests
	p.usage[k] = d
}

func (p *settlePlan) addGrants(account string, allocs []shard.Alloc, used, reserved int64) {
	for _, a := range allocs {
		k := grantKey{account, a.Grant}
		d := p.grants[k]
		d.used += used * a.Units
		d.reserved += reserved * a.Units
		p.grants[k] = d
	}
}

// billCharge adds a charge that is billed.
func (p *settlePlan) billCharge(c *Charge) {
	p.addUsage(c.Account, c.Key, c.Route, dayOf(c.Wall), c.Units, 1)
	var reserved int64
	if c.Reserved {
		reserved = -1
	}
	p.addGrants(c.Account, c.Allocs, 1, reserved) // one map pass: used up, reservation down
}

// reservedCharge takes a charge's reserved units off the node's
// reservation; alone, it is what a duplicate charge does.
func (p *settlePlan) reservedCharge(c *Charge) {
	if c.Reserved {
		p.addGrants(c.Account, c.Allocs, 0, -1)
	}
}

// refundedEvent is the charge a refund applies to, as the ledger has it.
type refundedEvent struct {
	key, route string
	chargeWall int64
	units      int64
	allocs     []shard.Alloc
}

// applyRefund adds a refund that returned the event's units.
func (p *settlePlan) applyRefund(r *Refund, ev refundedEvent) {
	p.addUsage(r.Account, ev.key, ev.route, dayOf(ev.chargeWall), -ev.units, 0)
	p.addGrants(r.Account, ev.allocs, -1, 0)
	p.reservedRefund(r)
}

// reservedRefund gives a refund's reserved units back to the node's
// reservation; alone, it is what a tombstoned refund does.
func (p *settlePlan) reservedRefund(r *Refund) {
	if r.Reserved {
		p.addGrants(r.Account, r.Allocs, 0, 1)
	}
}

// eventOfRefund is the event a refund names, as the refund itself describes
// it: what applies when the ledger has no event row to go by (events off).
func eventOfRefund(r *Refund) refundedEvent {
	return refundedEvent{key: r.Key, route: r.Route, chargeWall: r.ChargeWall, units: r.Units, allocs: r.Allocs}
}

type usageRow struct {
	usageKey
	usageDelta
}

// usageRows lists the non-zero usage deltas in key order (the order rows are
// locked in, the same for every settler, so settles do not deadlock).
func (p *settlePlan) usageRows() []usageRow {
	rows := make([]usageRow, 0, len(p.usage))
	for k, d := range p.usage {
		if d != (usageDelta{}) {
			rows = append(rows, usageRow{k, d})
		}
	}
	slices.SortFunc(rows, func(a, b usageRow) int {
		return cmp.Or(cmp.Compare(a.account, b.account), cmp.Compare(a.key, b.key), cmp.Compare(a.route, b.route), cmp.Compare(a.day, b.day))
	})
	return rows
}

type grantRow struct {
	grantKey
	grantDelta
}

// grantRows lists the non-zero grant deltas in (account, grant) order, the
// order grants are locked in everywhere.
func (p *settlePlan) grantRows() []grantRow {
	rows := make([]grantRow, 0, len(p.grants))
	for k, d := range p.grants {
		if d != (grantDelta{}) {
			rows = append(rows, grantRow{k, d})
		}
	}
	slices.SortFunc(rows, func(a, b grantRow) int { return compareGrantKeys(a.grantKey, b.grantKey) })
	return rows
}

func compareGrantKeys(a, b grantKey) int {
	return cmp.Or(cmp.Compare(a.account, b.account), cmp.Compare(a.grant, b.grant))
}

// refundKey names the event a refund applies to. Within one batch a second
// refund of the same event is a DuplicateRefund without asking the ledger.
type refundKey struct {
	account, event string
	period         shard.Period
}

// chargeRef and refundRef describe records for SettleResult.
func chargeRef(c *Charge) EventRef {
	return EventRef{Account: c.Account, EventID: c.EventID, Units: c.Units, Allocs: c.Allocs, Reserved: c.Reserved}
}

func refundRef(r *Refund) EventRef {
	return EventRef{Account: r.Account, EventID: r.EventID, Units: r.Units, Allocs: r.Allocs, Reserved: r.Reserved}
}

// reserveTake works out Reserve's allocation over the account's active
// grants, given in spending order (soonest expiry first, never-expiring
// last, then by id): min(free, rest) from each. It returns what to take and
// which grants have nothing free afterwards.
func reserveTake(grants []activeGrant, need int64) (res ReserveResult) {
	rest := max(need, 0)
	for _, g := range grants {
		free := max(g.units-g.used-g.reserved, 0)
		take := min(free, rest)
		if take > 0 {
			res.Granted = append(res.Granted, shard.Alloc{Grant: g.id, Units: take})
			rest -= take
		}
		if free-take == 0 {
			if g.reserved > g.mine {
				res.HeldElsewhere = append(res.HeldElsewhere, g.id)
			} else {
				res.Exhausted = append(res.Exhausted, g.id)
			}
		}
	}
	return res
}

// activeGrant is a grant Reserve may take from.
type activeGrant struct {
	id                    string
	units, used, reserved int64
	mine                  int64 // of reserved, what the reserving node holds
	expires               int64 // Unix ns; 0: never
}

// sortSpending puts grants in the order the shard spends them
// (shard.CompareSpending): soonest expiry first, never-expiring last, of
// two that expire together the month's quota first.
func sortSpending(gs []activeGrant) {
	slices.SortFunc(gs, func(a, b activeGrant) int {
		return shard.CompareSpending(a.id, a.expires, b.id, b.expires)
	})
}

// validatePlan checks a plan as Snapshot.Build will, so that an admin change
// can never make the config unreadable.
func validatePlan(p *snapshot.Plan) error {
	sp, err := p.Shard()
	if err != nil {
		return fmt.Errorf("%w: plan %q: %v", ErrInvalid, p.ID, err)
	}
	if p.ID == "" {
		return fmt.Errorf("%w: a plan needs an id", ErrInvalid)
	}
	if err := sp.Validate(); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	return nil
}

// validateGrant checks a credit grant as Snapshot.Build will.
func validateGrant(account string, g *snapshot.Grant) error {
	if account == "" || g.ID == "" || strings.HasPrefix(g.ID, "m:") || g.Units < 0 || g.StartsAt.IsZero() ||
		(!g.ExpiresAt.IsZero() && !g.ExpiresAt.After(g.StartsAt)) {
		return fmt.Errorf("%w: account %q: grant %q needs an id not starting with m:, units >= 0, a start, and expires_at after starts_at (or none)",
			ErrInvalid, account, g.ID)
	}
	return nil
}

// validateKey checks a key as Snapshot.Build will.
func validateKey(k *snapshot.Key) error {
	if k.ID == "" || k.Account == "" {
		return fmt.Errorf("%w: key %q: needs an id and an account", ErrInvalid, k.ID)
	}
	if b, err := hex.DecodeString(k.Hash); err != nil || len(b) != sha256.Size || k.Hash != strings.ToLower(k.Hash) {
		return fmt.Errorf("%w: key %q: hash must be 64 lower-case hex digits of SHA-256 (snapshot.HashKey), never the plaintext", ErrInvalid, k.ID)
	}
	return nil
}

// validateRoutes checks route weights as Snapshot.Build will, and refuses
// weights no charge may cost (over shard.MaxUnits) and patterns no request
// can match (snapshot.CheckPattern). Only new tables
// are checked so: a stored one loads as Build allows.
func validateRoutes(defaultUnits int64, weights map[string]int64) error {
	if defaultUnits > shard.MaxUnits {
		return fmt.Errorf("%w: default route weight %d is more than %d units, the most one charge may cost", ErrInvalid, defaultUnits, int64(shard.MaxUnits))
	}
	for p, w := range weights {
		if w > shard.MaxUnits {
			return fmt.Errorf("%w: route %q: weight %d is more than %d units, the most one charge may cost", ErrInvalid, p, w, int64(shard.MaxUnits))
		}
	}
	s := snapshot.Snapshot{Routes: snapshot.Routes{Default: defaultUnits, Weights: weights}}
	if err := s.Build(); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if errs := s.Routes.Unmatchable(); len(errs) > 0 {
		return fmt.Errorf("%w: %v", ErrInvalid, errs[0])
	}
	return nil
}

// buildSnapshot validates and indexes a snapshot read from the ledger. A
// malformed row fails the whole snapshot with an error naming it, so that
// the node keeps serving its last good one rather than a config with rows
// missing.
func buildSnapshot(s *snapshot.Snapshot) (*snapshot.Snapshot, error) {
	if err := s.Build(); err != nil {
		return nil, fmt.Errorf("flush: snapshot of config version %d: %w: %w", s.Version, ErrInvalid, err)
	}
	return s, nil
}

// monthlyUsedPeriods are the periods whose monthly grants a snapshot at wall
// reports: the period of wall and the one before.
func monthlyUsedPeriods(wall time.Time) (cur, prev shard.Period) {
	cur = shard.PeriodOf(wall.UnixNano())
	return cur, cur - 1
}

// sortReleased orders ReleaseNode's answer by account and grant.
func sortReleased(rs []Released) {
	slices.SortFunc(rs, func(a, b Released) int {
		return compareGrantKeys(grantKey{a.Account, a.Grant}, grantKey{b.Account, b.Grant})
	})
}

func sumUnits(units []int64) int64 {
	var n int64
	for _, u := range units {
		n += u
	}
	return n
}
