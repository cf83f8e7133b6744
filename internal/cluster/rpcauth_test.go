package cluster

import (
	"context"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/pgtest"
	"github.com/quotaring/quotaring/router/pb"
)

// A node started with another --rpc-token than the cluster's, but the
// cluster's gossip key, joins the gossip and owns nothing: its /readyz and
// its log name --rpc-token, the others keep every account, and the node
// that refuses its calls logs them. An SRE review, with real processes as
// here, saw such a node take 253 partitions and go ready while the others
// answered its accounts 500 for 25 s.
func TestNodeWithAWrongRPCTokenOwnsNothing(t *testing.T) {
	dsn := pgtest.NewDB(t)
	ctx := context.Background()
	l, err := flush.Open(ctx, dsn, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	if err := l.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	gossipKey, token := NewSecrets()
	c, err := Start(ctx, Options{Binary: binary, Nodes: 2, Ledger: dsn, Dir: t.TempDir(), Args: []string{"--snapshot-interval", "200ms"},
		GossipKey: gossipKey, RPCToken: token})
	if err != nil {
		t.Fatal(err)
	}
	tc := &testCluster{Cluster: c, t: t, dsn: dsn, ledger: l, conns: &Conns{}}
	t.Cleanup(tc.conns.Close)
	bad, err := c.newNode(len(c.Nodes))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, n := range append(c.List(), bad) {
				t.Logf("--- log of %s (last lines):\n%s", n.ID, n.LogTail(30))
			}
		}
		bad.Terminate(context.Background())
		c.Stop(context.Background())
	})
	tc.converge(30 * time.Second)

	_, other := NewSecrets()
	bad.env = slices.DeleteFunc(bad.env, func(e string) bool { return strings.HasPrefix(e, "QUOTAD_RPC_TOKEN=") })
	bad.env = append(bad.env, "QUOTAD_RPC_TOKEN="+other)
	if err := bad.Start(ctx); err != nil {
		t.Fatal(err)
	}
	var body string
	pctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	err = Poll(pctx, 100*time.Millisecond, func() (bool, error) {
		code, b, err := bad.AdminGet(pctx, "/readyz")
		if err != nil {
			return false, nil
		}
		body = b
		return code == 503 && strings.Contains(b, "wrong RPC token") && strings.Contains(b, "--rpc-token (QUOTAD_RPC_TOKEN)"), nil
	})
	if err != nil {
		t.Fatalf("%s, with a wrong --rpc-token: /readyz %q, want 503 naming --rpc-token (%v)", bad.ID, body, err)
	}
	var v *pb.RingViewReply
	err = Poll(pctx, 100*time.Millisecond, func() (bool, error) {
		v, err = c.Nodes[0].RingView(pctx)
		return err == nil && slices.ContainsFunc(v.Members, func(m *pb.Member) bool { return m.Id == bad.ID }), nil
	})
	if err != nil {
		t.Fatalf("%s never joined %s's gossip: %v", bad.ID, c.Nodes[0].ID, err)
	}
	for i, m := range v.Members {
		if m.Id != bad.ID {
			continue
		}
		if slices.Contains(v.Owners, int32(i)) || m.State != "joining" {
			t.Fatalf("%s, with a wrong --rpc-token, is %s in %s's ring and owns partitions", bad.ID, m.State, c.Nodes[0].ID)
		}
	}
	if log, _ := os.ReadFile(bad.LogPath); !strings.Contains(string(log), "refused this node's RPC token") {
		t.Errorf("%s's log does not say that its RPC token is refused", bad.ID)
	}
	err = Poll(pctx, 100*time.Millisecond, func() (bool, error) {
		for _, n := range c.Nodes {
			if log, _ := os.ReadFile(n.LogPath); strings.Contains(string(log), "refused an RPC call from") {
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("no node logged the calls it refused: %v", err)
	}
}
