package node

import (
	"context"
	"database/sql"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/internal/logbuf"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
)

// A config row in the ledger that does not validate (a hand edit, another
// tool) threw the whole connection away at start: the restarted node ran
// as if the ledger were down (hard accounts quota-unavailable once their
// units ran out) and a new node never became ready, both saying the ledger
// was unreachable. The node keeps the connection, serves the config it
// kept, and says which row to fix.
func TestAnInvalidConfigRowKeepsTheLedgerConnected(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "ledger.db")
	dsn := "sqlite:" + path
	seedLedger(t, dsn, map[string]int64{"acme": 100})
	ctx := context.Background()
	cfg := nodeConfig(dsn, "n1", filepath.Join(dir, "n1"))
	nd, err := Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "ready", nd.Ready)
	if err := nd.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	db, err := sql.Open("sqlite", path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`INSERT INTO plans (plan_id, rate, burst, monthly_quota, hard) VALUES ('broken', 'ten per second', 0, 0, 0)`); err != nil {
		t.Fatal(err)
	}
	db.Close()

	var logs logbuf.Buffer
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	nd, err = Start(ctx, cfg)
	if err != nil {
		t.Fatalf("restart with an invalid config row: %v", err)
	}
	defer nd.Shutdown(ctx)
	waitFor(t, 10*time.Second, "ready", nd.Ready)
	if nd.Ledger() == nil {
		t.Fatal("the ledger was thrown away for one invalid config row")
	}
	res, err := nd.Router().Charge(ctx, router.ChargeRequest{Account: "acme", Route: "GET /x", Units: 1})
	if err != nil || res.Reason != shard.OK {
		t.Fatalf("a charge after the restart: %v %v; want ok", res.Reason, err)
	}
	if out := logs.String(); !strings.Contains(out, "does not validate") || !strings.Contains(out, "broken") || strings.Contains(out, "unreachable") {
		t.Errorf("the log should name the invalid row and not call the ledger unreachable:\n%s", out)
	}
}
