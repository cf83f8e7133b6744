package router

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/shard"
)

// An upstream that hangs without reading a large body (a deadlock, a
// stopped process) fills the connection's buffers or its HTTP/2 window: the
// transport blocks writing and the wait for the answer's head never starts.
// The client got no answer, the charge stayed, and on HTTP/1 the handler
// and both connections were held for as long as the upstream hung. Now it
// gets 504 after UpstreamTimeout without progress, and the charge is
// refunded; a body the upstream takes, or a client that pauses (the
// body's own bound), is not cut.
func TestProxyUpstreamThatTakesNoBodyTimesOut(t *testing.T) {
	const timeout = 300 * time.Millisecond
	for _, proto := range []string{"http", "h2c"} {
		t.Run(proto, func(t *testing.T) {
			release := make(chan struct{})
			up := protoServer(t, proto, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == "/v1/tasks" { // hangs: never reads, never answers
					select {
					case <-release:
					case <-r.Context().Done():
					}
					return
				}
				n, _ := io.Copy(io.Discard, r.Body)
				io.WriteString(w, "took "+itoa(n))
			}))
			defer close(release) // before up closes (Cleanup): its handlers return
			ch := &fakeCharger{decision: okDecision(), refundDecision: shard.Decision{Reason: shard.Refunded}}
			front, client := protoProxy(t, proto, up, FrontOptions{Charger: ch, Config: testConfig(t),
				UpstreamTimeout: timeout, MaxBodyBytes: 256 << 20})

			// 64 MiB: more than loopback's socket buffers and HTTP/2's windows hold.
			req, _ := http.NewRequest("POST", front.URL+"/v1/tasks", bytes.NewReader(make([]byte, 64<<20)))
			req.Header.Set("X-Api-Key", "secret")
			res, err := client.Do(req)
			if err != nil {
				t.Fatalf("no answer from the front: %v", err)
			}
			var p struct{ Type, Detail string }
			json.NewDecoder(res.Body).Decode(&p)
			res.Body.Close()
			if res.StatusCode != http.StatusGatewayTimeout || !strings.HasSuffix(p.Type, ProblemUpstreamUnavailable) ||
				!strings.Contains(p.Detail, "took none of the request body for 300ms") || !strings.Contains(p.Detail, "The charge is refunded") {
				t.Errorf("%d %+v; want 504 upstream-unavailable saying the upstream took none of the body, the charge refunded", res.StatusCode, p)
			}
			if c, r := ch.counts(); c != 1 || r != 1 {
				t.Errorf("charges %d, refunds %d; want 1 and 1", c, r)
			}

			// A client that pauses for longer than UpstreamTimeout mid-body
			// (within BodyIdleTimeout) while the upstream reads: served.
			pr, pw := io.Pipe()
			go func() {
				pw.Write(make([]byte, 1<<10))
				<-time.After(3 * timeout) // the client's own pause, not a wait for the front
				pw.Write(make([]byte, 1<<10))
				pw.Close()
			}()
			req, _ = http.NewRequest("POST", front.URL+"/v1/reads", pr)
			req.Header.Set("X-Api-Key", "secret")
			res, err = client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(res.Body)
			res.Body.Close()
			if res.StatusCode != 200 || string(b) != "took 2048" {
				t.Errorf("a client pausing mid-body: %d %s; want 200 took 2048", res.StatusCode, b)
			}
			if c, r := ch.counts(); c != 2 || r != 1 {
				t.Errorf("after the paused upload: charges %d, refunds %d; want 2 and 1", c, r)
			}
		})
	}
}

func itoa(n int64) string {
	b, _ := json.Marshal(n)
	return string(b)
}
