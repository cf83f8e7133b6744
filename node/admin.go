package node

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/pprof"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// adminHandler serves the admin port: liveness, readiness, metrics, pprof,
// and (behind TestFaults) fault injection.
func (n *Node) adminHandler() *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		// Liveness: the process answers. Never depends on Postgres.
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", n.readyz)
	mux.HandleFunc("GET /status", n.statusPage) // status.go
	mux.Handle("GET /metrics", promhttp.HandlerFor(n.reg, promhttp.HandlerOpts{Registry: n.reg}))
	// Profiles and fault injection take the admin token when the node has
	// one (debugAuth): a profile shows the code's hot paths and a trace
	// costs CPU while it runs.
	mux.Handle("GET /debug/pprof/", n.debugAuth(boundSeconds(pprof.Index))) // NB: a named profile takes ?seconds= too (a delta)
	// NB: no /debug/pprof/cmdline: the command line may hold --admin-token,
	// --alert-secret or a DSN with a password.
	mux.HandleFunc("GET /debug/pprof/cmdline", http.NotFound)
	mux.Handle("GET /debug/pprof/profile", n.debugAuth(boundSeconds(pprof.Profile)))
	mux.Handle("GET /debug/pprof/symbol", n.debugAuth(http.HandlerFunc(pprof.Symbol)))
	mux.Handle("GET /debug/pprof/trace", n.debugAuth(boundSeconds(pprof.Trace)))
	n.adminAPI(mux) // /admin/v1/ (adminapi.go)
	if n.cfg.TestFaults {
		mux.Handle("POST /test/block", n.debugAuth(http.HandlerFunc(n.testBlock)))
		mux.Handle("POST /test/heal", n.debugAuth(http.HandlerFunc(n.testHeal)))
		mux.Handle("POST /test/clock", n.debugAuth(http.HandlerFunc(n.testClock)))
		mux.Handle("POST /test/crash-after-commit", n.debugAuth(http.HandlerFunc(n.testCrashAfterCommit)))
	}
	return mux
}

// debugAuth asks for the admin token (Authorization: Bearer, as the admin
// API) on /debug/pprof/ and /test/... when the node has one; a node
// without --admin-token serves them to whoever reaches its admin port.
func (n *Node) debugAuth(h http.Handler) http.Handler {
	if n.cfg.AdminToken == "" {
		return h
	}
	return n.adminAuth(h)
}

// MaxProfileSeconds bounds ?seconds= of /debug/pprof/profile,
// /debug/pprof/trace and a named profile's delta (/debug/pprof/heap?seconds=):
// a trace slows the node while it runs, only one CPU profile runs at a
// time, and each holds a goroutine and a connection for as long.
const MaxProfileSeconds = 300

// boundSeconds refuses ?seconds= past MaxProfileSeconds, or not a whole
// number of seconds, before h starts profiling.
func boundSeconds(h http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if v := r.URL.Query().Get("seconds"); v != "" {
			if s, err := strconv.Atoi(v); err != nil || s < 1 || s > MaxProfileSeconds {
				writeProblem(w, r, &adminProblem{Status: http.StatusBadRequest, Type: "invalid-request",
					Detail: fmt.Sprintf("seconds=%q: want a whole number of seconds from 1 to %d", v, MaxProfileSeconds)})
				return
			}
		}
		h(w, r)
	})
}

// readyz: the ring is joined and this node serves, its state is loaded, it
// has a config snapshot, and a majority of the serving peers do not refuse
// the calls it forwards (forwardauth.go). The ledger being down does not make it unready
// (G8): it serves from memory, its log and its reservations.
func (n *Node) readyz(w http.ResponseWriter, _ *http.Request) {
	var why []string
	if !n.ready.Load() {
		why = append(why, "starting")
	}
	if n.draining.Load() {
		why = append(why, "draining")
	}
	if n.ready.Load() && !n.draining.Load() {
		if w := n.notServable(); w != "" {
			why = append(why, "not taking accounts: "+w)
		}
		if n.isServing() {
			// NB: it keeps its accounts (the ring is right); its
			// forwards fail (forwardauth.go).
			if w := n.forwardRefusal(); w != "" {
				why = append(why, "its forwarded charges are refused: "+w)
			}
		}
	} else if n.eng != nil && n.eng.Snapshot() == nil {
		why = append(why, "no config snapshot yet (the ledger has not been reached and the data dir keeps none)")
	}
	if len(why) > 0 {
		http.Error(w, "not ready: "+strings.Join(why, "; "), http.StatusServiceUnavailable)
		return
	}
	fmt.Fprintln(w, "ready")
}

// testBlock cuts this node's traffic (gossip and RPC) to the given
// addresses: ?gossip=host:port,...&rpc=host:port,...
func (n *Node) testBlock(w http.ResponseWriter, r *http.Request) {
	for _, a := range splitList(r.URL.Query().Get("gossip")) {
		if err := n.gossipF.Block(a); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
	}
	n.faults.Block(splitList(r.URL.Query().Get("rpc"))...)
	fmt.Fprintln(w, "blocked")
}

func (n *Node) testHeal(w http.ResponseWriter, _ *http.Request) {
	n.gossipF.UnblockAll()
	n.faults.Unblock()
	fmt.Fprintln(w, "healed")
}

// testClock shifts the system clock: ?offset=-36h (chaos clock faults).
func (n *Node) testClock(w http.ResponseWriter, r *http.Request) {
	d, err := time.ParseDuration(r.URL.Query().Get("offset"))
	if err != nil || n.sys == nil {
		http.Error(w, "want ?offset=DURATION on a node with the system clock", http.StatusBadRequest)
		return
	}
	n.sys.SetOffset(d)
	// wall: the time the node bills by, which holds through a step
	// (SteadyClock) until the ledger's clock confirms it.
	json.NewEncoder(w).Encode(map[string]any{"offset": d.String(), "system": time.Unix(0, n.sys.Now().Wall).UTC(),
		"wall": time.Unix(0, n.clock.Now().Wall).UTC()})
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// testCrashAfterCommit arms a failpoint: the next settle kills this process
// with SIGKILL after the ledger committed and before the local mark.
func (n *Node) testCrashAfterCommit(w http.ResponseWriter, _ *http.Request) {
	n.crashAfterCommit.Store(true)
	fmt.Fprintln(w, "armed")
}

// afterCommitFailpoint is the settler's AfterCommit hook.
func (n *Node) afterCommitFailpoint() {
	if n.crashAfterCommit.Load() {
		n.log.Warn("test failpoint: SIGKILL between the ledger commit and the local mark")
		syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // the signal is on its way
	}
}
