package ring

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
)

// ErrClosed is returned by methods of a Ring after Close.
var ErrClosed = errors.New("ring: closed")

// ErrLeft is returned by SetState and Rejoin after Leave.
var ErrLeft = errors.New("ring: left the cluster")

// ErrUnconfirmed is returned (wrapped) by SetState when the new state is set
// and in the local ring but memberlist did not confirm its broadcast before
// the deadline, as on a machine too loaded to run the gossip loop in time.
// The state still spreads, by gossip and push-pull; callers that need the
// state locally (a node becoming serving) can go on and log it.
var ErrUnconfirmed = errors.New("memberlist did not confirm the broadcast in time (the state is set and spreads by gossip)")

// View is a consistent snapshot of the ring as this node sees it.
type View struct {
	// Epoch names the serving set (see the package doc); 0 when nobody
	// serves.
	Epoch uint64
	// Members are all alive members in any state, sorted by ID.
	Members []Meta
	// Serving are the IDs on the ring, sorted.
	Serving []string
	// Owners maps partition -> owner ID; empty when nobody serves.
	Owners []string
}

// Ring is this node's membership and its view of the ring. Its methods are
// safe for concurrent use. Lookups (Owner, Partition, OwnerOfPartition,
// Epoch, View, Self) read an immutable snapshot and never block on the
// network or on a rebuild.
type Ring struct {
	cfg      Config
	layout   Layout
	log      *slog.Logger
	resolver Resolver
	now      func() time.Time
	ml       *memberlist.Memberlist
	// tcpTimeout is memberlist's bound on one join attempt.
	tcpTimeout time.Duration

	// state is the current snapshot. Written only by the rebuild goroutine
	// (and New before it starts), read by anyone.
	state atomic.Pointer[snapshot]

	// protects self and selfMeta (read by memberlist through NodeMeta)
	selfMu   sync.Mutex
	self     Meta
	selfMeta []byte

	// protects pending: the latest memberlist event per node name, not yet
	// applied by the rebuild goroutine
	eventsMu sync.Mutex
	pending  map[string]nodeEvent
	kick     chan struct{} // capacity 1: "pending is not empty"

	// protects subs and subsClosed, sending on and closing subscriber
	// channels, and publishing a snapshot (so a Subscribe sees a snapshot
	// and exactly the Changes after it)
	subMu      sync.Mutex
	subs       map[*subscriber]struct{}
	subsClosed bool

	// protects known (gossip address and last time alive of every member
	// seen, the rejoin targets) and rejoinTurn (how far formerTargets
	// turns its order)
	knownMu    sync.Mutex
	known      map[string]knownMember
	rejoinTurn uint64

	// protects refusal: the last peer that answered a join but could not
	// gossip with this node (Refusal)
	refusalMu sync.Mutex
	refusal   struct {
		addr string
		err  error
	}

	// protects closed and left. Held for reading across memberlist calls
	// that must not overlap Shutdown (memberlist.Leave panics after it),
	// for writing by Leave and Close.
	lifeMu sync.RWMutex
	closed bool
	left   bool

	stop chan struct{} // closed by Close: goroutines return
	// exited has one channel per goroutine the ring started, closed as it
	// returns. Appended to only by New, before the Ring is shared.
	exited []chan struct{}
}

// snapshot is one published state of the ring. Immutable once stored.
type snapshot struct {
	table   *Table // serving members; the last good table when err != nil
	members []Meta // every alive member, sorted by ID
	// mismatches are the alive members whose meta disagrees with this
	// node's config, sorted by member.
	mismatches []Mismatch
	err        error // why table does not match members, if it doesn't
	// gen counts this process's tables: one more for each table with a new
	// epoch. (An epoch names a set of members, so it comes back with the
	// set: no good to tell one tenure from the next.)
	gen uint64
	// tenure maps partition -> the gen since which this node has owned it
	// without a break (0: not this node's); see Ring.Tenure.
	tenure  []uint64
	changed chan struct{}
}

// nodeEvent is a memberlist event, copied out of the callback.
type nodeEvent struct {
	alive bool
	name  string
	addr  string // gossip address host:port
	meta  []byte
}

type knownMember struct {
	addr      string
	lastAlive time.Time
	// gone: the member's last event said it died or left (Gone lists it).
	gone bool
	// left: it drained before it went (quotad's stop): no rejoin target.
	left bool
}

