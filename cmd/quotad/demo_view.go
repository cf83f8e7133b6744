package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/term"

	"github.com/quotaring/quotaring/internal/cluster"
	"github.com/quotaring/quotaring/node"
	"github.com/quotaring/quotaring/ring"
)

// eventLog is the demo's story as it happens: kills, restarts, ownership
// moves, the first refusal of each kind. In plain mode every event is
// printed at once; the live view shows the latest ones.
type eventLog struct {
	mu    sync.Mutex // protects lines and start
	start time.Time
	lines []string
	plain io.Writer // nil in live mode
}

func (e *eventLog) add(format string, args ...any) {
	e.mu.Lock()
	defer e.mu.Unlock()
	line := fmt.Sprintf("t=%5.1fs  ", time.Since(e.start).Seconds()) + fmt.Sprintf(format, args...)
	e.lines = append(e.lines, line)
	if e.plain != nil {
		fmt.Fprintln(e.plain, "   "+line)
	}
}

func (e *eventLog) last(n int) []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.lines) > n {
		return slices.Clone(e.lines[len(e.lines)-n:])
	}
	return slices.Clone(e.lines)
}

// mono accumulates a counter across process restarts (a restarted node's
// counters start at zero again).
type mono struct{ base, last float64 }

func (m *mono) set(v float64) {
	if v < m.last {
		m.base += m.last
	}
	m.last = v
}

func (m *mono) total() float64 { return m.base + m.last }

// nodeStat is what the monitor knows of one node from its /metrics.
type nodeStat struct {
	ok, refused, forwarded, settles, duplicates mono
	prevOK, prevRefused                         float64
	prevAt                                      time.Time
	okPS, refusedPS                             float64
	unsettled, reserved, settleRecords          float64
	scraped                                     bool // the last scrape answered
}

// monitor samples the cluster once a second: each node's metrics and the
// ring as a running node sees it.
type monitor struct {
	c      *cluster.Cluster
	cs     []*customer
	tr     *traffic
	events *eventLog

	mu     sync.Mutex // protects everything below
	nodes  []nodeStat
	owners map[string]string // account -> owner, in the reference view
	shares map[string]int    // node -> partitions
	states map[string]string // node -> state in the reference view
	refID  string            // whose view
	phase  string
	killed string // the node killed with SIGKILL and not restarted yet ("": none)
	// average: show charges and refusals per second averaged over this
	// many seconds (the final view) instead of the last second's.
	average float64
}

func newMonitor(c *cluster.Cluster, cs []*customer, tr *traffic, events *eventLog) *monitor {
	return &monitor{c: c, cs: cs, tr: tr, events: events, nodes: make([]nodeStat, len(c.Nodes)),
		owners: map[string]string{}, shares: map[string]int{}, states: map[string]string{}}
}

// setKilled names the node killed with SIGKILL, or "" once it restarted.
func (m *monitor) setKilled(id string) {
	m.mu.Lock()
	m.killed = id
	m.mu.Unlock()
}

func (m *monitor) setPhase(format string, args ...any) {
	m.mu.Lock()
	m.phase = fmt.Sprintf(format, args...)
	m.mu.Unlock()
}

// tick samples everything once.
func (m *monitor) tick(ctx context.Context) {
	var wg sync.WaitGroup
	metrics := make([]map[string]float64, len(m.c.Nodes))
	for i, n := range m.c.Nodes {
		if !n.Running() {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			metrics[i] = scrapeMetrics(ctx, n)
		}()
	}
	owners, shares, states, ref := m.ringNow(ctx)
	wg.Wait()

	now := time.Now()
	m.mu.Lock()
	defer m.mu.Unlock()
	for i := range m.nodes {
		s := &m.nodes[i]
		mt := metrics[i]
		s.scraped = mt != nil
		if mt == nil {
			s.okPS, s.refusedPS = 0, 0
			continue
		}
		s.ok.set(mt["ok"])
		s.refused.set(mt["refused"])
		s.forwarded.set(mt["quotaring_forwarded_total"])
		s.settles.set(mt["quotaring_settle_duration_seconds_count"])
		s.duplicates.set(mt["quotaring_duplicate_events_total"])
		s.unsettled, s.reserved = mt["quotaring_unsettled_records"], mt["quotaring_reservations_held_units"]
		s.settleRecords = mt["quotaring_settle_batch_records_sum"]
		if !s.prevAt.IsZero() {
			dt := now.Sub(s.prevAt).Seconds()
			s.okPS = max(0, s.ok.total()-s.prevOK) / dt
			s.refusedPS = max(0, s.refused.total()-s.prevRefused) / dt
		}
		s.prevOK, s.prevRefused, s.prevAt = s.ok.total(), s.refused.total(), now
	}
	if ref == "" {
		return // no node answered: keep the last view
	}
	var moved []string
	for _, c := range m.cs {
		was, is := m.owners[c.ID], owners[c.ID]
		if was != "" && is != "" && was != is {
			moved = append(moved, fmt.Sprintf("%s %s→%s", c.ID, was, is))
		}
	}
	if len(moved) > 0 {
		m.events.add("ownership moved (as %s sees the ring): %s", ref, strings.Join(moved, ", "))
	}
	m.owners, m.shares, m.states, m.refID = owners, shares, states, ref
}

