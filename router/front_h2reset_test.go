package router

import (
	"context"
	"io"
	"net/http"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/quotaring/quotaring/internal/waitfor"
)

// endless is a request body that never ends, counting what was taken.
type endless struct{ n atomic.Int64 }

func (e *endless) Read(p []byte) (int, error) {
	e.n.Add(int64(len(p)))
	return len(p), nil
}

// An HTTP/2 client that resets its stream mid-body broke its request off:
// the upstream never got all of it, so it is refunded whatever BillOn
// says (README: "the connection closes or the HTTP/2 stream is reset
// mid-body"), as a connection closed mid-body is over HTTP/1.1. It stayed
// billed whenever the transport was not reading the body at that moment
// (always, for an upstream that paused reading: its flow-control window
// was full).
func TestH2StreamResetMidBodyIsRefunded(t *testing.T) {
	for _, paused := range []bool{true, false} {
		for _, policy := range []string{BillOnSuccess, BillOnAlways} {
			name := policy
			if paused {
				name += ", upstream paused reading"
			}
			t.Run(name, func(t *testing.T) {
				got, reads := make(chan struct{}, 1), make(chan error, 1)
				up := protoServer(t, "h2c", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					got <- struct{}{}
					if paused {
						<-r.Context().Done()
					}
					_, err := io.Copy(io.Discard, r.Body)
					reads <- err
					if err == nil {
						io.WriteString(w, "served")
					}
				}))
				u, _ := url.Parse("h2c://" + up.Listener.Addr().String())
				ch := &fakeCharger{decision: okDecision()}
				done := make(chan int, 1)
				proxy, err := NewProxy(u, FrontOptions{Charger: ch, Config: testConfig(t), BillOn: policy,
					OnRequest: func(code int, _ time.Duration) { done <- code }})
				if err != nil {
					t.Fatal(err)
				}
				front := protoServer(t, "h2c", proxy)
				tr := &http.Transport{Protocols: new(http.Protocols)}
				tr.Protocols.SetUnencryptedHTTP2(true)
				defer tr.CloseIdleConnections()
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				body := &endless{}
				req, _ := http.NewRequestWithContext(ctx, "POST", front.URL+"/v1/tasks", io.NopCloser(body))
				req.Header.Set("X-Api-Key", "secret")
				errc := make(chan error, 1)
				go func() {
					res, err := tr.RoundTrip(req)
					if err == nil {
						res.Body.Close()
					}
					errc <- err
				}()
				select {
				case <-got:
				case <-time.After(10 * time.Second):
					t.Fatal("the upstream never got the request")
				}
				if paused {
					// 2 MiB taken: past the upstream's 1 MiB window, so the
					// proxy's transport waits to write, not to read.
					waitfor.Cond(t, 10*time.Second, "the client to send 2 MiB", func() bool { return body.n.Load() >= 2<<20 })
				}
				cancel() // RST_STREAM mid-body
				<-errc
				waitBodyBrokenOff(t, reads, done)
				if c, r := ch.counts(); c != 1 || r != 1 {
					t.Fatalf("bill-on %s: %d charges, %d refunds; want the charge refunded (the body was broken off)", policy, c, r)
				}
			})
		}
	}
}