// New validates cfg, starts memberlist, joins the seeds and starts the
// ring's goroutines. A join that reaches no seed is not an error: it is
// logged and retried every RejoinInterval. An empty cfg.Join starts a new
// cluster.
func New(cfg Config) (r *Ring, err error) {
	// New owns cfg.Transport even when it fails: shut it down then (a second
	// Shutdown after memberlist's own is a no-op).
	defer func() {
		if err != nil && cfg.Transport != nil {
			_ = cfg.Transport.Shutdown()
		}
	}()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Meta.State == "" {
		cfg.Meta.State = StateJoining
	}
	cfg.Join = slices.Clone(cfg.Join)
	base := cfg.Logger
	if base == nil {
		base = slog.New(slog.DiscardHandler)
	}
	logger := base // NB: the caller tags it (the node adds node and component)
	r = &Ring{
		cfg:      cfg,
		layout:   cfg.Layout(),
		log:      logger,
		resolver: cfg.Resolver,
		now:      time.Now,
		pending:  make(map[string]nodeEvent),
		kick:     make(chan struct{}, 1),
		subs:     make(map[*subscriber]struct{}),
		known:    make(map[string]knownMember),
		stop:     make(chan struct{}),
	}
	if r.resolver == nil {
		r.resolver = &net.Resolver{}
	}
	empty, err := NewTable(r.layout, nil)
	if err != nil {
		return nil, err
	}
	r.state.Store(&snapshot{table: empty, changed: make(chan struct{})})
	r.self = cfg.Meta
	r.self.ID = cfg.NodeID
	r.self.Preset = cfg.Preset
	if r.selfMeta, err = encodeMeta(r.self, r.layout.fingerprint()); err != nil {
		return nil, err
	}

	mc := cfg.memberlistConfig()
	mc.Delegate = delegate{r}
	mc.Events = delegate{r}
	mc.Conflict = delegate{r}
	mc.Logger = newStdLogger(base.With("subsystem", "memberlist"))
	ml, err := memberlist.Create(mc)
	if err != nil {
		return nil, fmt.Errorf("ring: start memberlist: %w", err)
	}
	r.ml = ml
	r.tcpTimeout = mc.TCPTimeout
	r.selfMu.Lock()
	r.self.GossipAddr = ml.LocalNode().Address()
	r.selfMu.Unlock()

	r.spawn(r.run)

	// memberlist announced this node to itself in Create; wait until the
	// first snapshot has it, so Self, View and Subscribe start coherent.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.await(ctx, func(s *snapshot) bool { return s.member(cfg.NodeID) }); err != nil {
		_ = r.Close(context.Background())
		return nil, fmt.Errorf("ring: local node never appeared: %w", err)
	}

	if len(cfg.Join) > 0 {
		jctx, jcancel := context.WithTimeout(context.Background(), r.joinBudget())
		n, err := r.Rejoin(jctx)
		jcancel()
		if err != nil {
			r.log.Warn("could not join the cluster yet; retrying: check --join (the others' --gossip-addr, or a DNS name that resolves to them) "+
				"and that the gossip port (TCP and UDP) is open between the nodes", "join", cfg.Join, "every", cfg.RejoinInterval, "err", err)
		} else {
			r.log.Info("joined the cluster", "contacted", n)
		}
	}

	r.spawn(r.rejoinLoop)
	return r, nil
}

// spawn runs f in a goroutine that Close waits for.
func (r *Ring) spawn(f func()) {
	done := make(chan struct{})
	r.exited = append(r.exited, done)
	go func() {
		defer close(done)
		f()
	}()
}

// Self returns this node's meta as it gossips it.
func (r *Ring) Self() Meta {
	r.selfMu.Lock()
	defer r.selfMu.Unlock()
	return r.self
}

// Owner returns the member that owns account, or false when no member is
// serving.
func (r *Ring) Owner(account string) (Meta, bool) {
	return r.state.Load().table.Owner(account)
}

// Tenure names the stretch of time over which this node has owned account
// without a break (a number that grows with each table this process
// builds), or is 0 when it does not own it. An account's owner compares it
// with the tenure it last decided under: an account that went to another
// node and came back between two of its requests has a new tenure, and
// what the node remembers of it from before is stale, since the other owner
// may have refunded or charged its events meanwhile. (The subscriber's
// Changes can miss it: when the loss is read after the account came back,
// the account looks owned and is not let go.)
func (r *Ring) Tenure(account string) uint64 {
	s := r.state.Load()
	if p := r.layout.Partition(account); p < len(s.tenure) {
		return s.tenure[p]
	}
	return 0
}

