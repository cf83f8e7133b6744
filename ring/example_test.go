package ring_test

import (
	"context"
	"fmt"
	"time"

	"github.com/quotaring/quotaring/ring"
)

// A single node on loopback: it owns nothing while joining, and every
// account once it serves.
func Example() {
	cfg := ring.LocalConfig()
	cfg.NodeID = "solo"
	cfg.Meta = ring.Meta{RPCAddr: "127.0.0.1:7000"}
	r, err := ring.New(cfg)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer r.Close(context.Background())

	changes, cancel := r.Subscribe(16)
	defer cancel()
	first := <-changes
	fmt.Println("partitions while joining:", len(first.Gained))

	ctx, done := context.WithTimeout(context.Background(), 5*time.Second)
	defer done()
	if err := r.SetState(ctx, ring.StateServing); err != nil {
		fmt.Println(err)
		return
	}
	c := <-changes
	fmt.Println("gained when serving:", len(c.Gained), "epoch changed:", c.Epoch == r.Epoch() && c.Epoch != first.Epoch)

	m, ok := r.Owner("acct-42")
	fmt.Println("owner of acct-42:", m.ID, m.RPCAddr, ok, "partition", r.Partition("acct-42"))
	// Output:
	// partitions while joining: 0
	// gained when serving: 1021 epoch changed: true
	// owner of acct-42: solo 127.0.0.1:7000 true partition 109
}