// ringNow reads the ring from the first running node that answers.
func (m *monitor) ringNow(ctx context.Context) (owners map[string]string, shares map[string]int, states map[string]string, ref string) {
	for _, n := range m.c.Nodes {
		if !n.Running() {
			continue
		}
		v, err := n.RingView(ctx)
		if err != nil {
			continue
		}
		owners, shares, states = map[string]string{}, map[string]int{}, map[string]string{}
		for _, mb := range v.Members {
			states[mb.Id] = mb.State
		}
		for _, o := range v.Owners {
			if o >= 0 && int(o) < len(v.Members) {
				shares[v.Members[o].Id]++
			}
		}
		layout := ring.Layout{PartitionCount: int(v.PartitionCount)}
		for _, c := range m.cs {
			if p := layout.Partition(c.ID); p < len(v.Owners) && v.Owners[p] >= 0 && int(v.Owners[p]) < len(v.Members) {
				owners[c.ID] = v.Members[v.Owners[p]].Id
			}
		}
		return owners, shares, states, n.ID
	}
	return nil, nil, nil, ""
}

// ownedBy lists the demo accounts a node owns in the last view.
func (m *monitor) ownedBy(id string) []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	for _, c := range m.cs {
		if m.owners[c.ID] == id {
			out = append(out, c.ID)
		}
	}
	return out
}

func (m *monitor) node(i int) nodeStat {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.nodes[i]
}

// scrapeMetrics reads the quotaring_ series of a node's /metrics, summing
// over labels, with quotaring_charges_total split into "ok" and "refused".
func scrapeMetrics(ctx context.Context, n *cluster.Node) map[string]float64 {
	ctx, cancel := context.WithTimeout(ctx, 900*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+n.Admin+"/metrics", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil
	}
	return parseMetrics(resp.Body)
}

// parseMetrics reads the quotaring_ series of a /metrics text, summing over
// labels, with quotaring_charges_total split into "ok" and "refused"
// (decided refusals).
func parseMetrics(r io.Reader) map[string]float64 {
	out := map[string]float64{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "quotaring_") {
			continue
		}
		sp := strings.LastIndexByte(line, ' ')
		if sp < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[sp+1:], 64)
		if err != nil {
			continue
		}
		name, labels := line[:sp], ""
		if b := strings.IndexByte(name, '{'); b >= 0 {
			name, labels = name[:b], name[b:]
		}
		out[name] += v
		if name == "quotaring_charges_total" {
			switch {
			case strings.Contains(labels, `result="ok"`):
				out["ok"] += v
			case strings.Contains(labels, `result="refused"`) && !strings.Contains(labels, `reason="unavailable"`):
				// Decided refusals only, as the status page counts them:
				// a charge answered quota-unavailable was decided by nobody
				// (the accounts' UNAVAIL column counts those).
				out["refused"] += v
			}
		}
	}
	return out
}

// terminalWidth reports whether w is a terminal, and its width.
func terminalWidth(w io.Writer) (bool, int) {
	if !isTerminal(w) { // bench.go
		return false, 0
	}
	f := w.(*os.File)
	width, _, err := term.GetSize(int(f.Fd()))
	if err != nil || width <= 0 {
		width = 100
	}
	return true, width
}

// ANSI styles, used only on a terminal.
type style struct{ on bool }

func (s style) wrap(code, text string) string {
	if !s.on || text == "" {
		return text
	}
	return "\x1b[" + code + "m" + text + "\x1b[0m"
}
func (s style) bold(t string) string   { return s.wrap("1", t) }
func (s style) dim(t string) string    { return s.wrap("2", t) }
func (s style) red(t string) string    { return s.wrap("31", t) }
func (s style) green(t string) string  { return s.wrap("32", t) }
func (s style) yellow(t string) string { return s.wrap("33", t) }
func (s style) purple(t string) string { return s.wrap("35", t) }

