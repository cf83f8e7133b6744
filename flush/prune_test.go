package flush

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/shard"
)

// A prune waits for nodes that may run a quotad from before the retention
// rules: each node id by its latest incarnation, heard from lately, not
// stopped cleanly, without a recorded build that knows them.
func TestOlderBuilds(t *testing.T) {
	now := time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC)
	row := func(node, inc string, heard time.Duration, schema int, stopped bool) NodeRow {
		r := NodeRow{Node: node, Incarnation: inc, Heartbeat: now.Add(-heard), SchemaKnown: schema}
		if schema > 0 {
			r.Build = "v9.9.9"
		}
		if stopped {
			r.Stopped = r.Heartbeat
		}
		return r
	}
	rows := []NodeRow{
		row("n1", "a", 2*time.Second, 0, false),                // running, old: holds it back
		row("n2", "a", 2*time.Second, 10, false),               // running, new
		row("n3", "a", 2*time.Second, 0, true),                 // stopped cleanly
		row("n4", "a", 2*oldBuildWindow, 0, false),             // gone for longer than the window
		row("n5", "old", time.Minute, 0, false),                // an old incarnation...
		row("n5", "new", time.Second, retentionSchema, false),  // ...restarted on a new build
		row("n6", "new", time.Hour+time.Second, 10, false),     // the reverse: the latest is old
		row("n6", "old", oldBuildWindow-time.Minute, 7, false), // and heard from within the window
	}
	var got []string
	for _, r := range olderBuilds(rows, now) {
		got = append(got, r.Node+"/"+r.Incarnation)
	}
	if fmt.Sprint(got) != "[n1/a n6/old]" {
		t.Fatalf("olderBuilds = %v, want [n1/a n6/old]", got)
	}
}

// A month's charges may be refunded in the next month: a prune that drops
// June must wait for July to be final even when July has no events of its
// own (its only records were refunds of June's charges, which land on
// June's rows), or a node that crashed in July holding such a refund has
// it settled against a month already dropped.
func TestPruneWaitsForTheMonthAfterADroppedOne(t *testing.T) {
	now := time.Date(2026, 12, 3, 12, 0, 0, 0, time.UTC)
	june := shard.Period(2026*12 + 5)
	x := NodeRow{Node: "x", Incarnation: "x-inc", Build: "v9.9.9", SchemaKnown: 14,
		Heartbeat:      time.Date(2026, 7, 20, 0, 0, 0, 0, time.UTC), // heard from in July, then crashed
		SettledThrough: time.Date(2026, 7, 10, 0, 0, 0, 0, time.UTC)} // settled all it held on 10 July only
	err := checkPrunable(PruneOptions{Before: june + 2}, []shard.Period{june}, []NodeRow{x}, now)
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "2026-07 is not final") {
		t.Fatalf("prune of June before August while x may hold July's refunds of June: %v, want ErrInvalid naming 2026-07", err)
	}
	if err := checkPrunable(PruneOptions{Before: june + 2, Lost: []string{"x"}}, []shard.Period{june}, []NodeRow{x}, now); err != nil {
		t.Fatalf("the same with x lost: %v", err)
	}
	// x heard from a minute ago is not lost: it may be running, holding
	// refunds of the months dropped.
	x.Heartbeat = now.Add(-time.Minute)
	if err := checkPrunable(PruneOptions{Before: june + 2, Lost: []string{"x"}}, []shard.Period{june}, []NodeRow{x}, now); !errors.Is(err, ErrInvalid) ||
		!strings.Contains(err.Error(), "--lost-node x: it was heard from 1m0s ago") {
		t.Fatalf("--lost-node of a node heard from a minute ago: %v, want it refused", err)
	}
}
