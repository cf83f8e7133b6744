package cluster

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"sync"
	"time"
)

// Status is how an operation ended, as its client saw it.
type Status string

// Statuses. Unknown is every answer that does not say what happened: a
// timeout, a transport error, quota-unavailable from a node that forwarded
// (the owner may have charged), an internal error.
const (
	StatusOK      Status = "ok"      // charged (ok or replayed), or refunded
	StatusRefused Status = "refused" // rate_limited, quota_exceeded, already_refunded, unknown_event...
	StatusUnknown Status = "unknown" // the outcome is not known
)

// Kinds of operation.
const (
	OpCharge = "charge"
	OpRefund = "refund"
)

// Op is one operation of a history: invoked at Start, answered at End
// (nanoseconds since the history began, from the monotonic clock), through
// entry point Node (a node id, or "client" for the embedded client, which
// picks owners itself, "gateway" for one with DialOptions.Gateway, which
// calls a node that forwards), decided by Decider (the node that answered for the
// owner; empty when unknown).
type Op struct {
	ID      int    `json:"id"`
	Worker  int    `json:"w"`
	Kind    string `json:"kind"`
	Via     string `json:"via"` // grpc, client, gateway, http
	Node    string `json:"node,omitempty"`
	Decider string `json:"decider,omitempty"`
	Account string `json:"acct"`
	EventID string `json:"event,omitempty"`
	// Generated: the event id was made by the client library or the owner,
	// not by the caller, so an unknown outcome cannot be matched with the
	// ledger by id.
	Generated bool   `json:"gen,omitempty"`
	Units     int64  `json:"units,omitempty"`
	Start     int64  `json:"start"`
	End       int64  `json:"end"`
	Status    Status `json:"status"`
	// Reason is the owner's reason (ok, replayed, rate_limited,
	// quota_exceeded, refunded, already_refunded, unknown_event, ...) or, for
	// unknown outcomes, what went wrong (timeout, unavailable, transport).
	Reason    string `json:"reason"`
	Remaining int64  `json:"remaining,omitempty"`
	// Reset is the end of the period the decision is in (Unix seconds), 0
	// when the answer carried none.
	Reset int64 `json:"reset,omitempty"`
	// RefundPending: the HTTP front may have refunded the charge (its
	// upstream failed, or the answer never came back from a request the
	// upstream fails); whether that refund went through is not known to the
	// client.
	RefundPending bool   `json:"refund_pending,omitempty"`
	Err           string `json:"err,omitempty"`
}

// Acked reports whether a charge was acknowledged (ok or replayed).
func (o *Op) Acked() bool { return o.Kind == OpCharge && o.Status == StatusOK }

// Admitted reports whether a charge took a token (ok, not a replay).
func (o *Op) Admitted() bool { return o.Acked() && o.Reason == "ok" }

// Refunded reports whether a refund answered that it returned the units.
func (o *Op) Refunded() bool {
	return o.Kind == OpRefund && o.Status == StatusOK && o.Reason == "refunded"
}

func (o *Op) String() string {
	s := fmt.Sprintf("op %d: %s %s/%s %du via %s", o.ID, o.Kind, o.Account, o.EventID, o.Units, o.Via)
	if o.Node != "" {
		s += "@" + o.Node
	}
	s += fmt.Sprintf(" [%s, %s] -> %s %s", fmtOffset(o.Start), fmtOffset(o.End), o.Status, o.Reason)
	if o.Decider != "" {
		s += " by " + o.Decider
	}
	if o.Reset != 0 {
		s += " reset " + time.Unix(o.Reset, 0).UTC().Format("2006-01-02")
	}
	if o.RefundPending {
		s += " (refund pending)"
	}
	if o.Err != "" {
		s += ": " + o.Err
	}
	return s
}

// fmtOffset prints ns since the start as seconds with milliseconds.
func fmtOffset(ns int64) string { return fmt.Sprintf("%.3fs", float64(ns)/1e9) }

// History records operations from many goroutines. Its methods are safe for
// concurrent use.
type History struct {
	start time.Time // monotonic origin of Op times

	mu  sync.Mutex // protects ops
	ops []Op
}

// NewHistory starts an empty history whose times count from now.
func NewHistory() *History { return &History{start: time.Now()} }

// Began is when the history began (the origin of Op times).
func (h *History) Began() time.Time { return h.start }

// Now is the current time as an Op offset.
func (h *History) Now() int64 { return int64(time.Since(h.start)) }

// Add records a finished op and returns its id.
func (h *History) Add(op Op) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	op.ID = len(h.ops)
	h.ops = append(h.ops, op)
	return op.ID
}

// Ops is a copy of the ops recorded so far, in the order they finished.
func (h *History) Ops() []Op {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.ops)
}

// Len is the number of ops recorded.
func (h *History) Len() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.ops)
}

// WriteOpsJSON writes ops as a JSON array, one op per line.
func WriteOpsJSON(w io.Writer, ops []Op) error {
	if _, err := io.WriteString(w, "[\n"); err != nil {
		return err
	}
	for i := range ops {
		b, err := json.Marshal(&ops[i])
		if err != nil {
			return err
		}
		sep := ",\n"
		if i == len(ops)-1 {
			sep = "\n"
		}
		if _, err := fmt.Fprintf(w, "%s%s", b, sep); err != nil {
			return err
		}
	}
	_, err := io.WriteString(w, "]\n")
	return err
}
