package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"mime"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/quotaring/quotaring/internal/cluster"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/router/pb"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

// The workload: Workers goroutines share Rate operations a second. Each
// operation is, by the worker's seeded draw,
//
//	 5%  a retry of a charge it saw acknowledged, same event id, through
//	     another way in (it must be replayed, never billed twice)
//	 7%  a refund of a charge it saw acknowledged; a third of them followed
//	     by a second refund of the same event another way (refunds once):
//	     over gRPC at a node, the embedded client, or the Gateway one
//	88%  a new charge: through a random node over gRPC (Route: the node
//	     forwards to the owner), through the embedded client (router.Client,
//	     which picks owners itself), through an embedded client with
//	     Gateway (every call to one node, which forwards), or through a
//	     random node's HTTP proxy (Authorization: Bearer, Idempotency-Key);
//	     a charge whose outcome is unknown is retried with the same event id
//	     through other ways in, up to 3 times
//
// The seed fixes each worker's choices, not the interleaving: the nodes are
// real processes.
const (
	shareReplay   = 0.05
	shareRefund   = 0.07
	doubleRefund  = 0.3
	maxRetries    = 3
	recentCharges = 256
)

// acked is a charge a worker saw acknowledged, kept to retry or refund.
type acked struct {
	account, event, path string
	units                int64
	generated            bool
	receipt              *shard.Receipt // nil through HTTP (refunds go by client event id)
}

type worker struct {
	h      *harness
	id     int
	rng    *rand.Rand
	seq    int
	recent []acked
	// halt ends when the run is interrupted: an operation then makes no
	// more retries (each takes up to callTimeout: Ctrl-C waited for them).
	halt context.Context
}

// startWorkload starts the workers; the returned group ends when ctx does.
// halt is the run's context: once it ends, operations are not retried.
func (h *harness) startWorkload(ctx, halt context.Context) *sync.WaitGroup {
	tokens := make(chan struct{}, h.cfg.Workers)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(time.Duration(float64(time.Second) / h.cfg.Rate))
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				select {
				case tokens <- struct{}{}:
				default: // every worker is busy: the cluster is slower than Rate
				}
			}
		}
	}()
	for i := range h.cfg.Workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w := &worker{h: h, id: i, rng: rand.New(rand.NewPCG(h.cfg.Seed, uint64(i)+1)), halt: halt}
			for {
				select {
				case <-ctx.Done():
					return
				case <-tokens:
				}
				w.step()
			}
		}()
	}
	return &wg
}

// step does one operation. Calls run on their own deadline, not on the
// workload's context, so stopping the load does not leave unknowns behind.
func (w *worker) step() {
	switch r := w.rng.Float64(); {
	case r < shareReplay && len(w.recent) > 0:
		w.replay()
	case r < shareReplay+shareRefund && len(w.recent) > 0:
		w.refund()
	default:
		w.charge()
	}
}

func (w *worker) pickAccount() (string, bool) {
	a := &w.h.acct
	switch r := w.rng.Float64(); {
	case r < shareHard:
		return a.hard[w.rng.IntN(len(a.hard))], false
	case r < shareHard+shareBig:
		return a.big[w.rng.IntN(len(a.big))], false
	case r < shareHard+shareBig+shareSoft:
		return a.soft[w.rng.IntN(len(a.soft))], false
	}
	return a.rl[w.rng.IntN(len(a.rl))], true
}

// pickVia draws a way in: grpc 40%, client 25%, gateway 15%, http 20%,
// other than not (a retry goes another way), and never http for
// rate-limited accounts (G7 needs the deciding node, which HTTP answers do
// not name).
func (w *worker) pickVia(rateLimited bool, not string) string {
	for {
		v := "http"
		switch r := w.rng.Float64(); {
		case r < 0.40:
			v = "grpc"
		case r < 0.65:
			v = "client"
		case r < 0.80:
			v = "gateway"
		}
		if (v == "http" && rateLimited) || v == not {
			continue
		}
		return v
	}
}

// pickNode draws a running node (paused ones included: clients do not know).
func (w *worker) pickNode() *cluster.Node {
	ns := *w.h.nodes.Load()
	for range 2 * len(ns) {
		if n := ns[w.rng.IntN(len(ns))]; n.Running() {
			return n
		}
	}
	return nil
}

func (w *worker) charge() {
	acct, limited := w.pickAccount()
	w.seq++
	ev := fmt.Sprintf("w%d-%d", w.id, w.seq)
	via := w.pickVia(limited, "")
	generated := (via == "client" || via == "gateway") && w.rng.Float64() < 0.2
	if generated {
		ev = ""
	}
	path, units := "/v1/work", int64(1)
	if via == "http" {
		switch r := w.rng.Float64(); {
		case r < 0.1:
			path = "/v1/fail"
		case r < 0.3:
			path, units = "/v1/heavy", 3
		}
	}
	op, receipt := w.do(via, acct, ev, path, units)
	for try := 0; op.Status == cluster.StatusUnknown && !generated && try < maxRetries && w.halt.Err() == nil; try++ {
		if via != "http" { // an HTTP client retries the same request (the front may refund it)
			via = w.pickVia(limited, via)
		}
		op, receipt = w.do(via, acct, ev, path, units)
	}
	if op.Acked() && !op.RefundPending {
		w.remember(acked{account: acct, event: op.EventID, path: path, units: units, generated: generated, receipt: receipt})
	}
}

