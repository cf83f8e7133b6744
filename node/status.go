package node

import (
	"bytes"
	"context"
	_ "embed"
	"fmt"
	"html/template"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/shard"
)

// The status page: GET /status on the admin port. One server-rendered HTML
// page (html/template, inline CSS and SVG, no script, no external asset)
// that refreshes itself every 2 s: the members and their states, which
// share of the ring each one owns, the accounts this node owns with their
// usage, how far its log is behind the ledger, and the reservations held.
// It reads only what the node already has in memory, plus two ledger reads
// bounded by statusLedgerTimeout, so it renders with the ledger down (G8).
//
// Like /metrics it names accounts: the admin port is for operators, never
// for the public.

//go:embed status.tmpl
var statusTemplateText string

var statusTemplate = template.Must(template.New("status").Funcs(template.FuncMap{
	"thousands": func(v any) string { return groupDigits(fmt.Sprint(v)) },
	"sub":       func(a, b int64) int64 { return a - b },
}).Parse(statusTemplateText))

// statusLedgerTimeout bounds the page's ledger reads (reservations).
const statusLedgerTimeout = 500 * time.Millisecond

// statusMaxAccounts bounds the accounts listed (the busiest first).
const statusMaxAccounts = 200

// statusMaxReservations bounds the reservation rows listed.
const statusMaxReservations = 60

// memberColors tell members apart in the ring strip and the share bars.
var memberColors = []string{"#2f6fde", "#e07b20", "#2a9d5b", "#b23ab0", "#c93c3c", "#1c9aa8", "#8a6d1f", "#5b5fc7"}

type statusData struct {
	Node   string
	State  string // serving, draining, starting
	Now    string
	Uptime string
	Build  string // quotad version --short
	// ClockOffset is the clock the node bills by minus the ledger's at the
	// last check (clockLoop), "" before one; ClockOff: past
	// Config.MaxClockOffset. ClockStep: how far the system clock stands
	// from it (a step held against, or the ledger's time taken), "" while
	// the node follows the system clock.
	ClockOffset string
	ClockOff    bool
	ClockStep   string
	Incarnation string
	Epoch       string
	RingErr     string
	Addrs       ring.Meta
	// PortsLocked: gossip encrypted and RPC calls need the token or a
	// client certificate (portsLocked); RPCTLS: the RPC port is mutual TLS.
	PortsLocked, RPCTLS bool

	Members []statusMember
	// Gone are the members this node knew that are not alive now
	// (ring.Gone): a dead node vanished from the page.
	Gone       []statusGone
	Partitions int
	Strip      []statusRun // the ring, partition by partition (runs of one owner)
	Unowned    int         // partitions without an owner (nobody serves)

	Accounts      []statusAccount
	AccountsOwned int // owned accounts with state here (before the cap)
	AccountsMore  int // not listed (over statusMaxAccounts)

	Unsettled      uint64
	UnsettledBytes string
	DurableSeq     uint64
	SettledSeq     uint64
	LastSettle     string
	SettleLag      string
	LedgerValue    string // up, down, not reached
	LedgerState    string // what it means
	LedgerOK       bool
	ConfigAge      string // since the config snapshot was read
	ConfigStale    bool
	Charges        int64
	Refused        int64
	Refunds        int64

	HeldHere int64
	// Stranded and StrandedOn are the reservation audit's last finding
	// (audit.go): units stranded, and on which accounts.
	Stranded     int64
	StrandedOn   string
	Reservations []statusReservation
	ResByNode    []statusNodeHold
	ResMore      int
	ResErr       string
}

type statusMember struct {
	ID, State, Color  string
	RPC, HTTP, Admin  string
	StatusURL         string
	Self              bool
	Partitions        int
	Share             float64 // percent of partitions
	ShareText, Serves string
	// Clock is the member's verdict on its clock against the ledger's
	// (ring.Meta.Clock): agrees, off or unknown.
	Clock string
}

// statusGone is a member not alive now, and for how long.
type statusGone struct {
	ID, Addr, For string
}

// statusRun is a run of consecutive partitions with one owner, drawn as
// one rectangle of the strip.
type statusRun struct {
	X, W  int
	Color string
	Title string
}

type statusAccount struct {
	ID, Plan, Kind string // Kind: hard or soft
	Used, Limit    int64
	Remaining      int64
	Percent        float64 // of the limit, capped at 100 for the bar
	Over           bool    // used beyond the limit (soft plans bill it as overage)
	PercentText    string
	Grants         []statusGrant
	Routes         string
}

