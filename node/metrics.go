package node

import (
	"crypto/tls"
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
)

// metrics are the node's Prometheus metrics, on its own registry (several
// nodes run in one process in tests and the demo). The names are listed in
// deploy/metrics.txt, which the dashboard and the alert rules are checked
// against.
type metrics struct {
	charges        *prometheus.CounterVec
	chargeSeconds  prometheus.Histogram
	commitSeconds  prometheus.Histogram
	commitRecords  prometheus.Histogram
	settleSeconds  prometheus.Histogram
	settleRecords  prometheus.Histogram
	ringChanges    prometheus.Counter
	reconcileDiffs prometheus.Gauge
	// reconcileErrors and reconcileLast: the periodic reconcile's failures
	// and last success, so that one that keeps failing (a slow ledger that
	// times it out) is seen rather than leaving an old count standing.
	reconcileErrors prometheus.Counter
	reconcileLast   prometheus.Gauge
	// reservationsStranded is the reservation audit's finding (audit.go).
	reservationsStranded prometheus.Gauge
	// HTTPRequests and ProxySeconds are the HTTP front's (router).
	HTTPRequests *prometheus.CounterVec
	ProxySeconds prometheus.Histogram
}

// newMetrics makes the metrics; the gauges read the node's parts when
// scraped, so they may be registered before those parts exist.
// certExpiry is quotaring_tls_certificate_expiry_timestamp_seconds of a
// port: when the certificate it presents now stops being valid (renewed
// files are read at the scrape), 0 when the port has no TLS.
func certExpiry(port string, cfg func() *tls.Config) prometheus.Collector {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "quotaring_tls_certificate_expiry_timestamp_seconds",
		Help:        "Unix time at which the certificate the port presents expires (port rpc: --rpc-tls-cert, http: --http-tls-cert, admin: --admin-tls-cert), read again when renewed; 0 when the port serves no TLS.",
		ConstLabels: prometheus.Labels{"port": port}}, func() float64 {
		if t, ok := router.CertNotAfter(cfg()); ok {
			return float64(t.Unix())
		}
		return 0
	})
}