// tenureOf is the tenure of each partition in t, gen-th table: this
// node's (self) since old's tenure, or since gen.
func tenureOf(old *snapshot, t *Table, gen uint64, self string) []uint64 {
	out := make([]uint64, t.layout.PartitionCount)
	for p := range out {
		switch {
		case ownerID(t, p) != self:
		case p < len(old.tenure) && old.tenure[p] != 0 && ownerID(old.table, p) == self:
			out[p] = old.tenure[p]
		default:
			out[p] = gen
		}
	}
	return out
}

// Partition returns the partition account hashes to. It depends only on the
// layout, never on membership.
func (r *Ring) Partition(account string) int {
	return r.layout.Partition(account)
}

// OwnerOfPartition returns the owner of partition p, or false when no member
// is serving or p is out of range.
func (r *Ring) OwnerOfPartition(p int) (Meta, bool) {
	return r.state.Load().table.OwnerOfPartition(p)
}

// Epoch returns the epoch of the current ring: see the package doc.
func (r *Ring) Epoch() uint64 {
	return r.state.Load().table.Epoch()
}

// Table returns the current partition table, for callers that make several
// lookups that must agree with each other.
func (r *Ring) Table() *Table {
	return r.state.Load().table
}

// Layout returns the ring's layout.
func (r *Ring) Layout() Layout { return r.layout }

// View returns a consistent snapshot. The slices are the caller's.
func (r *Ring) View() View {
	s := r.state.Load()
	v := View{
		Epoch:   s.table.Epoch(),
		Members: slices.Clone(s.members),
		Owners:  s.table.Owners(),
	}
	for _, m := range s.table.members {
		v.Serving = append(v.Serving, m.ID)
	}
	return v
}

// Err returns why the ring does not reflect the current serving members
// (for example ErrTooManyMembers), or nil when it does. While Err is not
// nil, the ring keeps the last table that could be built.
func (r *Ring) Err() error {
	return r.state.Load().err
}

// Subscribe returns a channel of this node's partition changes and a cancel
// func that closes it. The first Change describes the current ownership (all
// Gained). The channel holds up to buf Changes (at least 1); when it is
// full, the queued Changes and the new one are composed into one (see
// Change), so a slow subscriber never blocks the ring and never misses a
// lost partition. The channel is closed by cancel and by Close.
func (r *Ring) Subscribe(buf int) (<-chan Change, func()) {
	s := &subscriber{ch: make(chan Change, max(buf, 1))}
	r.subMu.Lock()
	defer r.subMu.Unlock()
	if r.subsClosed {
		s.close()
		return s.ch, func() {}
	}
	cur := r.state.Load().table
	s.ch <- Change{Epoch: cur.Epoch(), Gained: cur.PartitionsOf(r.cfg.NodeID)}
	r.subs[s] = struct{}{}
	return s.ch, func() {
		r.subMu.Lock()
		defer r.subMu.Unlock()
		delete(r.subs, s)
		s.close()
	}
}

// SetState changes this node's state and gossips it. It returns once the
// local ring reflects the new state and memberlist has sent the update, or
// when ctx ends (without a deadline, the broadcast wait is bounded by 5 s).
// An error from the broadcast leaves the state set: the update still spreads
// by gossip and push-pull, and the error wraps ErrUnconfirmed.
func (r *Ring) SetState(ctx context.Context, s State) error {
	if !s.Valid() {
		return fmt.Errorf("ring: invalid state %q (want joining, serving or draining)", s)
	}
	if err := r.setSelf(ctx, "set state "+string(s), func(m *Meta) { m.State = s }, func(m Meta) bool { return m.State == s }); err != nil {
		return err
	}
	r.log.Info("state changed", "state", s)
	return nil
}

// SetClock gossips what this node found of its clock against the ledger's
// (node/clock.go reads the others' in View().Members). It returns like
// SetState.
func (r *Ring) SetClock(ctx context.Context, v ClockVerdict) error {
	return r.setSelf(ctx, "set clock "+v.String(), func(m *Meta) { m.Clock = v }, func(m Meta) bool { return m.Clock == v })
}