// pad pads s (which may hold ANSI codes) to n visible columns.
func pad(s string, n int) string {
	if v := visible(s); v < n {
		return s + strings.Repeat(" ", n-v)
	}
	return s
}

func padLeft(s string, n int) string {
	if v := visible(s); v < n {
		return strings.Repeat(" ", n-v) + s
	}
	return s
}

func visible(s string) int {
	n, esc := 0, false
	for _, r := range s {
		switch {
		case esc:
			if r == 'm' {
				esc = false
			}
		case r == '\x1b':
			esc = true
		default:
			n++
		}
	}
	return n
}

// bar draws used of limit in width cells.
func bar(st style, used, limit int64, hard bool, width int) string {
	if limit <= 0 {
		return st.dim(strings.Repeat("░", width))
	}
	frac := float64(used) / float64(limit)
	full := min(width, int(frac*float64(width)+0.5))
	if used > 0 && full == 0 {
		full = 1
	}
	b := strings.Repeat("█", full)
	rest := st.dim(strings.Repeat("░", width-full))
	switch {
	case used > limit:
		b = st.purple(b) // soft plan past its quota: overage
	case used >= limit || hard && frac >= 0.99:
		b = st.red(b)
	case frac >= 0.8:
		b = st.yellow(b)
	default:
		b = st.green(b)
	}
	return b + rest
}

func count(st style, v int64, color func(string) string) string {
	if v == 0 {
		return st.dim("0")
	}
	return color(fmt.Sprint(v))
}

// frame renders the view: nodes, accounts, the latest events. elapsed is
// the traffic's time so far.
func (m *monitor) frame(st style, header []string, elapsed, total time.Duration, footer []string, events, width int) []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	out = append(out, header...)
	phase := m.phase
	if phase != "" {
		phase = "  " + st.bold(phase)
	}
	out = append(out, fmt.Sprintf("%s  t=%.0fs of %.0fs%s", st.bold("quotaring demo"), elapsed.Seconds(), total.Seconds(), phase), "")
	out = append(out, st.bold(fmt.Sprintf("%-4s %-8s %-12s %-26s %9s %9s %9s %9s %8s", "NODE", "STATE", "PARTITIONS", "DEMO ACCOUNTS", "CHARGES/S", "REFUSED/S", "FORWARDED", "UNSETTLED", "RESERVED")))
	total1021 := 0
	for _, k := range m.shares {
		total1021 += k
	}
	for i, n := range m.c.Nodes {
		s := m.nodes[i]
		state := m.states[n.ID]
		switch {
		case !n.Running() && n.ID == m.killed:
			out = append(out, fmt.Sprintf("%-4s %s", n.ID, st.red("DOWN (killed with SIGKILL; its data dir waits for a restart)")))
			continue
		case !n.Running():
			out = append(out, fmt.Sprintf("%-4s %s", n.ID, st.yellow("stopped")))
			continue
		case state == "":
			state = "joining"
		}
		stateS := state
		if state == "serving" {
			stateS = st.green(state)
		} else {
			stateS = st.yellow(state)
		}
		part := "-"
		if k := m.shares[n.ID]; k > 0 && total1021 > 0 {
			part = fmt.Sprintf("%4d %5.1f%%", k, 100*float64(k)/float64(total1021))
		}
		var accts []string
		for _, c := range m.cs {
			if m.owners[c.ID] == n.ID && !c.hand {
				accts = append(accts, c.ID)
			}
		}
		okPS, refusedPS := s.okPS, s.refusedPS
		if m.average > 0 {
			okPS, refusedPS = s.ok.total()/m.average, s.refused.total()/m.average
		}
		unsettled := fmt.Sprintf("%.0f", s.unsettled)
		if !s.scraped {
			unsettled = "?"
		}
		out = append(out, fmt.Sprintf("%-4s %s %-12s %-26s %9.1f %9.1f %9s %9s %8.0f", n.ID, pad(stateS, 8), part,
			truncate(strings.Join(accts, " "), 26), okPS, refusedPS, node.Thousands(int64(s.forwarded.total())), unsettled, s.reserved))
	}
	out = append(out, "")
	out = append(out, st.bold(fmt.Sprintf("%-9s %-13s %-5s %-22s %13s %6s %7s %7s %7s %7s %6s", "ACCOUNT", "PLAN", "OWNER", "UNITS TOLD OK / LIMIT", "",
		"OK", "RATE", "QUOTA", "UNAVAIL", "REFUND", "REPLAY")))
	for _, c := range m.cs {
		s := c.counts()
		owner := m.owners[c.ID]
		if owner == "" {
			owner = "?"
		}
		used, limit := s.acked, c.limit()
		nums := fmt.Sprintf("%d/%d", used, limit)
		if used > limit {
			nums += "+" // past a soft quota: overage
		}
		plan := c.planText()
		if c.Credits > 0 {
			plan += "+cr"
		}
		if c.hand {
			out = append(out, fmt.Sprintf("%-9s %-13s %-5s %s", c.ID, plan, owner, st.dim("your curl requests: ask GET /v1/usage with its key")))
			continue
		}
		out = append(out, fmt.Sprintf("%-9s %-13s %-5s %s %s %6d %s %s %s %s %s", c.ID, plan, owner, bar(st, used, limit, c.Plan.Hard, 22), padLeft(nums, 13),
			s.ok, padLeft(count(st, s.rateLimited, st.yellow), 7), padLeft(count(st, s.quotaExceeded, st.red), 7),
			padLeft(count(st, s.unavailable, st.yellow), 7), padLeft(count(st, s.refunded, st.purple), 7), padLeft(count(st, s.replays, st.green), 6)))
	}
	out = append(out, st.dim("UNITS TOLD OK: of requests answered 2xx, what the ledger must bill exactly · OK: those requests"),
		st.dim("RATE, QUOTA, UNAVAIL: refused rate-limited, quota-exceeded, quota-unavailable (503: retried, same key)"),
		st.dim("REFUND: the API failed, the charge was returned · REPLAY: a resend of an Idempotency-Key, billed once"))
	if events > 0 {
		out = append(out, "", st.bold("EVENTS"))
		for _, l := range m.events.last(events) {
			if width > 4 {
				l = truncateRunes(l, width-3)
			}
			out = append(out, "  "+l)
		}
	}
	if len(footer) > 0 {
		out = append(out, "")
		out = append(out, footer...)
	}
	return out
}

