package node

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/logbuf"
	"github.com/quotaring/quotaring/shard"
)

// The reservation audit finds units the ledger reserves for a node on an
// account it has let go (the kind of strand every hand-back bug the chaos
// tests found left behind, seen only when the node drained): the gauge
// quotaring_reservations_stranded_units and a log line naming the account.
// Reservations of accounts the node owns and holds, charged and settled
// as usual, are never judged stranded.
func TestReservationAuditFindsUnitsOfAnAccountLetGo(t *testing.T) {
	dir := t.TempDir()
	dsn := "sqlite:" + filepath.Join(dir, "ledger.db")
	accounts := twentyAccounts(1000)
	seedLedger(t, dsn, accounts)
	var logs logbuf.Buffer
	nodes := startNodesWith(t, dsn, func(c *Config) {
		c.ReservationAudit = 50 * time.Millisecond
		c.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	}, func(c *Config) { c.ReservationAudit = 50 * time.Millisecond })
	n1, n2 := nodes[0], nodes[1]
	if chargeEachThrough(t, n1, accounts) == 0 {
		t.Fatal("n2 owns none of the accounts; the test needs both to hold reservations")
	}
	rounds := func(nd *Node, k int64) { // k more audit rounds of nd
		t.Helper()
		from := nd.audits.Load()
		waitFor(t, 10*time.Second, "audit rounds", func() bool { return nd.audits.Load() >= from+k })
	}
	for _, nd := range nodes {
		waitFor(t, 10*time.Second, nd.cfg.ID+"'s charges settled", func() bool { return nd.wal.SettledSeq() == nd.wal.DurableSeq() })
		rounds(nd, 3)
		if v := gaugeValue(t, nd, "quotaring_reservations_stranded_units"); v != 0 {
			t.Fatalf("%s: %v units judged stranded with every reservation held", nd.cfg.ID, v)
		}
	}

	// Units of an account n2 owns, reserved in the ledger for n1, which
	// holds none: what a hand-back n1 dropped leaves behind.
	let := ownedBy(t, n2, accounts)
	ctx := context.Background()
	l, err := flush.Open(ctx, dsn, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	res, err := l.Reserve(ctx, "n1", flush.ReserveRequest{Account: let, Wall: time.Now(), Need: 5})
	if err != nil || len(res.Granted) == 0 {
		t.Fatalf("reserve 5 units of %s for n1: %+v %v", let, res, err)
	}
	waitFor(t, 10*time.Second, "n1's audit to find the 5 stranded units", func() bool {
		return gaugeValue(t, n1, "quotaring_reservations_stranded_units") == 5
	})
	if out := logs.String(); !strings.Contains(out, "the ledger reserves 5 units for this node on accounts it neither owns nor holds anything of") || !strings.Contains(out, let+" "+res.Granted[0].Grant+" 5") {
		t.Fatalf("no log line naming %s:\n%s", let, out)
	}
	if v := gaugeValue(t, n2, "quotaring_reservations_stranded_units"); v != 0 {
		t.Fatalf("n2 judged %v units stranded: n1's strand is not n2's", v)
	}
	if page := statusPage(t, n1); !strings.Contains(page, "5 stranded: "+let+" "+res.Granted[0].Grant+" 5") {
		t.Fatalf("n1's status page does not show the stranded units on %s", let)
	}
	if page := statusPage(t, n2); strings.Contains(page, "stranded:") {
		t.Fatal("n2's status page shows stranded units")
	}

	// Freed (quotad revoke, a restart): the finding goes.
	if err := l.Release(ctx, "n1", let, []shard.Alloc{{Grant: res.Granted[0].Grant, Units: 5}}, flush.ReleaseKey{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "n1's audit to find nothing stranded", func() bool {
		return gaugeValue(t, n1, "quotaring_reservations_stranded_units") == 0
	})
}

// statusPage is nd's GET /status.
func statusPage(t *testing.T, nd *Node) string {
	t.Helper()
	resp, err := http.Get("http://" + nd.AdminAddr() + "/status")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /status: %d %v", resp.StatusCode, err)
	}
	return string(body)
}