func newMetrics(n *Node) *metrics {
	m := &metrics{
		charges: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "quotaring_charges_total",
			Help: "Charges answered by this node as the owner, by result (ok, replayed, refused) and reason."}, []string{"result", "reason"}),
		chargeSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "quotaring_charge_duration_seconds",
			Help: "Time to decide a charge and make it durable.", Buckets: prometheus.ExponentialBuckets(20e-6, 2, 16)}),
		commitSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "quotaring_log_commit_duration_seconds",
			Help: "Time of one log commit (with fsync unless --wal-sync=false).", Buckets: prometheus.ExponentialBuckets(20e-6, 2, 16)}),
		commitRecords: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "quotaring_log_commit_records",
			Help: "Records per log commit (group commit).", Buckets: prometheus.ExponentialBuckets(1, 4, 10)}),
		settleSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "quotaring_settle_duration_seconds",
			Help: "Time of one settle transaction.", Buckets: prometheus.ExponentialBuckets(0.001, 2, 14)}),
		settleRecords: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "quotaring_settle_batch_records",
			Help: "Records per settle batch.", Buckets: prometheus.ExponentialBuckets(1, 4, 10)}),
		ringChanges: prometheus.NewCounter(prometheus.CounterOpts{Name: "quotaring_ring_changes_total", Help: "Ownership changes this node saw."}),
		reservationsStranded: prometheus.NewGauge(prometheus.GaugeOpts{Name: "quotaring_reservations_stranded_units",
			Help: "Units the ledger reserved for this node, in two reservation audits in a row, on accounts it neither owns nor holds an allowance of, beyond its units in doubt: spendable by nobody until it stops or starts (quotad admin reservations names them). Above 0 is a bug to report."}),
		reconcileDiffs: prometheus.NewGauge(prometheus.GaugeOpts{Name: "quotaring_reconcile_differences",
			Help: "Differences between the ledger's counters and its event log at the last periodic reconcile (quotad reconcile names them)."}),
		reconcileErrors: prometheus.NewCounter(prometheus.CounterOpts{Name: "quotaring_reconcile_errors_total",
			Help: "Periodic reconciles that failed (the ledger unreachable, or slower than half the interval)."}),
		reconcileLast: prometheus.NewGauge(prometheus.GaugeOpts{Name: "quotaring_reconcile_last_success_timestamp_seconds",
			Help: "Unix time of this node's last successful periodic reconcile; 0 when it has run none (one node of the ring runs them)."}),
		HTTPRequests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "quotaring_http_requests_total",
			Help: "Requests answered by the HTTP front, by status code."}, []string{"code"}),
		ProxySeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "quotaring_proxy_duration_seconds",
			Help: "Time the HTTP front adds to a request (everything but the upstream).", Buckets: prometheus.ExponentialBuckets(20e-6, 2, 16)}),
	}
	// Zero series for the labels dashboards and alerts expect, before the
	// first charge or request.
	for _, rr := range [][2]string{{"ok", "ok"}, {"replayed", "replayed"}, {"refused", "rate_limited"}, {"refused", "quota_exceeded"},
		{"refused", "unknown_account"}, {"refused", "unavailable"}} {
		m.charges.WithLabelValues(rr[0], rr[1])
	}
	for _, code := range []string{"200", "429", "503"} {
		m.HTTPRequests.WithLabelValues(code)
	}
	counter := func(name, help string, f func() float64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, f)
	}
	gauge := func(name, help string, f func() float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, f)
	}
	engStat := func(f func(*engine.Stats) int64) func() float64 {
		return func() float64 {
			if n.eng == nil {
				return 0
			}
			return float64(f(n.eng.Stats()))
		}
	}
	settleStat := func(f func(*flush.SettlerStats) int64) func() float64 {
		return func() float64 {
			if s := n.Settler(); s != nil {
				return float64(f(s.Stats()))
			}
			return 0
		}
	}
	routerStat := func(f func(*routerStats) int64) func() float64 {
		return func() float64 {
			if n.router == nil {
				return 0
			}
			return float64(f(n.router.Stats()))
		}
	}
	n.reg.MustRegister(
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		m.charges, m.chargeSeconds, m.commitSeconds, m.commitRecords, m.settleSeconds, m.settleRecords,
		m.ringChanges, m.reconcileDiffs, m.reconcileErrors, m.reconcileLast, m.reservationsStranded, m.HTTPRequests, m.ProxySeconds,
		counter("quotaring_refunds_total", "Refunds applied.", engStat(func(s *engine.Stats) int64 { return s.Refunds.Load() })),
		counter("quotaring_reservation_requests_total", "Reservation round trips to the ledger.", engStat(func(s *engine.Stats) int64 { return s.Reservations.Load() })),
		counter("quotaring_reservation_errors_total", "Reservation round trips that failed.", engStat(func(s *engine.Stats) int64 { return s.ReserveErrors.Load() })),
		counter("quotaring_reservation_timeouts_total", "Reservation and release calls given up for a ledger that did not answer: a background top-up or release retry after --ledger-timeout, a charge's reservation after 2 s. A reserve cancelled after it committed leaves its units reserved for this node until its next start or stop.",
			engStat(func(s *engine.Stats) int64 { return s.ReserveTimeouts.Load() })),
		counter("quotaring_settle_errors_total", "Settles that failed (retried with backoff).", settleStat(func(s *flush.SettlerStats) int64 { return s.Errors.Load() })),
		counter("quotaring_duplicate_events_total", "Charges found already billed at settle (a retry that reached a new owner, or an Idempotency-Key used again after its 24 hours at an owner that got the account after its earlier use) and not billed again.",
			settleStat(func(s *flush.SettlerStats) int64 { return s.Duplicates.Load() })),
		counter("quotaring_unbilled_replays_total", "Retries answered Replayed after their charge had been refunded through another owner that the ledger did not bill again, since the account's hard limit had no units free for them: served for free, in the customer's favour, rather than over the limit.",
			settleStat(func(s *flush.SettlerStats) int64 { return s.UnbilledReplays.Load() })),
		counter("quotaring_duplicate_refunds_total", "Refunds found already applied at settle.", settleStat(func(s *flush.SettlerStats) int64 { return s.DuplicateRefunds.Load() })),
		counter("quotaring_forwarded_total", "Calls forwarded to another owner.", routerStat(func(s *routerStats) int64 { return s.Forwarded.Load() })),
		counter("quotaring_wrong_owner_total", "WrongOwner answers received.", routerStat(func(s *routerStats) int64 { return s.WrongOwner.Load() })),
		counter("quotaring_forward_errors_total", "Forwarded calls that failed.", routerStat(func(s *routerStats) int64 { return s.ForwardErrors.Load() })),
		counter("quotaring_forward_refused_total", "Forwarded calls the node called turned away for this node's RPC token or certificate (among the forward errors): the nodes' --rpc-token or --rpc-tls-* differ.",
			routerStat(func(s *routerStats) int64 { return s.Refused.Load() })),
		counter("quotaring_rpc_refused_total", "Calls to this node's RPC port refused for a missing or wrong RPC token (--rpc-token), from nodes or embedded clients.",
			func() float64 { return float64(n.rpcRefusedCalls.Load()) }),
		counter("quotaring_rpc_handshakes_refused_total", "TLS handshakes this node's RPC port failed (--rpc-tls-*): a caller with a certificate of another CA, none, or no TLS; connections closed before a word are not counted.",
			func() float64 { return float64(n.rpcHandshakeFailures.Load()) }),
		gauge("quotaring_unsettled_records", "Records in the log not yet settled.", func() float64 {
			if n.wal == nil {
				return 0
			}
			return float64(n.wal.DurableSeq() - n.wal.SettledSeq())
		}),
		gauge("quotaring_unsettled_bytes", "Bytes of the records not yet settled (estimate).", func() float64 {
			if n.wal == nil {
				return 0
			}
			return float64(n.wal.Stats().Bytes)
		}),
		gauge("quotaring_settle_lag_seconds", "Seconds since the last successful settle (since start if none).", func() float64 {
			last := n.started
			if s := n.Settler(); s != nil && !s.LastSuccess().IsZero() {
				last = s.LastSuccess()
			}
			if n.wal != nil && n.wal.DurableSeq() == n.wal.SettledSeq() {
				return 0 // nothing waits
			}
			return time.Since(last).Seconds()
		}),
		gauge("quotaring_config_snapshot_age_seconds", "Seconds since this node last read its config snapshot (plans, accounts, keys, route weights) from the ledger, every --snapshot-interval (3 s); before its first read, since an earlier process on its data dir last read it (kept there once a minute), or since start. Changes made since are not enforced by this node.",
			func() float64 {
				last := n.configRead()
				if last.IsZero() {
					last = n.started
				}
				return time.Since(last).Seconds()
			}),
		gauge("quotaring_clock_offset_seconds", "The clock this node bills by minus the ledger's (the Postgres server's) at the last check, every 15 s: each node decides the month from its own.",
			func() float64 { return time.Duration(n.clockOffset.Load()).Seconds() }),
		gauge("quotaring_clock_max_offset_seconds", "This node's clock tolerance (--max-clock-offset): past it the node warns about its offset from the ledger's clock, holds against a step, or takes the ledger's time. The alert rules compare the offset with it.",
			func() float64 { return n.cfg.MaxClockOffset.Seconds() }),
		gauge("quotaring_clock_step_seconds", "How far this node's system clock stands from the time the node bills by: its time before a step, or the ledger's when the other nodes side with the ledger, counted on by the monotonic clock until the system clock agrees with the ledger's again; 0 while the node follows the system clock.",
			func() float64 { return time.Duration(n.clockStep.Load()).Seconds() }),
		counter("quotaring_pauses_total", "Pauses of this process (SIGSTOP, a frozen VM, a suspended machine, a stall; or its wall clock stepped forward) longer than half the gossip failure timeout that it noticed; after each it decided nothing until a peer confirmed its ring view.",
			func() float64 {
				if n.pause == nil {
					return 0
				}
				return float64(n.pause.count.Load())
			}),
		gauge("quotaring_pause_holding", "1 while this node, back from a pause, decides nothing (answers quota-unavailable) until a peer confirms its ring view; else 0.",
			func() float64 {
				if n.pause != nil && n.pause.holding.Load() {
					return 1
				}
				return 0
			}),
		gauge("quotaring_reservations_held_units", "Units this node holds reserved in the ledger and has not spent.", func() float64 {
			if n.eng == nil {
				return 0
			}
			return float64(n.eng.AllowanceHeld())
		}),
		gauge("quotaring_reservations_uncertain_units", "The most units the ledger may hold reserved for this node beyond quotaring_reservations_held_units: reservations whose commit was cut off (outcome unknown), hand-backs of units it could not use that the ledger refused, and refunds logged by older versions taken back from its allowance whose credit in the ledger is not known (a settle whose answer was lost, a duplicate refund taken back after a hand-back). Nobody can spend them until this node's next start or stop frees them (or quotad revoke).", func() float64 {
			if n.eng == nil {
				return 0
			}
			return float64(n.eng.Stats().UncertainUnits.Load())
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "quotaring_build_info",
			Help:        "Always 1; its labels say which build of quotad runs this node (quotad version): compare them across nodes during a rolling upgrade.",
			ConstLabels: prometheus.Labels{"version": n.build.Short(), "revision": n.build.Revision, "goversion": n.build.GoVersion}},
			func() float64 { return 1 }),
		gauge("quotaring_ledger_up", "1 when the ledger has been reached, the last settle and the last heartbeat (every 2 s) succeeded, and no call to the ledger has waited --ledger-timeout for its answer.", func() float64 {
			if s := n.Settler(); s != nil && s.Healthy() {
				return 1
			}
			return 0
		}),
		// One series per port, 0 without TLS there: an RPC certificate
		// that expired went unnoticed (connections open keep working), until
		// a restarted node could not join.
		certExpiry("rpc", func() *tls.Config { return n.rpcTLS.server }),
		certExpiry("http", func() *tls.Config { return n.httpTLS }),
		certExpiry("admin", func() *tls.Config { return n.adminTLS }),
		gauge("quotaring_ready", "1 when /readyz answers 200.", func() float64 {
			if n.Ready() {
				return 1
			}
			return 0
		}),
		gauge("quotaring_ring_epoch", "The ring epoch this node sees (a name, not ordered; low 52 bits).", func() float64 {
			if r := n.Ring(); r != nil {
				return float64(r.Epoch() & (1<<52 - 1))
			}
			return 0
		}),
		gauge("quotaring_owned_partitions", "Partitions this node owns.", func() float64 {
			if r := n.Ring(); r != nil {
				return float64(len(r.Table().PartitionsOf(n.cfg.ID)))
			}
			return 0
		}),
		ringMembers{n: n, desc: prometheus.NewDesc("quotaring_ring_members", "Alive members by state.", []string{"state"}, nil)},
		ringMismatches{n: n, desc: prometheus.NewDesc("quotaring_ring_mismatched_members",
			"Alive members whose node meta disagrees with this node's config, by what: preset (another --ring-preset: failure detection mistimed), layout (another partition count, replication or load), meta (unreadable). Each is named in an ERROR line.",
			[]string{"reason"}, nil)},
	)
	return m
}