// plainLine is the periodic line of plain mode: one line for the nodes,
// one for the accounts.
func (m *monitor) plainLines(elapsed time.Duration) []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var nodes, accts []string
	for i, n := range m.c.Nodes {
		s := m.nodes[i]
		if !n.Running() {
			nodes = append(nodes, n.ID+" DOWN")
			continue
		}
		nodes = append(nodes, fmt.Sprintf("%s %.0f charges/s, %s forwarded, %.0f unsettled", n.ID, s.okPS, node.Thousands(int64(s.forwarded.total())), s.unsettled))
	}
	for _, c := range m.cs {
		if c.hand {
			continue
		}
		s := c.counts()
		u := fmt.Sprintf("%d/%d", s.acked, c.limit())
		var refused []string
		for _, r := range []struct {
			n    int64
			name string
		}{{s.rateLimited, "rate-limited"}, {s.quotaExceeded, "quota-exceeded"}, {s.unavailable, "unavailable"}, {s.refunded, "refunded"}, {s.replays, "replayed"}} {
			if r.n > 0 {
				refused = append(refused, fmt.Sprintf("%d %s", r.n, r.name))
			}
		}
		extra := ""
		if len(refused) > 0 {
			extra = " (" + strings.Join(refused, ", ") + ")"
		}
		accts = append(accts, fmt.Sprintf("%s@%s %s units, %d ok%s", c.ID, m.owners[c.ID], u, s.ok, extra))
	}
	return []string{
		fmt.Sprintf("t=%5.1fs  nodes: %s", elapsed.Seconds(), strings.Join(nodes, " | ")),
		"          accounts: " + strings.Join(accts, " | "),
	}
}

// cut shortens a line holding ANSI codes to n visible columns, so a
// terminal narrower than the view does not wrap it (which would break the
// refresh in place).
func cut(s string, n int) string {
	if visible(s) <= n {
		return s
	}
	var b strings.Builder
	cols, esc := 0, false
	for _, r := range s {
		switch {
		case esc:
			b.WriteRune(r)
			if r == 'm' {
				esc = false
			}
			continue
		case r == '\x1b':
			esc = true
			b.WriteRune(r)
			continue
		}
		if cols == n {
			continue
		}
		b.WriteRune(r)
		cols++
	}
	return b.String() + "\x1b[0m"
}

func truncateRunes(s string, n int) string {
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	return string(r[:n-1]) + "…"
}
