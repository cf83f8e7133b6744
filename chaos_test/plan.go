package chaos

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"time"
)

// Episode is one fault on the schedule: it begins at Start and is healed at
// End (offsets from the start of the workload). One-shot faults (scale-up,
// scale-down, rolling-restart) have End as a planning estimate: the run
// takes as long as the nodes need.
type Episode struct {
	Fault      Fault
	Start, End time.Duration
	// Node is the target of a node fault, the bridge of a bridge, the new
	// or leaving node of a scale change.
	Node string
	// Sides are the two sides of a partition (isolate: the node alone, the
	// rest), without the bridge node.
	Sides [2][]string
	// Offset is a clock skew's shift (clock-jump computes its own when it
	// runs: to the next month).
	Offset time.Duration
	// Latency is a slow ledger's added delay.
	Latency time.Duration
}

// Plan is a seeded schedule of faults. NewPlan is a pure function of its
// arguments: the same seed always gives the same plan (the golden file
// testdata/plans.txt pins it).
type Plan struct {
	Seed     uint64
	Nodes    int
	Duration time.Duration
	Faults   []Fault
	Episodes []Episode
}

// Planning constants.
const (
	warmup    = 5 * time.Second // steady load before the first fault
	minGap    = 3 * time.Second // quiet time between faults that do not mix
	maxGap    = 6 * time.Second
	mixChance = 0.35 // chance the next fault starts while this one is on
	minNodes  = 3
	maxExtra  = 3 // scale-ups beyond the starting nodes
	maxDraws  = 20
)

// MinDuration is the shortest run NewPlan plans: the warm-up and ten
// seconds of faults.
const MinDuration = warmup + 10*time.Second

// MaxNodes is the most nodes a run may start with when node i listens on
// SUBNET.(firstIP + i): the scale-ups (up to three more) must fit under
// SUBNET.255 too.
func MaxNodes(firstIP int) int { return 254 - firstIP - maxExtra }

// NewPlan draws a schedule of faults for nodes starting nodes over
// duration from seed.
func NewPlan(seed uint64, nodes int, duration time.Duration, faults []Fault) (*Plan, error) {
	if nodes < minNodes {
		return nil, fmt.Errorf("chaos: at least %d nodes (a partition needs two sides and a bridge a third node)", minNodes)
	}
	if len(faults) == 0 {
		return nil, errors.New("chaos: no faults to plan")
	}
	if duration < MinDuration {
		return nil, fmt.Errorf("chaos: --duration %s: want at least %s (%s of steady load, then the faults)", duration, MinDuration, warmup)
	}
	p := &Plan{Seed: seed, Nodes: nodes, Duration: duration, Faults: slices.Clone(faults)}
	g := &planner{rng: rand.New(rand.NewPCG(seed, 0x6368616f73)), plan: p, next: nodes + 1}
	for i := 1; i <= nodes; i++ {
		g.members = append(g.members, fmt.Sprintf("n%d", i))
	}
	g.run()
	return p, nil
}

type planner struct {
	rng     *rand.Rand
	plan    *Plan
	members []string        // nodes in the cluster at the current time
	next    int             // the id number of the next new node
	jumped  map[string]bool // nodes whose clock went to the next month
}

func (g *planner) run() {
	t := warmup
	for t < g.plan.Duration-5*time.Second {
		ep, ok := g.draw(t)
		if !ok {
			t += time.Second
			continue
		}
		g.accept(ep)
		length := ep.End - ep.Start
		if ep.Fault.class() != "membership" && g.rng.Float64() < mixChance {
			t = ep.Start + round(time.Duration(float64(length)*(0.3+0.4*g.rng.Float64())))
		} else {
			t = g.endOfActive(t) + g.between(minGap, maxGap)
		}
	}
}

// draw picks a fault that can start at t and builds its episode.
func (g *planner) draw(t time.Duration) (Episode, bool) {
	active := g.active(t)
	// Faults not on the plan yet come first, so a short plan still has
	// every kind it was given.
	var unused []Fault
	for _, f := range g.plan.Faults {
		if !slices.ContainsFunc(g.plan.Episodes, func(e Episode) bool { return e.Fault == f }) {
			unused = append(unused, f)
		}
	}
	for i := range maxDraws {
		pool := g.plan.Faults
		if len(unused) > 0 && i < maxDraws/2 {
			pool = unused
		}
		f := pool[g.rng.IntN(len(pool))]
		if !g.fits(f, active) {
			continue
		}
		ep, ok := g.build(f, t, active)
		if !ok || ep.End > g.plan.Duration {
			continue
		}
		return ep, true
	}
	return Episode{}, false
}