// setSelf changes this node's meta with set, gossips it, and waits until
// the local snapshot shows it (done).
func (r *Ring) setSelf(ctx context.Context, what string, set func(*Meta), done func(Meta) bool) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	r.lifeMu.RLock()
	if err := r.lifeErrLocked(); err != nil {
		r.lifeMu.RUnlock()
		return err
	}
	r.selfMu.Lock()
	self := r.self
	set(&self)
	enc, err := encodeMeta(self, r.layout.fingerprint())
	if err == nil {
		r.self, r.selfMeta = self, enc
	}
	r.selfMu.Unlock()
	if err != nil {
		r.lifeMu.RUnlock()
		return err
	}
	bErr := r.ml.UpdateNode(broadcastWait(ctx))
	r.lifeMu.RUnlock()

	id := r.cfg.NodeID
	if err := r.await(ctx, func(snap *snapshot) bool {
		m, ok := snap.lookup(id)
		return ok && done(m)
	}); err != nil {
		return fmt.Errorf("ring: %s: %w", what, err)
	}
	if bErr != nil {
		return fmt.Errorf("ring: %s: %w (%v)", what, ErrUnconfirmed, bErr)
	}
	return nil
}

// Leave announces that this node leaves the cluster, and returns once the
// local ring no longer has it (its subscribers have been told they lost
// every partition) and the announcement went out, or when ctx ends. The
// node stops rejoining. Call Close afterwards.
func (r *Ring) Leave(ctx context.Context) error {
	r.lifeMu.Lock()
	if r.closed {
		r.lifeMu.Unlock()
		return ErrClosed
	}
	r.left = true
	err := r.ml.Leave(broadcastWait(ctx))
	r.lifeMu.Unlock()

	id := r.cfg.NodeID
	if werr := r.await(ctx, func(s *snapshot) bool { return !s.member(id) }); werr != nil {
		return fmt.Errorf("ring: leave: %w", werr)
	}
	if err != nil {
		return fmt.Errorf("ring: leave: %w", err)
	}
	r.log.Info("left the cluster")
	return nil
}

// Close stops the ring's goroutines, shuts memberlist (and its transport)
// down and closes subscriber channels. Without a Leave first, the others
// find this node dead by failure detection. It returns when every goroutine
// of the ring has exited, or with ctx's error if ctx ends first. Closing
// twice is a no-op.
func (r *Ring) Close(ctx context.Context) error {
	r.lifeMu.Lock()
	if r.closed {
		r.lifeMu.Unlock()
		return nil
	}
	r.closed = true
	r.lifeMu.Unlock()

	close(r.stop)
	var err error
	if r.ml != nil {
		err = r.ml.Shutdown()
	}
	r.subMu.Lock()
	r.subsClosed = true
	for s := range r.subs {
		s.close()
		delete(r.subs, s)
	}
	r.subMu.Unlock()

	for _, done := range r.exited {
		select {
		case <-done:
		case <-ctx.Done():
			return fmt.Errorf("ring: close: %w", ctx.Err())
		}
	}
	return err
}

// lifeErrLocked returns why memberlist may not be used.
//
// REQUIRES: r.lifeMu held.
func (r *Ring) lifeErrLocked() error {
	switch {
	case r.closed:
		return ErrClosed
	case r.left:
		return ErrLeft
	}
	return nil
}

// broadcastWait turns ctx's deadline into memberlist's timeout.
func broadcastWait(ctx context.Context) time.Duration {
	if d, ok := ctx.Deadline(); ok {
		return max(time.Until(d), time.Millisecond)
	}
	return defaultBroadcastWait
}

// await blocks until cond holds for the current snapshot, ctx ends or the
// ring closes.
func (r *Ring) await(ctx context.Context, cond func(*snapshot) bool) error {
	for {
		s := r.state.Load()
		if cond(s) {
			return nil
		}
		select {
		case <-s.changed:
		case <-ctx.Done():
			return ctx.Err()
		case <-r.stop:
			return ErrClosed
		}
	}
}

