package node

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/quotaring/quotaring/flush"
)

// A drained node leaves nothing reserved in the ledger, not even units it
// never learned it held: here a reservation made for it whose commit reply
// was lost (a slow ledger), as the chaos harness found (go test ./chaos_test
// -run TestChaos/partitions: reservations left after every node drained).
func TestShutdownFreesReservationsTheNodeDidNotKnowOf(t *testing.T) {
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	seedLedger(t, dsn, map[string]int64{"acme": 1000})
	nd := startNodes(t, dsn, 1)[0]
	ctx := context.Background()
	l, err := flush.Open(ctx, dsn, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	// The node asked, the ledger reserved, the reply never came back.
	if res, err := l.Reserve(ctx, nd.ID(), flush.ReserveRequest{Account: "acme", Wall: time.Now(), Need: 7}); err != nil || len(res.Granted) == 0 {
		t.Fatalf("reserve: %+v %v", res, err)
	}
	if err := nd.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	held, err := l.Reservations(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range held {
		if r.Node == nd.ID() && r.Units != 0 {
			t.Fatalf("after the drain %s still holds %d units of %s/%s", r.Node, r.Units, r.Account, r.Grant)
		}
	}
}