type statusGrant struct {
	ID         string
	Used       int64
	Units      int64
	Reserved   int64 // allowance held here, unspent
	Expires    string
	Percent    float64
	Monthly    bool
	Exhausted  bool
	UsedOfText string
}

type statusReservation struct {
	Node, Account, Grant string
	Units                int64
}

type statusNodeHold struct {
	Node  string
	Units int64
	Rows  int
}

func (n *Node) statusPage(w http.ResponseWriter, r *http.Request) {
	d := n.statusData(r.Context())
	var buf bytes.Buffer
	if err := statusTemplate.Execute(&buf, d); err != nil {
		http.Error(w, "status page: "+err.Error(), http.StatusInternalServerError)
		return
	}
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Cache-Control", "no-store")
	// NB: the page has no script and loads nothing from elsewhere; say so,
	// so a browser refuses anything that slips in.
	h.Set("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; img-src data:")
	w.Write(buf.Bytes())
}

func (n *Node) statusData(ctx context.Context) *statusData {
	now := time.Now() // for the ages below, which the process's clock measured
	// NB: the time shown is the clock this node bills by (held against a
	// step, or the ledger's), which may differ from the system's.
	d := &statusData{Node: n.cfg.ID, Now: n.wall().Format("2006-01-02 15:04:05 UTC"),
		Uptime: time.Since(n.started).Round(time.Second).String(), Build: n.build.Short(), State: "serving",
		LedgerValue: "not reached", LedgerState: "serving from the data dir's config snapshot until it answers"}
	if off := time.Duration(n.clockOffset.Load()); off != 0 {
		d.ClockOffset = signed(off)
		d.ClockOff = off.Abs() > n.cfg.MaxClockOffset
	}
	if step := time.Duration(n.clockStep.Load()); step != 0 {
		d.ClockStep = signed(step)
	}
	switch {
	case n.draining.Load():
		d.State = "draining"
	case !n.Ready():
		d.State = "starting"
	}
	if n.wal != nil {
		d.Incarnation = n.wal.Incarnation()
		d.DurableSeq, d.SettledSeq = n.wal.DurableSeq(), n.wal.SettledSeq()
		d.Unsettled = d.DurableSeq - min(d.SettledSeq, d.DurableSeq)
		d.UnsettledBytes = byteSize(n.wal.Stats().Bytes)
	}
	owned := func(string) bool { return true }
	if r := n.Ring(); r != nil {
		n.statusRing(d, r)
		owned = n.owns
	}
	if s := n.Settler(); s != nil {
		d.LedgerOK = s.Healthy()
		d.LedgerValue = "up"
		if !d.LedgerOK {
			d.LedgerValue = "down"
		}
		d.LedgerState = fmt.Sprintf("settled up to seq %s of this incarnation", Thousands(int64(d.SettledSeq)))
		if !d.LedgerOK {
			d.LedgerState = "the last settle failed: serving from memory and the log, settling later (G8)"
		}
		if t := s.LastSuccess(); !t.IsZero() {
			d.LastSettle = since(now, t) + " ago"
		}
	}
	if d.LastSettle == "" {
		d.LastSettle = "none yet"
	}
	if t := n.configRead(); !t.IsZero() {
		d.ConfigAge, d.ConfigStale = since(now, t)+" ago", n.configStale(now.Sub(t))
	} else {
		d.ConfigAge, d.ConfigStale = "none yet", n.configStale(now.Sub(n.started))
	}
	d.SettleLag = "0 s"
	if d.Unsettled > 0 {
		last := n.started
		if s := n.Settler(); s != nil && !s.LastSuccess().IsZero() {
			last = s.LastSuccess()
		}
		d.SettleLag = since(now, last)
	}
	if n.eng != nil {
		st := n.eng.Stats()
		d.Charges, d.Refused, d.Refunds = st.Charges.Load(), st.Refused.Load(), st.Refunds.Load()
		d.HeldHere = n.eng.AllowanceHeld()
		if f := n.stranded.Load(); f != nil && f.units > 0 {
			d.Stranded, d.StrandedOn = f.units, strings.Join(f.accounts, "; ")
		}
		n.statusAccounts(d, owned)
	}
	n.statusReservations(ctx, d)
	return d
}

