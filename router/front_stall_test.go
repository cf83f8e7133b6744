package router

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
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
			code, b := postKeyed(t, client, front.URL+"/v1/tasks", bytes.NewReader(make([]byte, 64<<20)))
			var p struct{ Type, Detail string }
			json.Unmarshal([]byte(b), &p)
			if code != http.StatusGatewayTimeout || !strings.HasSuffix(p.Type, ProblemUpstreamUnavailable) ||
				!strings.Contains(p.Detail, "took none of the request body for 300ms") || !strings.Contains(p.Detail, "The charge is refunded") {
				t.Errorf("%d %+v; want 504 upstream-unavailable saying the upstream took none of the body, the charge refunded", code, p)
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
			if code, b := postKeyed(t, client, front.URL+"/v1/reads", pr); code != 200 || b != "took 2048" {
				t.Errorf("a client pausing mid-body: %d %s; want 200 took 2048", code, b)
			}
			if c, r := ch.counts(); c != 2 || r != 1 {
				t.Errorf("after the paused upload: charges %d, refunds %d; want 2 and 1", c, r)
			}
		})
	}
}

// postKeyed POSTs body to url with the test's API key through client and
// returns the answer's status and body; a failed call fails the test.
func postKeyed(t *testing.T, client *http.Client, url string, body io.Reader) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("POST", url, body)
	req.Header.Set("X-Api-Key", "secret")
	res, err := client.Do(req)
	if err != nil {
		t.Fatalf("POST %s: no answer: %v", url, err)
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		t.Fatalf("POST %s: the answer's body: %v", url, err)
	}
	return res.StatusCode, string(b)
}

func itoa(n int64) string {
	b, _ := json.Marshal(n)
	return string(b)
}

// An upstream that took the whole body and is slow to answer is the
// ordinary timeout, not a stalled upload: the 504 said "took none of the
// request body" for every slow answer to a POST.
func TestProxySlowAnswerAfterTheBodyIsNoStall(t *testing.T) {
	const timeout = 300 * time.Millisecond
	for _, proto := range []string{"http", "h2c"} {
		t.Run(proto, func(t *testing.T) {
			release := make(chan struct{})
			up := protoServer(t, proto, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body)
				select { // reads it all, then answers too late
				case <-release:
				case <-r.Context().Done():
				}
			}))
			defer close(release)
			ch := &fakeCharger{decision: okDecision(), refundDecision: shard.Decision{Reason: shard.Refunded}}
			front, client := protoProxy(t, proto, up, FrontOptions{Charger: ch, Config: testConfig(t), UpstreamTimeout: timeout})
			code, b := postKeyed(t, client, front.URL+"/v1/tasks", strings.NewReader("0123456789"))
			if code != http.StatusGatewayTimeout || !strings.Contains(b, "did not answer in time") || strings.Contains(b, "took none") {
				t.Errorf("%d %s; want 504 saying the upstream did not answer in time", code, b)
			}
		})
	}
}

// slowTransport answers every request 200 with chunks spaced wider than
// UpstreamTimeout, reporting no httptrace event (a custom Transport); the
// answer ends early when its request's context does.
type slowTransport struct{ gap time.Duration }

func (s slowTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	io.Copy(io.Discard, r.Body)
	r.Body.Close()
	pr, pw := io.Pipe()
	go func() {
		for i := range 4 {
			if i > 0 {
				select {
				case <-time.After(s.gap): // the upstream's own pace
				case <-r.Context().Done(): // as a real transport, the answer ends with its request
					pw.CloseWithError(context.Cause(r.Context()))
					return
				}
			}
			if _, err := pw.Write([]byte("chunk;")); err != nil {
				return
			}
		}
		pw.Close()
	}()
	// No Request: a transport may leave it unset.
	return &http.Response{StatusCode: 200, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1, Header: http.Header{}, Body: pr, ContentLength: -1}, nil
}

// A custom Transport that reports no httptrace event never told the watch
// that the answer began: it fired UpstreamTimeout after the body's last
// read and cut a streamed answer off, its charge standing.
func TestProxyCustomTransportAnswerIsNotCut(t *testing.T) {
	u, _ := url.Parse("http://127.0.0.1:1") // never dialled: the transport answers
	ch := &fakeCharger{decision: okDecision(), refundDecision: shard.Decision{Reason: shard.Refunded}}
	p, err := NewProxy(u, FrontOptions{Charger: ch, Config: testConfig(t), UpstreamTimeout: 100 * time.Millisecond,
		Transport: slowTransport{gap: 250 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	front := httptest.NewServer(p)
	defer front.Close()
	if code, b := postKeyed(t, &http.Client{Timeout: 10 * time.Second}, front.URL+"/v1/tasks", strings.NewReader("0123456789")); code != 200 || b != "chunk;chunk;chunk;chunk;" {
		t.Fatalf("%d %q; want 200 with the four chunks", code, b)
	}
}