func (w *worker) remember(a acked) {
	if len(w.recent) < recentCharges {
		w.recent = append(w.recent, a)
		return
	}
	w.recent[w.rng.IntN(len(w.recent))] = a
}

// take removes and returns a random remembered charge.
func (w *worker) take() acked {
	i := w.rng.IntN(len(w.recent))
	a := w.recent[i]
	w.recent[i] = w.recent[len(w.recent)-1]
	w.recent = w.recent[:len(w.recent)-1]
	return a
}

// replay retries an acknowledged charge with its event id, another way in.
func (w *worker) replay() {
	a := w.recent[w.rng.IntN(len(w.recent))]
	if a.generated {
		return // only client ids are deduplicated: a generated id is not a retry key
	}
	limited := w.h.acct.limits[a.account].Rate > 0
	w.do(w.pickVia(limited, ""), a.account, a.event, a.path, a.units)
}

// refund refunds an acknowledged charge, and sometimes again another way.
func (w *worker) refund() {
	refundVias := [...]string{"grpc", "client", "gateway"}
	a := w.take()
	i := w.rng.IntN(len(refundVias))
	w.doRefund(refundVias[i], a)
	if w.rng.Float64() < doubleRefund {
		w.doRefund(refundVias[(i+1+w.rng.IntN(len(refundVias)-1))%len(refundVias)], a)
	}
}

// embedded is the embedded client a way in names: "gateway" the one with
// DialOptions.Gateway, "client" the one that calls owners.
func (h *harness) embedded(via string) *router.Client {
	if via == "gateway" {
		return h.gateway
	}
	return h.client
}

// routeOf is the route the HTTP front charges a path under (the seeded
// weights name only /v1/heavy): a charge sent over gRPC or the embedded
// client names the same route, so that a retry of it through the proxy,
// with the same id, is a replay and not a reused key (id_reused).
func routeOf(path string) string {
	if path == "/v1/heavy" {
		return "POST /v1/heavy"
	}
	return snapshot.DefaultRoute
}

// do sends one charge and records it.
func (w *worker) do(via, acct, ev, path string, units int64) (cluster.Op, *shard.Receipt) {
	op := cluster.Op{Worker: w.id, Kind: cluster.OpCharge, Via: via, Account: acct, EventID: ev, Generated: ev == "", Units: units}
	var receipt *shard.Receipt
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	op.Start = w.h.hist.Now()
	switch via {
	case "grpc":
		n := w.pickNode()
		if n == nil {
			return op, nil
		}
		rep := w.h.conns.ChargeRouted(ctx, n, &pb.ChargeRequest{Account: acct, EventId: ev, ClientId: ev != "",
			Key: "key-" + acct, Route: routeOf(path), Units: units}, &op)
		receipt = receiptFromPB(rep.GetReceipt())
	case "client", "gateway":
		op.Node = via
		res, err := w.h.embedded(via).Charge(ctx, router.ChargeRequest{Account: acct, EventID: ev, ClientID: ev != "",
			Key: "key-" + acct, Route: routeOf(path), Units: units})
		classifyClient(&op, res.Decision, res.Node, err)
		if err == nil && op.EventID == "" {
			op.EventID = res.EventID
		}
		receipt = res.Receipt
	case "http":
		n := w.pickNode()
		if n == nil {
			return op, nil
		}
		op.Node = n.ID
		w.h.chargeHTTP(ctx, n, path, &op)
	}
	op.End = w.h.hist.Now()
	w.h.hist.Add(op)
	return op, receipt
}

func (w *worker) doRefund(via string, a acked) {
	op := cluster.Op{Worker: w.id, Kind: cluster.OpRefund, Via: via, Account: a.account, EventID: a.event}
	if a.receipt != nil {
		op.Units = a.receipt.Units
	}
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	op.Start = w.h.hist.Now()
	switch via {
	case "client", "gateway":
		op.Node = via
		d, err := w.h.embedded(via).Refund(ctx, router.RefundRequest{Account: a.account, EventID: a.event, Receipt: a.receipt})
		classifyClient(&op, d, "", err)
		if err == nil {
			op.Status = cluster.StatusRefused
			if d.Reason == shard.Refunded {
				op.Status = cluster.StatusOK
			}
		}
	case "grpc":
		n := w.pickNode()
		if n == nil {
			return
		}
		op.Node = n.ID
		req := &pb.RefundBatch{Refunds: []*pb.RefundRequest{{Account: a.account, EventId: a.event, Receipt: receiptToPB(a.receipt)}}}
		rep, err := w.h.refundAt(ctx, n.RPC, req)
		if err == nil && rep.WrongOwner != nil && rep.WrongOwner.OwnerRpc != "" {
			rep, err = w.h.refundAt(ctx, rep.WrongOwner.OwnerRpc, req) // follow the owner once, as a client does
		}
		cluster.ClassifyRefund(&op, rep, err)
	}
	op.End = w.h.hist.Now()
	w.h.hist.Add(op)
}