// statusRing fills the members, their shares and the strip.
func (n *Node) statusRing(d *statusData, r *ring.Ring) {
	v := r.View()
	d.Epoch = fmt.Sprintf("%016x", v.Epoch)
	if err := r.Err(); err != nil {
		d.RingErr = err.Error()
	}
	d.Addrs = r.Self()
	d.PortsLocked, d.RPCTLS = n.portsLocked(), n.rpcTLS.server != nil
	d.Partitions = len(v.Owners)
	if d.Partitions == 0 {
		d.Partitions = r.Layout().PartitionCount
	}
	counts := make(map[string]int, len(v.Members))
	for _, o := range v.Owners {
		counts[o]++
	}
	colors := make(map[string]string, len(v.Members))
	for i, m := range v.Members {
		colors[m.ID] = memberColors[i%len(memberColors)]
		sm := statusMember{ID: m.ID, State: string(m.State), Color: colors[m.ID], RPC: m.RPCAddr, HTTP: m.HTTPAddr, Admin: m.AdminAddr,
			Self: m.ID == n.cfg.ID, Partitions: counts[m.ID], Clock: m.Clock.String()}
		if m.AdminAddr != "" {
			// The other nodes' admin ports are taken to be served as this
			// one's is (one --admin-tls setting across the cluster).
			sm.StatusURL = n.AdminScheme() + "://" + m.AdminAddr + "/status"
		}
		if d.Partitions > 0 {
			sm.Share = 100 * float64(sm.Partitions) / float64(d.Partitions)
		}
		sm.ShareText = fmt.Sprintf("%.1f %%", sm.Share)
		switch m.State {
		case ring.StateServing:
			sm.Serves = "owns accounts"
		case ring.StateJoining:
			sm.Serves = "loading its log; owns nothing yet"
		case ring.StateDraining:
			sm.Serves = "handing its accounts over"
		}
		d.Members = append(d.Members, sm)
	}
	for _, g := range r.Gone() {
		d.Gone = append(d.Gone, statusGone{ID: g.ID, Addr: g.GossipAddr, For: time.Since(g.Since).Round(time.Second).String()})
	}
	for i := 0; i < len(v.Owners); {
		j := i
		for j < len(v.Owners) && v.Owners[j] == v.Owners[i] {
			j++
		}
		owner := v.Owners[i]
		run := statusRun{X: i, W: j - i, Color: colors[owner], Title: fmt.Sprintf("partitions %d-%d: %s", i, j-1, owner)}
		if owner == "" {
			run.Color, run.Title = "#cccccc", fmt.Sprintf("partitions %d-%d: no owner", i, j-1)
			d.Unowned += j - i
		} else if run.Color == "" {
			run.Color = "#888888" // an owner this view lists no meta for
		}
		d.Strip = append(d.Strip, run)
		i = j
	}
	if len(v.Owners) == 0 {
		d.Unowned = d.Partitions
		d.Strip = []statusRun{{X: 0, W: d.Partitions, Color: "#cccccc", Title: "no member serves: nobody owns a partition"}}
	}
}

// statusAccounts lists the accounts this node owns, busiest first.
// expiryText is when a grant ends (Unix ns) for the status page: the day
// when it ends at midnight UTC, else to the second (a credit that ends at
// 00:00:30 read as ending the day before).
func expiryText(ns int64) string {
	at := time.Unix(0, ns).UTC()
	if at.Equal(at.Truncate(24 * time.Hour)) {
		return at.Format("2006-01-02")
	}
	return at.Format("2006-01-02 15:04:05 UTC")
}

func (n *Node) statusAccounts(d *statusData, owned func(string) bool) {
	snap := n.eng.Snapshot()
	var list []statusAccount
	for _, a := range n.eng.Accounts() {
		if !owned(a.ID) {
			continue // state kept from before a ring change; its owner is elsewhere now
		}
		// NB: used is what the active grants have spent (the settled use the
		// ledger knew when this node took the account, plus its own charges);
		// Usage.Used sums only the route counters of this node's charges.
		var used int64
		// At the account's month, which may be ahead of this node's clock
		// (shard.Account.Wall): a node whose clock ran ahead billed it there.
		wall := max(n.clock.Now().Wall, a.Usage.Period.Start())
		for _, g := range a.Grants {
			if grantActive(g, wall) {
				used += g.Used
			}
		}
		sa := statusAccount{ID: a.ID, Used: used, Limit: a.Usage.Limit, Remaining: a.Usage.Remaining, Kind: "hard"}
		if snap != nil {
			if cfg, ok := snap.AccountConfig(a.ID); ok {
				sa.Plan = cfg.Plan.ID
				if !cfg.Plan.Hard {
					sa.Kind = "soft"
				}
			}
		}
		switch {
		case sa.Limit > 0:
			sa.Percent = 100 * float64(sa.Used) / float64(sa.Limit)
			sa.PercentText = fmt.Sprintf("%.0f %%", sa.Percent)
		case sa.Used > 0:
			sa.Percent, sa.PercentText = 100, "no quota"
		default:
			sa.PercentText = "no quota"
		}
		if sa.Used > sa.Limit {
			sa.Over = true
		}
		sa.Percent = min(sa.Percent, 100)
		for _, g := range a.Grants {
			if !grantActive(g, wall) {
				continue
			}
			sg := statusGrant{ID: g.ID, Used: g.Used, Units: g.Units, Reserved: g.Allowance, Monthly: g.Monthly,
				UsedOfText: fmt.Sprintf("%s / %s", Thousands(g.Used), Thousands(g.Units)), Exhausted: g.Units > 0 && g.Used >= g.Units}
			if g.Units > 0 {
				sg.Percent = min(100, 100*float64(g.Used)/float64(g.Units))
			}
			if g.Expires != 0 {
				sg.Expires = expiryText(g.Expires)
			}
			sa.Grants = append(sa.Grants, sg)
		}
		sa.Routes = routesText(a.Usage.Routes)
		list = append(list, sa)
	}
	d.AccountsOwned = len(list)
	slices.SortStableFunc(list, func(a, b statusAccount) int {
		if a.Used != b.Used {
			return int(b.Used - a.Used)
		}
		return strings.Compare(a.ID, b.ID)
	})
	if len(list) > statusMaxAccounts {
		d.AccountsMore = len(list) - statusMaxAccounts
		list = list[:statusMaxAccounts]
	}
	d.Accounts = list
}