// ringMembers exports quotaring_ring_members{state}.
type ringMembers struct {
	n    *Node
	desc *prometheus.Desc
}

func (c ringMembers) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c ringMembers) Collect(ch chan<- prometheus.Metric) {
	counts := map[ring.State]int{ring.StateJoining: 0, ring.StateServing: 0, ring.StateDraining: 0}
	if r := c.n.Ring(); r != nil {
		for _, m := range r.View().Members {
			counts[m.State]++
		}
	}
	for st, k := range counts {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(k), string(st))
	}
}

// ringMismatches exports quotaring_ring_mismatched_members{reason}, every
// reason present (0 when none) so that alerts can compare.
type ringMismatches struct {
	n    *Node
	desc *prometheus.Desc
}

func (c ringMismatches) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c ringMismatches) Collect(ch chan<- prometheus.Metric) {
	counts := map[ring.MismatchReason]int{}
	if r := c.n.Ring(); r != nil {
		for _, mm := range r.Mismatches() {
			counts[mm.Reason]++
		}
	}
	for _, reason := range ring.MismatchReasons() {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(counts[reason]), string(reason))
	}
}

func (m *metrics) onCharge(_ string, d *shard.Decision, err error, took time.Duration) {
	switch {
	case err != nil && errors.Is(err, engine.ErrQuotaUnavailable):
		m.charges.WithLabelValues("refused", "unavailable").Inc()
		return
	case err != nil:
		return
	case d.Reason == shard.OK:
		m.charges.WithLabelValues("ok", "ok").Inc()
	case d.Reason == shard.Replayed:
		m.charges.WithLabelValues("replayed", "replayed").Inc()
	default:
		m.charges.WithLabelValues("refused", d.Reason.String()).Inc()
	}
	m.chargeSeconds.Observe(took.Seconds())
}

func (m *metrics) onCommit(records, _ int, took time.Duration) {
	m.commitSeconds.Observe(took.Seconds())
	m.commitRecords.Observe(float64(records))
}

func (m *metrics) onSettle(r flush.SettleReport) {
	if r.Err == nil {
		m.settleSeconds.Observe(r.Took.Seconds())
		m.settleRecords.Observe(float64(r.Records))
	}
}

func (m *metrics) ringChange(ring.Change) { m.ringChanges.Inc() }

type routerStats = router.Stats
