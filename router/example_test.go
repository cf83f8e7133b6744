package router_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/node"
	"github.com/quotaring/quotaring/ring"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/snapshot"
)

// A Go program charges its own handler's requests: Dial any node, and wrap
// the handler in Middleware with the client as Charger and Config. The
// example starts a one-node cluster in-process first (startExampleNode).
func ExampleMiddleware() {
	ctx := context.Background()
	n, stop := startExampleNode(ctx)
	defer stop()

	// The program's side.
	client, err := router.Dial(ctx, n.RPCAddr())
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	charge, err := router.Middleware(router.FrontOptions{Charger: client, Config: client})
	if err != nil {
		log.Fatal(err)
	}
	api := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		caller, ok := router.CallerFrom(r.Context())
		if !ok { // a CORS preflight: uncharged, no caller
			w.WriteHeader(http.StatusNoContent)
			return
		}
		fmt.Fprintf(w, "export for %s\n", caller.Account)
	})
	srv := httptest.NewServer(charge(api))
	defer srv.Close()

	for i := 0; i < 5; i++ {
		req, _ := http.NewRequest("POST", srv.URL+"/v1/exports", nil)
		req.Header.Set("Authorization", "Bearer qr_live_acme")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		res.Body.Close()
		fmt.Println(res.StatusCode, res.Header.Get("X-Quota-Remaining"), res.Header.Get("Content-Type"))
	}
	u, err := client.Usage(ctx, "acme")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("used", u.Used, "of", u.Limit, u.Routes)
	// Output:
	// 200 75 text/plain; charset=utf-8
	// 200 50 text/plain; charset=utf-8
	// 200 25 text/plain; charset=utf-8
	// 200 0 text/plain; charset=utf-8
	// 429 0 application/problem+json
	// used 100 of 100 map[POST /v1/exports:100]
}

// A program that reaches the cluster only through one address (a load
// balancer in front of the nodes' RPC port) dials it with Gateway: every
// call goes there, and the node that takes it forwards it to the account's
// owner. The example's one-node cluster stands in for the balancer.
func ExampleDialOptions_Dial_gateway() {
	ctx := context.Background()
	n, stop := startExampleNode(ctx)
	defer stop()

	// The program's side: the balancer's address, say quotad.example.internal:7400.
	client, err := router.DialOptions{Gateway: true}.Dial(ctx, n.RPCAddr())
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	res, err := client.Charge(ctx, router.ChargeRequest{Account: "acme", Route: "POST /v1/exports", Units: 25,
		EventID: "order-42", ClientID: true})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(res.Reason, res.Remaining)
	d, err := client.Refund(ctx, router.RefundRequest{Account: "acme", EventID: res.EventID, Receipt: res.Receipt})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(d.Reason, d.Remaining)
	u, err := client.Usage(ctx, "acme")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("used", u.Used, "of", u.Limit)
	// Output:
	// ok 75
	// refunded 100
	// used 0 of 100
}

// startExampleNode starts a one-node cluster in-process on a SQLite ledger
// in a temporary dir, with seedExample's config; stop shuts it down and
// removes the dir.
func startExampleNode(ctx context.Context) (n *node.Node, stop func()) {
	dir, err := os.MkdirTemp("", "quotaring-example")
	if err != nil {
		log.Fatal(err)
	}
	ledger := "sqlite:" + filepath.Join(dir, "ledger.db")
	if err := seedExample(ctx, ledger); err != nil {
		log.Fatal(err)
	}
	n, err = node.Start(ctx, node.Config{ID: "q1", DataDir: filepath.Join(dir, "q1"), Ledger: ledger, RingPreset: ring.PresetLocal,
		RPCAddr: "127.0.0.1:0", HTTPAddr: "127.0.0.1:0", AdminAddr: "127.0.0.1:0", GossipAddr: "127.0.0.1:0"})
	if err != nil {
		log.Fatal(err)
	}
	return n, func() {
		n.Shutdown(ctx)
		os.RemoveAll(dir)
	}
}

// seedExample writes the config: a plan of 100 units a month, the account
// acme with one key, and the route weights (an export costs 25).
func seedExample(ctx context.Context, dsn string) error {
	l, err := flush.Open(ctx, dsn, nil)
	if err != nil {
		return err
	}
	defer l.Close()
	if err := l.Migrate(ctx); err != nil {
		return err
	}
	if err := l.UpsertPlan(ctx, snapshot.Plan{ID: "starter", MonthlyQuota: 100, Hard: true}); err != nil {
		return err
	}
	if err := l.UpsertAccount(ctx, "acme", "starter"); err != nil {
		return err
	}
	if err := l.AddKey(ctx, snapshot.Key{ID: "acme-1", Hash: snapshot.HashKey("qr_live_acme"), Account: "acme"}); err != nil {
		return err
	}
	_, err = l.SetRoutes(ctx, 1, map[string]int64{"POST /v1/exports": 25, "GET /v1/exports/{id}": 1})
	return err
}
