package chaos

import (
	"fmt"
	"slices"
	"strings"
)

// Fault names a kind of fault (a nemesis).
type Fault string

// The faults. FaultHelp says what each does and how it is injected.
const (
	Kill           Fault = "kill"
	DiskLoss       Fault = "disk-loss"
	Pause          Fault = "pause"
	Isolate        Fault = "isolate"
	Split          Fault = "split"
	Bridge         Fault = "bridge"
	LedgerDown     Fault = "ledger-down"
	LedgerSlow     Fault = "ledger-slow"
	ClockSkew      Fault = "clock-skew"
	ClockJump      Fault = "clock-jump"
	ClockStart     Fault = "clock-start"
	RollingRestart Fault = "rolling-restart"
	ScaleUp        Fault = "scale-up"
	ScaleDown      Fault = "scale-down"
)

// AllFaults lists every fault, in the order --help and the report use.
var AllFaults = []Fault{Kill, DiskLoss, Pause, Isolate, Split, Bridge, LedgerDown, LedgerSlow, ClockSkew, ClockJump,
	ClockStart, RollingRestart, ScaleUp, ScaleDown}

// FaultHelp says what each fault does, for --help and the README.
var FaultHelp = map[Fault]string{
	Kill:           "SIGKILL a node, restart it 2-8 s later with the same data dir (G2: nothing acknowledged is lost)",
	DiskLoss:       "SIGKILL a node, measure the charges its log held unsettled (the documented loss), wipe its data dir, revoke its reservations as an operator would (quotad revoke), restart it empty (a new incarnation); with the ledger down the revoke waits for it, and the node stays down until then (a new incarnation refuses to start while the old one holds reservations)",
	Pause:          "SIGSTOP a node for 4-8 s, longer than the gossip failure timeout, then SIGCONT: it comes back believing it still owns its accounts",
	Isolate:        "cut one node's gossip and RPC from every other node for 6-14 s (both sides own its accounts meanwhile)",
	Split:          "cut the cluster in two halves for 6-14 s",
	Bridge:         "cut the cluster in two sides that do not talk to each other while one node talks to both, for 6-14 s",
	LedgerDown:     "stop Postgres for 4-12 s, then start it again (G8: charges go on from reservations)",
	LedgerSlow:     "add 50-400 ms to every packet between the nodes and Postgres (a TCP fault proxy) for 5-15 s",
	ClockSkew:      "shift one node's wall clock by up to 2 minutes either way for 5-15 s (a step: the node holds to its time from before it)",
	ClockJump:      "move one node's wall clock into the next month (a month boundary) for 8-15 s, then put it right; the node holds to its time from before the jump, which the ledger's clock does not confirm, and bills nothing in the later month (G9)",
	ClockStart:     "SIGTERM one node and start it again with its wall clock in the next month, as if its machine's clock were wrong from the start (no step to see), for 10-20 s, then put the clock right; before it takes an account it finds its clock off the ledger's while the others agree with the ledger, and bills by the ledger's time (G9). Runs alone: with the ledger out of reach, or the others cut off, it could not tell",
	RollingRestart: "SIGTERM each node in turn (it drains and settles) and start it again, waiting until it is ready",
	ScaleUp:        "start one more node that joins the ring",
	ScaleDown:      "SIGTERM one node for good (it drains, hands its reservations back and leaves)",
}

// class groups faults that must not overlap (see compatible).
func (f Fault) class() string {
	switch f {
	case Kill, DiskLoss, Pause:
		return "node-down"
	case ClockSkew, ClockJump:
		return "clock"
	case ClockStart:
		return "clock-start"
	case Isolate, Split, Bridge:
		return "network"
	case LedgerDown, LedgerSlow:
		return "ledger"
	}
	return "membership"
}

// compatible says whether a fault of class a may start while one of class b
// is on. One fault of a class at a time; membership changes and clock-start
// run alone; a node is not taken down during a partition (a node restarted
// mid-partition would not know its blocks), everything else mixes.
func compatible(a, b string) bool {
	switch {
	case a == b, a == "membership", b == "membership", a == "clock-start", b == "clock-start":
		return false
	case a == "node-down" && b == "network", a == "network" && b == "node-down":
		return false
	}
	return true
}

// ParseFaults reads a comma-separated list of faults, or "all".
func ParseFaults(s string) ([]Fault, error) {
	if strings.TrimSpace(s) == "all" {
		return slices.Clone(AllFaults), nil
	}
	var out []Fault
	for _, p := range strings.Split(s, ",") {
		f := Fault(strings.TrimSpace(p))
		if f == "" {
			continue
		}
		if !slices.Contains(AllFaults, f) {
			return nil, fmt.Errorf("chaos: unknown fault %q (want all, or a list of: %s)", f, FaultNames())
		}
		if !slices.Contains(out, f) {
			out = append(out, f)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("chaos: no faults given (want all, or a list of: %s)", FaultNames())
	}
	return out, nil
}

// FaultNames lists every fault's name, comma-separated.
func FaultNames() string {
	names := make([]string, len(AllFaults))
	for i, f := range AllFaults {
		names[i] = string(f)
	}
	return strings.Join(names, ",")
}

func joinFaults(fs []Fault) string {
	names := make([]string, len(fs))
	for i, f := range fs {
		names[i] = string(f)
	}
	return strings.Join(names, ",")
}
