package chaos

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/quotaring/quotaring/internal/cluster"
)

// The nemesis: one goroutine walks the plan's begin and end actions in time
// order and applies them. Times are offsets from the start of the workload:
// a chaos schedule is wall-clock by nature; what the harness waits for in
// between (a node ready, one ring, every log settled) it polls for, never
// sleeps for. An action that takes long (a rolling restart) delays the ones
// after it; the report shows the times faults really began and ended.

type action struct {
	at    time.Duration
	ep    *Episode
	begin bool
}

func (p *Plan) actions() []action {
	var out []action
	for i := range p.Episodes {
		e := &p.Episodes[i]
		out = append(out, action{e.Start, e, true})
		if !e.oneShot() {
			out = append(out, action{e.End, e, false})
		}
	}
	slices.SortStableFunc(out, func(a, b action) int {
		if a.at != b.at {
			return int(a.at - b.at)
		}
		if a.begin != b.begin { // heal before the next fault at the same instant
			if a.begin {
				return 1
			}
			return -1
		}
		return 0
	})
	return out
}

func (e *Episode) oneShot() bool {
	return e.Fault == RollingRestart || e.Fault == ScaleUp || e.Fault == ScaleDown
}

// runPlan applies the plan. It returns an error only when the harness
// itself cannot go on (ctx ended, Postgres would not restart).
func (h *harness) runPlan(ctx context.Context) error {
	origin := h.hist.Began()
	begun := map[*Episode]int64{}
	for _, a := range h.plan.actions() {
		select {
		case <-time.After(time.Until(origin.Add(a.at))):
		case <-ctx.Done():
			return ctx.Err()
		}
		now := h.hist.Now()
		if a.begin {
			h.logf("%s begin %s", clock(time.Duration(now)), a.ep.Describe())
			h.setActive(a.ep, true)
			begun[a.ep] = now
			if err := h.begin(ctx, a.ep); err != nil {
				return err
			}
			if a.ep.oneShot() {
				h.setActive(a.ep, false)
				h.window(a.ep.Fault, a.ep.Node, now)
			}
			continue
		}
		if err := h.end(ctx, a.ep); err != nil {
			return err
		}
		h.setActive(a.ep, false)
		h.window(a.ep.Fault, a.ep.Node, begun[a.ep])
		h.logf("%s end   %s", clock(time.Duration(h.hist.Now())), a.ep.Describe())
	}
	select { // the workload runs the whole duration
	case <-time.After(time.Until(origin.Add(h.plan.Duration))):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// episodeOn reports whether a kill of node is on now (its end starts it).
func (h *harness) episodeOn(node string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.ContainsFunc(h.active, func(e *Episode) bool {
		return e.Node == node && (e.Fault == Kill || e.Fault == DiskLoss)
	})
}

func (h *harness) setActive(e *Episode, on bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if on {
		h.active = append(h.active, e)
		if h.activeSince == nil {
			h.activeSince = map[*Episode]int64{}
		}
		h.activeSince[e] = h.hist.Now()
	} else {
		delete(h.activeSince, e)
		h.active = slices.DeleteFunc(h.active, func(x *Episode) bool { return x == e })
	}
}

func (h *harness) activeNames() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var s []string
	for _, e := range h.active {
		s = append(s, e.Describe())
	}
	if len(s) == 0 {
		return "none"
	}
	return strings.Join(s, "; ")
}

func (h *harness) mustNode(id string) (*cluster.Node, error) {
	if n := h.node(id); n != nil {
		return n, nil
	}
	return nil, fmt.Errorf("chaos: the plan names node %s, which the cluster does not have", id)
}

// begin injects a fault.
func (h *harness) begin(ctx context.Context, e *Episode) error {
	switch e.Fault {
	case Isolate, Split, Bridge:
		return h.cut(ctx, e)
	case LedgerDown:
		h.pgDown = true
		return h.pg.Stop(ctx)
	case LedgerSlow:
		h.proxy.SetLatency(e.Latency)
		return nil
	case RollingRestart:
		h.rollingRestart(ctx)
		return nil
	case ScaleUp:
		return h.scaleUp(ctx, e)
	}
	n, err := h.mustNode(e.Node)
	if err != nil {
		return err
	}
	if h.unrevoked[n.ID] && !n.Running() && e.Fault != Kill && e.Fault != DiskLoss {
		// Its lost disk's revoke waits for the ledger, and it with it: the
		// plan could not know. (A kill of it does nothing: kill.)
		h.logf("%s %s not applied: %s stays down until the ledger is back (its lost disk's revoke waits)",
			clock(time.Duration(h.hist.Now())), e.Fault, n.ID)
		return nil
	}
	switch e.Fault {
	case Kill:
		h.kill(n)
	case DiskLoss:
		h.kill(n)
		h.loseDisk(ctx, n)
	case Pause:
		if err := n.Pause(); err != nil {
			h.liveness(n.ID, "could not be paused: "+err.Error())
			return nil
		}
		h.paused[n.ID] = true
	case ClockSkew:
		h.setClock(ctx, n, e.Offset)
	case ClockJump:
		h.setClock(ctx, n, untilNextMonth())
	case ClockStart:
		if n.Running() {
			h.terminate(ctx, n)
		}
		if err := n.StartWithClockOffset(ctx, untilNextMonth()); err != nil {
			h.liveness(n.ID, "could not be restarted with its clock in the next month: "+err.Error())
			return nil
		}
		h.started()
		h.rejoinPartitions(ctx, n)
	case ScaleDown:
		h.terminate(ctx, n)
		h.removed[n.ID] = true
		h.publishNodes()
	}
	return nil
}

// end heals a fault.
func (h *harness) end(ctx context.Context, e *Episode) error {
	switch e.Fault {
	case Isolate, Split, Bridge:
		for _, n := range *h.nodes.Load() {
			if n.Running() {
				if err := n.Heal(ctx); err != nil {
					h.liveness(n.ID, "could not be healed: "+err.Error())
				}
			}
		}
		return nil
	case LedgerDown:
		if err := h.pg.Start(ctx); err != nil {
			return fmt.Errorf("chaos: restart Postgres: %w", err)
		}
		h.pgDown = false
		h.startRevoked(ctx)
		return nil
	case LedgerSlow:
		h.proxy.SetLatency(0)
		return nil
	}
	n, err := h.mustNode(e.Node)
	if err != nil {
		return err
	}
	switch e.Fault {
	case Kill, DiskLoss:
		if !h.revokeLost(ctx, n) {
			h.logf("%s %s stays down: the revoke of its lost disk's reservations cannot reach the ledger yet (retried when the ledger is back)",
				clock(time.Duration(h.hist.Now())), n.ID)
			return nil
		}
		h.start(ctx, n)
		h.rejoinPartitions(ctx, n)
	case Pause:
		if !h.paused[n.ID] {
			return nil // not applied: the node was down (begin)
		}
		if err := n.Resume(); err != nil {
			h.liveness(n.ID, "could not be resumed: "+err.Error())
		}
		delete(h.paused, n.ID)
	case ClockSkew, ClockJump, ClockStart:
		h.setClock(ctx, n, 0)
	}
	return nil
}

// untilNextMonth is how far 01:00 UTC on the 1st of next month is.
func untilNextMonth() time.Duration {
	now := time.Now().UTC()
	return time.Date(now.Year(), now.Month()+1, 1, 1, 0, 0, 0, time.UTC).Sub(now)
}

func (h *harness) kill(n *cluster.Node) {
	if h.unrevoked[n.ID] && !n.Running() {
		return // down already: its lost disk's revoke waits for the ledger
	}
	if err := n.Kill(); err != nil {
		h.liveness(n.ID, "was not running when it was to be killed: "+err.Error())
	}
}

// start restarts n's process without waiting for it to be ready (a node
// restarted while the ledger is down and without a config snapshot is not
// ready until the ledger returns); the final heal waits for one ring.
func (h *harness) start(ctx context.Context, n *cluster.Node) {
	if err := n.Start(ctx); err != nil {
		h.liveness(n.ID, "could not be restarted: "+err.Error())
		return
	}
	h.started()
}

func (h *harness) setClock(ctx context.Context, n *cluster.Node, d time.Duration) {
	if !n.Running() {
		return // a restarted node starts with no offset
	}
	actx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := n.WaitAlive(actx); err != nil { // just restarted, maybe
		h.liveness(n.ID, "not serving its admin port for the clock: "+err.Error())
		return
	}
	if err := n.SetClockOffset(ctx, d); err != nil {
		h.liveness(n.ID, "clock not set: "+err.Error())
	}
}

// loseDisk measures what n's log held unsettled (the documented loss),
// wipes its data dir, and revokes its reservations as an operator would
// (quotad revoke --node ID): they are no use to anyone now.
func (h *harness) loseDisk(ctx context.Context, n *cluster.Node) {
	lost, err := measureLoss(n.DataDir)
	if err != nil {
		h.note("could not read the log of %s before wiping it: %v", n.ID, err)
	}
	var units int64
	for _, l := range lost {
		units += l.Units
	}
	if err := os.RemoveAll(n.DataDir); err != nil {
		h.liveness(n.ID, "data dir not wiped: "+err.Error())
	}
	h.mu.Lock()
	h.lost = append(h.lost, lost...)
	h.mu.Unlock()
	h.unrevoked[n.ID] = true
	revoked, err := h.revoke(ctx, n)
	if err != nil {
		h.note("revoke of %s failed (%v); retried before it starts again (a new incarnation refuses to start while the old one holds reservations)", n.ID, err)
		h.logf("%s lost the disk of %s: %d unsettled records (%d units) lost; its revoke cannot reach the ledger yet",
			clock(time.Duration(h.hist.Now())), n.ID, len(lost), units)
		return
	}
	h.logf("%s lost the disk of %s: %d unsettled records (%d units) lost; revoked %d reserved units",
		clock(time.Duration(h.hist.Now())), n.ID, len(lost), units, revoked)
}

// startRevoked starts, once the ledger is back, the nodes whose lost
// disk's revoke had to wait for it (an operator revokes, then restarts),
// unless a fault still holds them down (a kill episode not over yet: its
// end starts them).
func (h *harness) startRevoked(ctx context.Context) {
	for _, n := range *h.nodes.Load() {
		if !h.unrevoked[n.ID] || n.Running() || h.episodeOn(n.ID) {
			continue
		}
		if h.revokeLost(ctx, n) {
			h.start(ctx, n)
			h.rejoinPartitions(ctx, n)
		}
	}
}

// rejoinPartitions applies to n, started while partitions are on, the
// blocks between it and the other side of each that names it: cut left it
// out while it was down, or its process restarted without the blocks it
// had (they live in the process).
func (h *harness) rejoinPartitions(ctx context.Context, n *cluster.Node) {
	h.mu.Lock()
	var cuts []*Episode
	for _, e := range h.active {
		if e.Fault == Isolate || e.Fault == Split || e.Fault == Bridge {
			cuts = append(cuts, e)
		}
	}
	h.mu.Unlock()
	for _, e := range cuts {
		for i, ids := range e.Sides {
			if !slices.Contains(ids, n.ID) {
				continue
			}
			var others []*cluster.Node
			for _, id := range e.Sides[1-i] {
				if m, err := h.mustNode(id); err == nil && m.Running() {
					others = append(others, m)
				}
			}
			actx, cancel := context.WithTimeout(ctx, 30*time.Second)
			err := n.WaitAlive(actx)
			cancel()
			if err != nil {
				h.liveness(n.ID, "not serving its admin port for the partition it started in: "+err.Error())
				continue
			}
			if err := cluster.Partition(ctx, n, others...); err != nil {
				h.liveness(n.ID, "partition not applied after its start: "+err.Error())
			}
		}
	}
}

// revoke frees n's reservations as quotad revoke does, and counts them.
func (h *harness) revoke(ctx context.Context, n *cluster.Node) (int64, error) {
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	freed, err := h.ledger.ReleaseNode(rctx, n.ID)
	var revoked int64
	for _, f := range freed {
		revoked += f.Units
	}
	h.mu.Lock()
	h.revoked += revoked
	h.mu.Unlock()
	if err == nil {
		delete(h.unrevoked, n.ID)
	}
	return revoked, err
}

// revokeLost retries the revoke of a lost disk's node whose revoke failed
// (the ledger was down), and reports whether the node may start.
func (h *harness) revokeLost(ctx context.Context, n *cluster.Node) bool {
	if !h.unrevoked[n.ID] {
		return true
	}
	revoked, err := h.revoke(ctx, n)
	if err != nil {
		return false
	}
	h.logf("%s revoked %d reserved units of %s's lost disk", clock(time.Duration(h.hist.Now())), revoked, n.ID)
	return true
}

// terminate sends SIGTERM and waits: a drained node exits 0.
func (h *harness) terminate(ctx context.Context, n *cluster.Node) {
	tctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	if code, err := n.Terminate(tctx); code != 0 {
		h.liveness(n.ID, fmt.Sprintf("exited %d on SIGTERM (%v); its log ends:\n%s", code, err, n.LogTail(15)))
	}
}

// rollingRestart restarts every member in turn: SIGTERM (drain), start,
// ready, one ring, then the next.
func (h *harness) rollingRestart(ctx context.Context) {
	for _, n := range *h.nodes.Load() {
		if !n.Running() {
			continue
		}
		h.terminate(ctx, n)
		h.start(ctx, n)
		rctx, cancel := context.WithTimeout(ctx, convergeTimeout)
		err := n.WaitReady(rctx)
		cancel()
		if err != nil {
			h.liveness(n.ID, "not ready after its restart: "+err.Error())
			continue
		}
		if err := h.converge(ctx); err != nil {
			h.liveness(n.ID, err.Error())
		}
	}
}

func (h *harness) scaleUp(ctx context.Context, e *Episode) error {
	n, err := h.c.AddNode(ctx)
	if err != nil {
		return err
	}
	if n.ID != e.Node {
		return fmt.Errorf("chaos: the plan added %s, the cluster %s", e.Node, n.ID)
	}
	h.started()
	h.publishNodes()
	rctx, cancel := context.WithTimeout(ctx, convergeTimeout)
	defer cancel()
	if err := n.WaitReady(rctx); err != nil {
		h.liveness(n.ID, "a new node never became ready: "+err.Error())
	}
	return nil
}

// cut applies a partition: every node of one side blocks every node of the
// other (both directions, since a block is one-sided); the bridge blocks
// nobody.
func (h *harness) cut(ctx context.Context, e *Episode) error {
	side := func(ids []string) ([]*cluster.Node, error) {
		var out []*cluster.Node
		for _, id := range ids {
			n, err := h.mustNode(id)
			if err != nil {
				return nil, err
			}
			if h.unrevoked[n.ID] && !n.Running() {
				// Down until the ledger is back (its lost disk's revoke
				// waits): it takes its side's blocks when it starts
				// (startRevoked).
				continue
			}
			out = append(out, n)
		}
		return out, nil
	}
	a, err := side(e.Sides[0])
	if err != nil {
		return err
	}
	b, err := side(e.Sides[1])
	if err != nil {
		return err
	}
	// A node restarted just before may not serve its admin port yet; a
	// block it never heard of would make the partition one-sided.
	for _, n := range append(slices.Clone(a), b...) {
		actx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err := n.WaitAlive(actx)
		cancel()
		if err != nil {
			h.liveness(n.ID, "not serving its admin port for the partition: "+err.Error())
		}
	}
	for _, n := range a {
		if err := cluster.Partition(ctx, n, b...); err != nil {
			h.liveness(n.ID, "partition not applied: "+err.Error())
		}
	}
	return nil
}
