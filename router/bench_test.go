package router_test

// The proxy's cost: latency it adds at a fixed request rate, and its
// throughput, each against calling the same upstream directly.
//
//	go test -run '^$' -bench 'BenchmarkProxy' -benchtime 1x -timeout 10m ./router/
//
// Each benchmark runs once (-benchtime 1x): a fixed-duration measurement,
// not b.N iterations. Everything (load generator, upstream, nodes) shares one
// machine, so the numbers are an upper bound on what the proxy adds.

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/internal/loadgen"
	"github.com/quotaring/quotaring/snapshot"
)

// BenchmarkProxyLatency measures the latency the proxy adds (p50, p99) at
// 2,000 requests/s, open loop: requests leave on schedule whether or not
// earlier ones have returned, so a slow answer does not slow the load down.
// Latency counts from the moment a request leaves (the generator's own
// timer lag, up to a millisecond on a busy machine, is not the proxy's).
// Direct and proxied runs alternate, three rounds of 2 s each, so drift in
// the machine's load hits both alike. In the upstream=1ms cases the upstream
// works 1 ms per request, as a real API does, long enough for the charge's
// fsync to finish meanwhile; latencies there leave out the time the upstream
// reports it took (a sleep overshoots more while the process also runs the
// proxy, which is not the proxy's cost).
func BenchmarkProxyLatency(b *testing.B) {
	for _, bc := range benchCases {
		b.Run(bc.String()+"/rate=2000", func(b *testing.B) {
			proxy, direct := benchSetup(b, bc)
			const rate, round = 2000, 2 * time.Second
			openLoop(b, direct, rate, time.Second) // warm up
			openLoop(b, proxy, rate, time.Second)
			var d, p []time.Duration
			for i := 0; i < 3; i++ {
				d = append(d, openLoop(b, direct, rate, round)...)
				p = append(p, openLoop(b, proxy, rate, round)...)
			}
			b.ReportMetric(float64(pct(p, 50)-pct(d, 50))/1e3, "added-p50-µs")
			b.ReportMetric(float64(pct(p, 99)-pct(d, 99))/1e3, "added-p99-µs")
			b.ReportMetric(float64(pct(d, 50))/1e3, "direct-p50-µs")
			b.ReportMetric(float64(pct(d, 99))/1e3, "direct-p99-µs")
			b.ReportMetric(float64(pct(p, 50))/1e3, "proxy-p50-µs")
			b.ReportMetric(float64(pct(p, 99))/1e3, "proxy-p99-µs")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// BenchmarkProxyThroughput measures requests/s through the proxy and
// directly, closed loop with 32 concurrent clients, and their ratio.
func BenchmarkProxyThroughput(b *testing.B) {
	for _, bc := range benchCases {
		b.Run(bc.String(), func(b *testing.B) {
			proxy, direct := benchSetup(b, bc)
			const workers, d = 32, 3 * time.Second
			closedLoop(b, direct, workers, time.Second)
			directRPS := closedLoop(b, direct, workers, d)
			closedLoop(b, proxy, workers, time.Second)
			proxyRPS := closedLoop(b, proxy, workers, d)
			b.ReportMetric(directRPS, "direct-req/s")
			b.ReportMetric(proxyRPS, "proxy-req/s")
			b.ReportMetric(proxyRPS/directRPS, "ratio")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// benchCase is one cluster shape, or with nodes 0 the floor: a bare
// httputil.ReverseProxy with no quotaring in it, what any proxy written in
// Go pays for the extra hop on this machine.
type benchCase struct {
	nodes  int
	noSync bool // --wal-sync=false: no fsync before answering (benchmarks only)
	soft   bool // a soft quota: no reservations in the ledger
	// work is the upstream's own time per request (0: it answers at once).
	work time.Duration
}

func (bc benchCase) String() string {
	if bc.nodes == 0 {
		return fmt.Sprintf("bare-reverse-proxy/upstream=%v", bc.work)
	}
	plan := "hard"
	if bc.soft {
		plan = "soft"
	}
	return fmt.Sprintf("nodes=%d/wal-sync=%v/quota=%s/upstream=%v", bc.nodes, !bc.noSync, plan, bc.work)
}

var benchCases = []benchCase{
	{nodes: 0}, {nodes: 0, work: time.Millisecond},
	{nodes: 1}, {nodes: 1, noSync: true}, {nodes: 1, soft: true}, {nodes: 3},
	{nodes: 1, work: time.Millisecond}, {nodes: 1, noSync: true, work: time.Millisecond}, {nodes: 3, work: time.Millisecond},
}

// target is one way to reach the upstream: a URL and the keys to spread
// requests over (none for the direct way).
type target struct {
	url    string
	keys   []string
	client *http.Client
}

// workHeader carries the upstream's own time (ns) in benchmarks that
// give it work; send reports it so latencies can leave it out.
const workHeader = "X-Bench-Upstream-Ns"

// send makes request i and returns the time the upstream said it worked.
func (t *target) send(i int) (time.Duration, error) {
	req, _ := http.NewRequest("GET", t.url+"/v1/tasks", nil)
	if len(t.keys) > 0 {
		req.Header.Set("Authorization", "Bearer "+t.keys[i%len(t.keys)])
	}
	res, err := t.client.Do(req)
	if err != nil {
		return 0, err
	}
	_, _ = io.Copy(io.Discard, res.Body)
	res.Body.Close()
	if res.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("status %d", res.StatusCode)
	}
	work, _ := strconv.ParseInt(res.Header.Get(workHeader), 10, 64)
	return time.Duration(work), nil
}

// benchSetup starts the upstream and the cluster with 12 accounts of
// a quota too large to run out; on three nodes the proxy is node 1 and most accounts are
// owned by the others, so most charges are forwarded.
func benchSetup(b *testing.B, bc benchCase) (proxy, direct *target) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		if bc.work > 0 {
			// The API's own work. A sleep's overshoot varies with the
			// process's load (more while it also runs the proxy), so the
			// upstream reports what it took and latencies leave it out.
			t := time.Now()
			time.Sleep(bc.work)
			w.Header().Set(workHeader, strconv.FormatInt(int64(time.Since(t)), 10))
		}
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"tasks":[]}`)
	}))
	b.Cleanup(up.Close)
	newClient := func() *http.Client {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.MaxIdleConns, tr.MaxIdleConnsPerHost = 512, 512
		b.Cleanup(tr.CloseIdleConnections)
		return &http.Client{Transport: tr}
	}
	direct = &target{url: up.URL, client: newClient()}
	if bc.nodes == 0 {
		u, err := url.Parse(up.URL)
		if err != nil {
			b.Fatal(err)
		}
		rp := httputil.NewSingleHostReverseProxy(u)
		rp.Transport = newClient().Transport
		bare := httptest.NewServer(rp)
		b.Cleanup(bare.Close)
		return &target{url: bare.URL, client: newClient()}, direct
	}
	var accounts []account
	var keys []string
	for i := 0; i < 12; i++ {
		id := fmt.Sprint("bench-", i)
		accounts = append(accounts, account{id: id, key: keyOf(id), plan: snapshot.Plan{ID: "big", MonthlyQuota: 1 << 40, Hard: !bc.soft}})
		keys = append(keys, keyOf(id))
	}
	// NB: quotad's default intervals: settle (which also sizes reservations)
	// 1 s, config refresh 3 s.
	c := startCluster(b, accounts, clusterOptions{nodes: bc.nodes, upstream: up.URL, noSync: bc.noSync, settle: time.Second, snapshot: 3 * time.Second})
	proxy = &target{url: "http://" + c.nodes[0].HTTPAddr(), keys: keys, client: newClient()}
	// Warm every account up (its first charge waits for a reservation).
	for i := range keys {
		if _, err := proxy.send(i); err != nil {
			b.Fatal(err)
		}
	}
	return proxy, direct
}

// openLoop sends rate requests/s for d, each at its scheduled time (or at
// once when the generator is behind), and returns their latencies.
func openLoop(b *testing.B, t *target, rate int, d time.Duration) []time.Duration {
	n := int(d.Seconds() * float64(rate))
	lat := make([]time.Duration, n)
	var failed atomic.Int64
	_, _ = loadgen.OpenLoop(context.Background(), rate, n, func(i int) {
		sent := time.Now()
		work, err := t.send(i)
		if err != nil {
			failed.Add(1)
		}
		lat[i] = time.Since(sent) - work
	})
	if f := failed.Load(); f > 0 {
		b.Fatalf("%d of %d requests failed", f, n)
	}
	return lat
}

// closedLoop runs workers that each send back to back for d and returns
// the requests/s.
func closedLoop(b *testing.B, t *target, workers int, d time.Duration) float64 {
	var done, failed atomic.Int64
	var wg sync.WaitGroup
	stop := time.Now().Add(d)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; time.Now().Before(stop); i += workers {
				if _, err := t.send(i); err != nil {
					failed.Add(1)
					continue
				}
				done.Add(1)
			}
		}()
	}
	wg.Wait()
	if f := failed.Load(); f > 0 {
		b.Fatalf("%d requests failed", f)
	}
	return float64(done.Load()) / d.Seconds()
}

// pct is the p-th percentile of lat (sorted in place).
func pct(lat []time.Duration, p int) time.Duration {
	slices.Sort(lat)
	return lat[(len(lat)-1)*p/100]
}