// queue records a memberlist event for the rebuild goroutine. It runs inside
// memberlist's callbacks, so it only copies and signals: it must not call
// back into memberlist (Members() there deadlocks) nor block.
func (r *Ring) queue(n *memberlist.Node, alive bool) {
	ev := nodeEvent{alive: alive, name: n.Name, addr: n.Address(), meta: slices.Clone(n.Meta)}
	r.eventsMu.Lock()
	r.pending[n.Name] = ev
	r.eventsMu.Unlock()
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

func (r *Ring) takeEvents() map[string]nodeEvent {
	r.eventsMu.Lock()
	defer r.eventsMu.Unlock()
	evs := r.pending
	r.pending = make(map[string]nodeEvent)
	return evs
}

// run is the rebuild goroutine: the only writer of r.state. It owns
// members.
func (r *Ring) run() {
	members := make(map[string]Meta)
	warned := make(map[string]Mismatch) // node -> its mismatch, logged once; alive members only
	for {
		select {
		case <-r.stop:
			return
		case <-r.kick:
		}
		r.apply(members, warned, r.takeEvents())
		r.publish(members, warned)
	}
}

// Mismatch is an alive member whose node meta disagrees with this node's
// config in a way the ring cannot repair. The member is kept (it gossips,
// and serves if it says so), and the mismatch is logged at ERROR once and
// listed by Mismatches until the member leaves or agrees.
type Mismatch struct {
	Member string
	Reason MismatchReason
	// Theirs and Ours are the values that differ, when the meta names them
	// (the preset).
	Theirs, Ours string
}

// MismatchReason says what a Mismatch disagrees on.
type MismatchReason string

const (
	// MismatchMeta: its meta cannot be read (another program, a newer
	// incompatible encoding); it never serves.
	MismatchMeta MismatchReason = "meta"
	// MismatchLayout: another PartitionCount, ReplicationFactor or Load:
	// its owners differ from ours.
	MismatchLayout MismatchReason = "layout"
	// MismatchPreset: another memberlist preset (--ring-preset): the two
	// time failure detection differently, so one declares the other dead
	// (and takes its accounts) far sooner or later than the other expects.
	MismatchPreset MismatchReason = "preset"
)

// MismatchReasons lists every MismatchReason, for metrics.
func MismatchReasons() []MismatchReason {
	return []MismatchReason{MismatchMeta, MismatchLayout, MismatchPreset}
}

// Mismatches lists the alive members whose meta disagrees with this node's
// config, sorted by member.
func (r *Ring) Mismatches() []Mismatch {
	return slices.Clone(r.state.Load().mismatches)
}

// mismatchOf compares a member's decoded meta with this node's config.
// ok is false when they agree. A member that does not say its preset (an
// older version) agrees.
func (r *Ring) mismatchOf(m Meta, fp uint32, err error) (Mismatch, bool) {
	switch {
	case err != nil:
		return Mismatch{Member: m.ID, Reason: MismatchMeta}, true
	case fp != r.layout.fingerprint():
		return Mismatch{Member: m.ID, Reason: MismatchLayout}, true
	case m.Preset != "" && m.Preset != r.cfg.Preset:
		return Mismatch{Member: m.ID, Reason: MismatchPreset, Theirs: m.Preset, Ours: r.cfg.Preset}, true
	}
	return Mismatch{}, false
}

// logMismatch logs mm at ERROR, saying what to do.
func (r *Ring) logMismatch(mm Mismatch, addr string) {
	switch mm.Reason {
	case MismatchMeta:
		r.log.Error("unreadable node meta: member is kept but never serves", "member", mm.Member, "addr", addr)
	case MismatchLayout:
		r.log.Error("member uses another ring layout (PartitionCount, ReplicationFactor or Load): its owners differ from ours", "member", mm.Member, "addr", addr)
	case MismatchPreset:
		r.log.Error("member runs another memberlist preset (--ring-preset): the two time failure detection differently, "+
			"so one takes the other's accounts sooner or later than it expects; start every node of a cluster with the same --ring-preset",
			"member", mm.Member, "addr", addr, "theirs", mm.Theirs, "ours", mm.Ours)
	}
}

// apply folds events into members and the rejoin targets.
func (r *Ring) apply(members map[string]Meta, warned map[string]Mismatch, evs map[string]nodeEvent) {
	now := r.now()
	r.knownMu.Lock()
	defer r.knownMu.Unlock()
	for name, ev := range evs {
		switch {
		case name == r.cfg.NodeID:
		case !ev.alive && members[name].State == StateDraining:
			// Gone after draining: it left (quotad's stop drains, then
			// leaves; memberlist's NotifyLeave does not say which). Still
			// listed as gone, but not a member to merge with again: its
			// address may soon be another process's (a pod IP reused),
			// maybe of another cluster, whose ring the rejoin merged into
			// this one.
			r.known[name] = knownMember{addr: ev.addr, lastAlive: now, gone: true, left: true}
		default:
			r.known[name] = knownMember{addr: ev.addr, lastAlive: now, gone: !ev.alive}
		}
		if !ev.alive {
			delete(members, name)
			delete(warned, name)
			continue
		}
		m, fp, err := decodeMeta(name, ev.addr, ev.meta)
		mm, bad := r.mismatchOf(m, fp, err)
		switch {
		case !bad:
			delete(warned, name)
		case warned[name] != mm:
			r.logMismatch(mm, ev.addr)
			warned[name] = mm
		}
		members[name] = m
	}
}

// publish builds the snapshot for members, stores it, and tells subscribers
// how this node's partitions moved.
func (r *Ring) publish(members map[string]Meta, warned map[string]Mismatch) {
	old := r.state.Load()
	all := make([]Meta, 0, len(members))
	var serving []Meta
	for _, m := range members {
		all = append(all, m)
		if m.State == StateServing {
			serving = append(serving, m)
		}
	}
	slices.SortFunc(all, func(a, b Meta) int { return strings.Compare(a.ID, b.ID) })

	next := &snapshot{members: all, changed: make(chan struct{})}
	for _, mm := range warned {
		next.mismatches = append(next.mismatches, mm)
	}
	slices.SortFunc(next.mismatches, func(a, b Mismatch) int { return strings.Compare(a.Member, b.Member) })
	if t, ok := old.table.withMembers(serving); ok {
		next.table = t
	} else if t, err := NewTable(r.layout, serving); err != nil {
		next.table, next.err = old.table, err
		if old.err == nil || old.err.Error() != err.Error() {
			r.log.Error("cannot build ring; keeping the last one", "serving", len(serving), "kept_epoch", old.table.Epoch(), "err", err)
		}
	} else {
		next.table = t
	}

	next.gen, next.tenure = old.gen, old.tenure
	if next.table.Epoch() != old.table.Epoch() {
		next.gen++
		next.tenure = tenureOf(old, next.table, next.gen, r.cfg.NodeID)
	}
	r.subMu.Lock()
	r.state.Store(next)
	if next.table.Epoch() != old.table.Epoch() {
		c := diffChange(old.table, next.table, r.cfg.NodeID)
		for s := range r.subs {
			s.deliver(c)
		}
		r.log.Info("ring changed", "epoch", next.table.Epoch(), "serving", len(next.table.members),
			"gained", len(c.Gained), "lost", len(c.Lost))
	}
	r.subMu.Unlock()
	close(old.changed)
}

// lookup returns the alive member id.
func (s *snapshot) lookup(id string) (Meta, bool) {
	i, ok := slices.BinarySearchFunc(s.members, id, func(m Meta, id string) int { return strings.Compare(m.ID, id) })
	if !ok {
		return Meta{}, false
	}
	return s.members[i], true
}

func (s *snapshot) member(id string) bool {
	_, ok := s.lookup(id)
	return ok
}

// delegate adapts Ring to memberlist's Delegate, EventDelegate and
// ConflictDelegate without putting those methods on Ring's API. Every
// method is called from memberlist's goroutines and returns at once.
type delegate struct{ r *Ring }

// NodeMeta returns the encoded self meta; Config.Validate and SetState
// guarantee it fits limit.
func (d delegate) NodeMeta(limit int) []byte {
	d.r.selfMu.Lock()
	defer d.r.selfMu.Unlock()
	return d.r.selfMeta
}

func (delegate) NotifyMsg([]byte)                           {}
func (delegate) GetBroadcasts(overhead, limit int) [][]byte { return nil }
func (delegate) LocalState(join bool) []byte                { return nil }
func (delegate) MergeRemoteState(buf []byte, join bool)     {}

func (d delegate) NotifyJoin(n *memberlist.Node)   { d.r.queue(n, true) }
func (d delegate) NotifyUpdate(n *memberlist.Node) { d.r.queue(n, true) }
func (d delegate) NotifyLeave(n *memberlist.Node)  { d.r.queue(n, false) }

// NotifyConflict reports two nodes claiming one name: they would share an
// owner identity, so it is logged as an error.
func (d delegate) NotifyConflict(existing, other *memberlist.Node) {
	d.r.log.Error("two nodes claim the same NodeID: two processes run with one --node-id, or the node restarted on a new address before the others declared it dead on its old one (that ends by itself within the failure timeout)", "id", existing.Name,
		"existing", existing.Address(), "other", other.Address())
}