// accept puts ep on the plan and applies its effect on membership.
func (g *planner) accept(ep Episode) {
	g.plan.Episodes = append(g.plan.Episodes, ep)
	switch ep.Fault {
	case ClockJump:
		if g.jumped == nil {
			g.jumped = map[string]bool{}
		}
		g.jumped[ep.Node] = true
	case ScaleUp:
		g.next++
		g.members = append(g.members, ep.Node)
	case ScaleDown:
		g.members = slices.DeleteFunc(slices.Clone(g.members), func(m string) bool { return m == ep.Node })
	}
}

func (g *planner) active(t time.Duration) []Episode {
	var out []Episode
	for _, e := range g.plan.Episodes {
		if e.End > t {
			out = append(out, e)
		}
	}
	return out
}

func (g *planner) endOfActive(t time.Duration) time.Duration {
	end := t
	for _, e := range g.active(t) {
		end = max(end, e.End)
	}
	return end
}

func (g *planner) fits(f Fault, active []Episode) bool {
	for _, a := range active {
		if !compatible(f.class(), a.Fault.class()) {
			return false
		}
	}
	return true
}

// free lists the members no active episode targets.
func (g *planner) free(active []Episode) []string {
	busy := map[string]bool{}
	for _, a := range active {
		busy[a.Node] = true
	}
	var out []string
	for _, m := range g.members {
		if !busy[m] {
			out = append(out, m)
		}
	}
	return out
}

func (g *planner) build(f Fault, t time.Duration, active []Episode) (Episode, bool) {
	ep := Episode{Fault: f, Start: t}
	pick := func() bool {
		free := g.free(active)
		if len(free) == 0 {
			return false
		}
		ep.Node = free[g.rng.IntN(len(free))]
		return true
	}
	switch f {
	case Kill:
		ep.End = t + g.between(2*time.Second, 8*time.Second)
		return ep, pick()
	case DiskLoss:
		ep.End = t + g.between(2*time.Second, 6*time.Second)
		return ep, pick()
	case Pause:
		ep.End = t + g.between(4*time.Second, 8*time.Second)
		return ep, pick()
	case Isolate, Split, Bridge:
		ep.End = t + g.between(6*time.Second, 14*time.Second)
		ms := slices.Clone(g.members)
		g.rng.Shuffle(len(ms), func(i, j int) { ms[i], ms[j] = ms[j], ms[i] })
		switch f {
		case Isolate:
			ep.Node = ms[0]
			ep.Sides = [2][]string{{ms[0]}, sorted(ms[1:])}
		case Split:
			k := len(ms) / 2
			ep.Sides = [2][]string{sorted(ms[:k]), sorted(ms[k:])}
		case Bridge:
			ep.Node = ms[0]
			k := 1 + (len(ms)-1)/2
			ep.Sides = [2][]string{sorted(ms[1:k]), sorted(ms[k:])}
		}
		return ep, true
	case LedgerDown:
		ep.End = t + g.between(4*time.Second, 12*time.Second)
		return ep, true
	case LedgerSlow:
		ep.End = t + g.between(5*time.Second, 15*time.Second)
		ep.Latency = time.Duration(1+g.rng.IntN(8)) * 50 * time.Millisecond
		return ep, true
	case ClockSkew:
		ep.End = t + g.between(5*time.Second, 15*time.Second)
		ep.Offset = time.Duration(1+g.rng.IntN(120)) * time.Second
		if g.rng.IntN(2) == 0 {
			ep.Offset = -ep.Offset
		}
		return ep, pick()
	case ClockJump:
		ep.End = t + g.between(8*time.Second, 15*time.Second)
		return ep, pick() && !g.jumped[ep.Node]
	case ClockStart:
		ep.End = t + g.between(10*time.Second, 20*time.Second)
		return ep, pick()
	case RollingRestart:
		ep.End = t + time.Duration(len(g.members))*4*time.Second
		return ep, true
	case ScaleUp:
		if g.next > g.plan.Nodes+maxExtra {
			return ep, false
		}
		ep.Node = fmt.Sprintf("n%d", g.next)
		ep.End = t + 3*time.Second
		return ep, true
	case ScaleDown:
		if len(g.members) <= minNodes {
			return ep, false
		}
		ep.Node = g.members[g.rng.IntN(len(g.members))]
		ep.End = t + 3*time.Second
		return ep, true
	}
	return ep, false
}

// between draws a duration in [lo, hi], rounded to 100 ms.
func (g *planner) between(lo, hi time.Duration) time.Duration {
	return round(lo + time.Duration(g.rng.Int64N(int64(hi-lo)+1)))
}

func round(d time.Duration) time.Duration { return d.Round(100 * time.Millisecond) }

func sorted(s []string) []string {
	out := slices.Clone(s)
	slices.SortFunc(out, func(a, b string) int {
		if len(a) != len(b) {
			return len(a) - len(b) // n2 before n10
		}
		return strings.Compare(a, b)
	})
	return out
}

