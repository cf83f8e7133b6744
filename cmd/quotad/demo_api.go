package main

import (
	"context"
	"crypto/hmac"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/quotaring/quotaring/node"
	"github.com/quotaring/quotaring/router"
)

// The demo's sample upstream: the API the quotad nodes proxy to. It knows
// nothing about quotas; it trusts the two headers the proxy sets
// (X-Quota-Account, X-Quota-Event) and echoes them, so the demo's clients
// can tell its answers from the front's.
//
//	GET  /v1/tasks     list tasks                         1 unit
//	POST /v1/tasks     create a task                      2 units
//	POST /v1/exports   start an export (slower)          10 units
//	GET  /v1/reports   build a report: fails 1 time in 8  5 units, refunded when it fails
//
// It also stands in for the API company's billing system: the nodes POST
// their quota alerts to /hooks/quota, signed with the demo's alert secret,
// and it checks each signature as a receiver would.

const (
	// demoServedBy marks every answer of the sample API: a 2xx without it
	// did not come from the upstream.
	demoServedBy = "X-Demo-Served-By"
	// demoEventHeader echoes the event id the proxy charged.
	demoEventHeader = "X-Demo-Event"
	// demoReportFailEvery: GET /v1/reports answers 500 once in this many.
	demoReportFailEvery = 8
)

// demoRoutes are the route weights the demo puts in the ledger.
var demoRoutes = map[string]int64{
	"GET /v1/tasks":    1,
	"POST /v1/tasks":   2,
	"POST /v1/exports": 10,
	"GET /v1/reports":  5,
}

type demoAPI struct {
	srv    *http.Server
	addr   string
	tasks  atomic.Int64
	served atomic.Int64
	failed atomic.Int64

	// The alert webhook.
	alertSecret string
	events      atomic.Pointer[eventLog] // set once the nodes run; nil: not logged
	badAlerts   atomic.Int64             // webhooks refused: bad signature or body
	mu          sync.Mutex               // protects alerts and created
	alerts      []node.Alert             // every webhook taken, in order
	// created is the task each (account, Idempotency-Key) created: a retry
	// gets the same task, as an API behind quotaring should do (the proxy
	// bills a retry once and still sends it on). The demo runs 30 minutes
	// at most, so it is not bounded.
	created map[string]string
}

// createTask makes a task for r, or finds the one a request with the same
// Idempotency-Key from the same account made (the account as the proxy
// names it, router.HeaderAccount).
func (a *demoAPI) createTask(r *http.Request) string {
	key := r.Header.Get("Idempotency-Key")
	if key == "" {
		return fmt.Sprintf("task-%d", 2+a.tasks.Add(1))
	}
	k := r.Header.Get(router.HeaderAccount) + "\x00" + key
	a.mu.Lock()
	defer a.mu.Unlock()
	id, ok := a.created[k]
	if !ok {
		if a.created == nil {
			a.created = map[string]string{}
		}
		id = fmt.Sprintf("task-%d", 2+a.tasks.Add(1))
		a.created[k] = id
	}
	return id
}

// demoAlertPath is where the nodes POST quota alerts.
const demoAlertPath = "/hooks/quota"

func startDemoAPI() (*demoAPI, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("demo: the sample API cannot listen on 127.0.0.1: %w", err)
	}
	a := &demoAPI{addr: l.Addr().String(), alertSecret: randomHex(32)}
	mux := http.NewServeMux()
	mux.HandleFunc("POST "+demoAlertPath, a.alertHook)
	mux.HandleFunc("GET /v1/tasks", func(w http.ResponseWriter, r *http.Request) {
		a.reply(w, r, http.StatusOK, map[string]any{"tasks": []map[string]any{
			{"id": "task-1", "title": "write the quarterly report", "done": false},
			{"id": "task-2", "title": "renew the certificate", "done": true},
		}})
	})
	mux.HandleFunc("POST /v1/tasks", func(w http.ResponseWriter, r *http.Request) {
		a.reply(w, r, http.StatusCreated, map[string]any{"id": a.createTask(r), "done": false})
	})
	mux.HandleFunc("POST /v1/exports", func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(time.Duration(20+rand.IntN(30)) * time.Millisecond) // heavier work, heavier weight
		a.reply(w, r, http.StatusAccepted, map[string]any{"export": fmt.Sprintf("exp-%d", a.served.Load()), "status": "queued"})
	})
	mux.HandleFunc("GET /v1/reports", func(w http.ResponseWriter, r *http.Request) {
		if rand.IntN(demoReportFailEvery) == 0 {
			a.failed.Add(1)
			a.reply(w, r, http.StatusInternalServerError, map[string]any{"error": "the report generator crashed"})
			return
		}
		a.reply(w, r, http.StatusOK, map[string]any{"report": "usage-by-day", "rows": 31})
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		a.reply(w, r, http.StatusNotFound, map[string]any{"error": "no such endpoint: try GET /v1/tasks"})
	})
	a.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go a.srv.Serve(l)
	return a, nil
}

func (a *demoAPI) reply(w http.ResponseWriter, r *http.Request, code int, body map[string]any) {
	a.served.Add(1)
	body["account"] = r.Header.Get(router.HeaderAccount)
	body["event"] = r.Header.Get(router.HeaderEvent)
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set(demoServedBy, "sample-api")
	h.Set(demoEventHeader, r.Header.Get(router.HeaderEvent))
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(body)
}

// alertHook takes a quota alert: it checks the signature (HMAC-SHA256 of
// the timestamp header, a dot and the body) and the timestamp's age, as the
// README's receiver does, then keeps the alert.
func (a *demoAPI) alertHook(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, 64<<10))
	ts := r.Header.Get(node.AlertTimestampHeader)
	sec, perr := strconv.ParseInt(ts, 10, 64)
	want := node.SignAlert([]byte(a.alertSecret), ts, body)
	var al node.Alert
	switch {
	case err != nil || perr != nil || time.Since(time.Unix(sec, 0)).Abs() > 5*time.Minute ||
		!hmac.Equal([]byte(r.Header.Get(node.AlertSignatureHeader)), []byte(want)):
		a.badAlerts.Add(1)
		http.Error(w, "bad or stale signature", http.StatusUnauthorized)
		return
	case json.Unmarshal(body, &al) != nil:
		a.badAlerts.Add(1)
		http.Error(w, "not an alert", http.StatusBadRequest)
		return
	}
	a.mu.Lock()
	a.alerts = append(a.alerts, al)
	a.mu.Unlock()
	if ev := a.events.Load(); ev != nil {
		ev.add("alert webhook: %s reached %d %% of its %s quota (%d of %d units); signature checked",
			al.Account, al.Threshold, al.Period, al.Used, al.Limit)
	}
	w.WriteHeader(http.StatusNoContent)
}

// receivedAlerts is every alert the webhook took.
func (a *demoAPI) receivedAlerts() []node.Alert {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.alerts)
}

func (a *demoAPI) Close() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	a.srv.Shutdown(ctx)
}
