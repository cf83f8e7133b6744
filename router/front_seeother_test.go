package router

import (
	"net/http"
	"net/http/httptest"
	"net/url"
	"path"
	"sync/atomic"
	"testing"
)

// A path-cleaning upstream (nginx's merge_slashes, Express) serves
// //v1/tasks as /v1/tasks, and a Post/Redirect/Get handler that sends the
// client back to the same list (303 to /v1/tasks) did the work: that 303
// is not the ServeMux's redirect to the canonical path (a 301, which runs
// no handler), and must stay billed. It was refunded: the work was free.
func TestSeeOtherToTheSamePathStaysBilled(t *testing.T) {
	var work atomic.Int64
	mux := http.NewServeMux()
	mux.HandleFunc("POST /base/v1/tasks", func(w http.ResponseWriter, r *http.Request) {
		work.Add(1) // a task is created
		http.Redirect(w, r, "/base/v1/tasks", http.StatusSeeOther)
	})
	cleaning := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.URL.Path = path.Clean(r.URL.Path)
		mux.ServeHTTP(w, r)
	})
	up := httptest.NewServer(cleaning)
	defer up.Close()
	u, _ := url.Parse(up.URL + "/base")
	ch := &fakeCharger{decision: okDecision()}
	proxy, err := NewProxy(u, FrontOptions{Charger: ch, Config: testConfig(t)})
	if err != nil {
		t.Fatal(err)
	}
	front := httptest.NewServer(proxy)
	defer front.Close()
	req, _ := http.NewRequest("POST", front.URL+"/v1/tasks", nil)
	req.URL.Opaque = "//" + req.URL.Host + "//v1/tasks"
	req.Header.Set("X-Api-Key", "secret")
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	res, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	front.Close()
	charges, refunds := ch.counts()
	if res.StatusCode != 303 || work.Load() != 1 || charges != 1 || refunds != 0 {
		t.Fatalf("POST //v1/tasks: %d to %q, work done %d, %d charges, %d refunds; want the served 303 billed", res.StatusCode,
			res.Header.Get("Location"), work.Load(), charges, refunds)
	}
}