func (h *harness) refundAt(ctx context.Context, addr string, req *pb.RefundBatch) (*pb.RefundReply, error) {
	cl, err := h.conns.Client(addr)
	if err != nil {
		return nil, err
	}
	rep, err := cl.Refund(ctx, req)
	if err != nil {
		return nil, err
	}
	return rep.Replies[0], nil
}

// classifyClient fills op from the embedded client's answer.
func classifyClient(op *cluster.Op, d shard.Decision, node string, err error) {
	if err != nil {
		op.Status, op.Err = cluster.StatusUnknown, err.Error()
		switch {
		case errors.Is(err, context.DeadlineExceeded):
			op.Reason = "timeout"
		case errors.Is(err, router.ErrUnavailable):
			op.Reason = "unavailable"
		default:
			op.Reason = "error"
		}
		return
	}
	op.Decider, op.Reason, op.Remaining, op.Reset = node, d.Reason.String(), d.Remaining, d.Reset
	op.Status = cluster.StatusRefused
	if d.Reason.Accepted() {
		op.Status = cluster.StatusOK
	}
}

// chargeHTTP sends one request through n's proxy and classifies the answer:
// the upstream's answer (marked by upstreamHeader) means charged, refunded
// by the front when it is a 5xx; a problem names a refusal, or
// quota-unavailable (unknown: an owner that stopped answering may have
// charged); anything else is unknown.
func (h *harness) chargeHTTP(ctx context.Context, n *cluster.Node, path string, op *cluster.Op) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+n.HTTP+path, nil)
	req.Header.Set("Authorization", "Bearer "+h.acct.keys[op.Account])
	req.Header.Set("Idempotency-Key", op.EventID)
	// The front refunds a charge whose upstream failed: maybe this one, if
	// the answer does not come back.
	op.RefundPending = path == "/v1/fail"
	resp, err := h.http.Do(req)
	if err != nil {
		// The front refunds a charge whose client went away: maybe this one.
		op.RefundPending = true
		op.Status, op.Reason, op.Err = cluster.StatusUnknown, "transport", err.Error()
		if ne, ok := errors.Unwrap(err).(net.Error); ok && ne.Timeout() {
			op.Reason = "timeout"
		}
		return
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	op.Remaining, _ = strconv.ParseInt(resp.Header.Get("X-Quota-Remaining"), 10, 64)
	if t, err := time.Parse(time.RFC3339, resp.Header.Get("X-Quota-Reset")); err == nil {
		op.Reset = t.Unix()
	}
	if resp.Header.Get(upstreamHeader) != "" {
		op.Status, op.Reason = cluster.StatusOK, "ok"
		op.RefundPending = resp.StatusCode >= 500
		return
	}
	if resp.StatusCode < 500 {
		op.RefundPending = false // refused: nothing was charged, nothing refunded
	}
	var p struct {
		Type string `json:"type"`
	}
	if ct, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type")); ct == "application/problem+json" {
		json.Unmarshal(body, &p)
	}
	switch kind := p.Type[strings.LastIndex(p.Type, "/")+1:]; kind {
	case "quota-exceeded", "rate-limited", "unknown-key":
		op.Status, op.Reason = cluster.StatusRefused, strings.ReplaceAll(kind, "-", "_")
	case "idempotency-key-reused": // decided by the owner, charged nothing
		op.Status, op.Reason = cluster.StatusRefused, shard.IDReused.String()
	case "idempotency-replay-limit":
		op.Status, op.Reason = cluster.StatusRefused, shard.ReplayLimit.String()
	case "upstream-unavailable":
		op.Status, op.Reason, op.RefundPending = cluster.StatusOK, "ok", true
	default:
		op.Status, op.Reason, op.Err = cluster.StatusUnknown, "http_"+strconv.Itoa(resp.StatusCode), strings.TrimSpace(string(body))
		if kind == "quota-unavailable" {
			op.Reason = "quota_unavailable"
		}
	}
}

func receiptFromPB(r *pb.Receipt) *shard.Receipt {
	if r == nil {
		return nil
	}
	out := &shard.Receipt{EventID: r.EventId, Units: r.Units, Period: shard.Period(r.Period), Wall: r.Wall, Key: r.Key, Route: r.Route}
	for _, a := range r.Allocs {
		out.Allocs = append(out.Allocs, shard.Alloc{Grant: a.Grant, Units: a.Units})
	}
	return out
}

func receiptToPB(r *shard.Receipt) *pb.Receipt {
	if r == nil {
		return nil
	}
	out := &pb.Receipt{EventId: r.EventID, Units: r.Units, Period: int32(r.Period), Wall: r.Wall, Key: r.Key, Route: r.Route}
	for _, a := range r.Allocs {
		out.Allocs = append(out.Allocs, &pb.Alloc{Grant: a.Grant, Units: a.Units})
	}
	return out
}
