package cluster

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"
)

// The fault layer: nodes started with Options.TestFaults expose /test/...
// on their admin port (node/admin.go). A cut is one-sided (a node stops
// talking to the addresses it is told), so a partition tells both sides.

// Block cuts n's gossip and RPC traffic to peers, on n's side only.
func (n *Node) Block(ctx context.Context, peers ...*Node) error {
	if len(peers) == 0 {
		return nil
	}
	var g, r []string
	for _, p := range peers {
		g, r = append(g, p.Gossip), append(r, p.RPC)
	}
	q := url.Values{"gossip": {strings.Join(g, ",")}, "rpc": {strings.Join(r, ",")}}
	return n.testPost(ctx, "/test/block?"+q.Encode())
}

// Heal restores all of n's traffic.
func (n *Node) Heal(ctx context.Context) error { return n.testPost(ctx, "/test/heal") }

// SetClockOffset shifts n's wall clock by d (0 puts it back; each account
// keeps its own latest reading, so one the node decided while its clock was
// ahead stays in that reading's month, and the others follow the clock).
func (n *Node) SetClockOffset(ctx context.Context, d time.Duration) error {
	return n.testPost(ctx, "/test/clock?offset="+url.QueryEscape(d.String()))
}

func (n *Node) testPost(ctx context.Context, path string) error {
	code, body, err := n.AdminPost(ctx, path)
	if err != nil {
		return fmt.Errorf("cluster: %s %s: %w", n.ID, path, err)
	}
	if code != http.StatusOK {
		return fmt.Errorf("cluster: %s %s: %d %s (was it started with TestFaults?)", n.ID, path, code, strings.TrimSpace(body))
	}
	return nil
}

// Partition cuts gossip and RPC between a and each of bs, both ways.
func Partition(ctx context.Context, a *Node, bs ...*Node) error {
	if err := a.Block(ctx, bs...); err != nil {
		return err
	}
	for _, b := range bs {
		if err := b.Block(ctx, a); err != nil {
			return err
		}
	}
	return nil
}