// whyMissing says why the faults m have no episode: scale-down never takes
// the cluster below minNodes, and the rest had no room in the duration.
func (p *Plan) whyMissing(m []Fault) string {
	var parts []string
	if p.Nodes <= minNodes && slices.Contains(m, ScaleDown) {
		parts = append(parts, fmt.Sprintf("scale-down (it never takes the cluster below %d nodes: give --nodes %d or more)", minNodes, minNodes+1))
		m = slices.DeleteFunc(slices.Clone(m), func(f Fault) bool { return f == ScaleDown })
	}
	if len(m) > 0 {
		parts = append(parts, fmt.Sprintf("no room in %s: %s (a longer --duration fits more)", p.Duration, joinFaults(m)))
	}
	return strings.Join(parts, "; ")
}

// Unplanned is Missing less what the operator can expect missing: with
// every fault asked for (--faults all), scale-down on a cluster it never
// takes below minNodes. A run with faults Unplanned would pass without
// having tried them: Run refuses it.
func (p *Plan) Unplanned() []Fault {
	m := p.Missing()
	if p.Nodes <= minNodes && len(p.Faults) == len(AllFaults) {
		m = slices.DeleteFunc(m, func(f Fault) bool { return f == ScaleDown })
	}
	return m
}

// FittingDuration is the shortest duration, in steps of 15 s up to an
// hour, at which the plan of this seed, nodes and faults has every fault
// Unplanned lists; 0 if none has.
func (p *Plan) FittingDuration() time.Duration {
	for d := p.Duration.Truncate(15*time.Second) + 15*time.Second; d <= time.Hour; d += 15 * time.Second {
		if q, err := NewPlan(p.Seed, p.Nodes, d, p.Faults); err == nil && len(q.Unplanned()) == 0 {
			return d
		}
	}
	return 0
}

// Missing lists the faults the plan was given but has no episode of: a
// short duration leaves no room for them.
func (p *Plan) Missing() []Fault {
	var out []Fault
	for _, f := range p.Faults {
		if !slices.ContainsFunc(p.Episodes, func(e Episode) bool { return e.Fault == f }) {
			out = append(out, f)
		}
	}
	return out
}

// String prints the plan as a readable schedule, one fault a line.
func (p *Plan) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "seed %d: %d nodes for %s, faults %s\n", p.Seed, p.Nodes, p.Duration, joinFaults(p.Faults))
	if m := p.Missing(); len(m) > 0 {
		fmt.Fprintf(&b, "  NOT IN THE PLAN: %s\n", p.whyMissing(m))
	}
	for _, e := range p.Episodes {
		fmt.Fprintf(&b, "  %8s %8s  %s\n", clock(e.Start), clock(e.End), e.Describe())
	}
	return b.String()
}

// Describe says what the episode does, in a few words.
func (e *Episode) Describe() string {
	side := func(s []string) string { return strings.Join(s, " ") }
	switch e.Fault {
	case Kill:
		return "kill -9 " + e.Node + ", restart with its data dir"
	case DiskLoss:
		return "kill -9 " + e.Node + ", wipe its data dir, revoke, restart empty"
	case Pause:
		return "pause " + e.Node + " (SIGSTOP)"
	case Isolate:
		return "isolate " + e.Node + " | " + side(e.Sides[1])
	case Split:
		return "split " + side(e.Sides[0]) + " | " + side(e.Sides[1])
	case Bridge:
		return "bridge " + side(e.Sides[0]) + " | " + side(e.Sides[1]) + " through " + e.Node
	case LedgerDown:
		return "ledger down (Postgres stopped)"
	case LedgerSlow:
		return fmt.Sprintf("ledger slow (+%s a packet)", e.Latency)
	case ClockSkew:
		sign := "+"
		if e.Offset < 0 {
			sign = ""
		}
		return fmt.Sprintf("clock of %s %s%s", e.Node, sign, e.Offset)
	case ClockJump:
		return "clock of " + e.Node + " jumps to the next month"
	case ClockStart:
		return "restart " + e.Node + " with its clock in the next month"
	case RollingRestart:
		return "rolling restart (SIGTERM, start, one at a time)"
	case ScaleUp:
		return "scale up: " + e.Node + " joins"
	case ScaleDown:
		return "scale down: " + e.Node + " leaves for good (SIGTERM)"
	}
	return string(e.Fault)
}

// clock formats an offset as m:ss.d.
func clock(d time.Duration) string {
	d = d.Round(100 * time.Millisecond)
	m := d / time.Minute
	s := float64(d-m*time.Minute) / float64(time.Second)
	return fmt.Sprintf("%d:%04.1f", m, s)
}