// statusReservations reads the reservations the ledger holds, per node.
func (n *Node) statusReservations(ctx context.Context, d *statusData) {
	l := n.Ledger()
	if l == nil {
		d.ResErr = "the ledger has not been reached yet"
		return
	}
	ctx, cancel := context.WithTimeout(ctx, statusLedgerTimeout)
	defer cancel()
	rs, err := l.Reservations(ctx)
	if err != nil {
		d.ResErr = "the ledger did not answer: " + err.Error()
		return
	}
	byNode := map[string]*statusNodeHold{}
	var rows []statusReservation
	for _, r := range rs {
		if r.Units == 0 {
			continue
		}
		h := byNode[r.Node]
		if h == nil {
			h = &statusNodeHold{Node: r.Node}
			byNode[r.Node] = h
		}
		h.Units += r.Units
		h.Rows++
		rows = append(rows, statusReservation(r))
	}
	for _, h := range byNode {
		d.ResByNode = append(d.ResByNode, *h)
	}
	slices.SortFunc(d.ResByNode, func(a, b statusNodeHold) int { return strings.Compare(a.Node, b.Node) })
	slices.SortFunc(rows, func(a, b statusReservation) int {
		if c := strings.Compare(a.Node, b.Node); c != 0 {
			return c
		}
		if c := strings.Compare(a.Account, b.Account); c != 0 {
			return c
		}
		return strings.Compare(a.Grant, b.Grant)
	})
	if len(rows) > statusMaxReservations {
		d.ResMore = len(rows) - statusMaxReservations
		rows = rows[:statusMaxReservations]
	}
	d.Reservations = rows
}

func grantActive(g shard.GrantView, wall int64) bool {
	return g.StartsAt <= wall && (g.Expires == 0 || wall < g.Expires)
}

func routesText(routes map[string]int64) string {
	type rt struct {
		name  string
		units int64
	}
	var rs []rt
	for k, v := range routes {
		rs = append(rs, rt{k, v})
	}
	slices.SortFunc(rs, func(a, b rt) int {
		if a.units != b.units {
			return int(b.units - a.units)
		}
		return strings.Compare(a.name, b.name)
	})
	var parts []string
	for i, r := range rs {
		if i == 4 {
			parts = append(parts, fmt.Sprintf("+%d more", len(rs)-4))
			break
		}
		parts = append(parts, fmt.Sprintf("%s: %s", r.name, Thousands(r.units)))
	}
	return strings.Join(parts, " · ")
}

func since(now, t time.Time) string {
	d := now.Sub(t)
	if d < 10*time.Second {
		return fmt.Sprintf("%.1f s", d.Seconds())
	}
	return d.Round(time.Second).String()
}

func byteSize(b uint64) string {
	switch {
	case b >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20))
	case b >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(b)/(1<<10))
	}
	return fmt.Sprintf("%d B", b)
}

// Thousands formats 1234567 as "1,234,567": the status page's counts, and
// the demo's terminal view.
func Thousands(v int64) string { return groupDigits(strconv.FormatInt(v, 10)) }

// groupDigits puts a comma between each group of three digits of an
// integer's decimal form (the template's "thousands" takes any integer type).
func groupDigits(s string) string {
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}
