package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/cluster"
	"github.com/quotaring/quotaring/node"
	"github.com/quotaring/quotaring/shard"
)

// The ALERT check can fail: a ledger and a webhook that agree hold; each
// kind of disagreement is reported, with its account.
func TestAlertCheck(t *testing.T) {
	ctx := context.Background()
	l, err := flush.OpenSQLite(ctx, filepath.Join(t.TempDir(), "ledger.db"), flush.SQLiteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := l.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	h := &harness{ledger: l, alerts: newAlertSink()}
	june := shard.PeriodOf(time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC).UnixNano())
	record := func(account string, threshold int, used int64, state flush.AlertState) {
		t.Helper()
		a := flush.AlertRecord{Account: account, Period: june, Threshold: threshold, Used: used, Limit: 10,
			CrossedAt: time.Date(2026, 6, 10, 0, 0, 0, 0, time.UTC), Claim: "c-" + account}
		if _, err := l.RecordAlert(ctx, a); err != nil {
			t.Fatal(err)
		}
		if state != flush.AlertPending {
			if _, err := l.FinishAlert(ctx, a, state, 1, ""); err != nil {
				t.Fatal(err)
			}
		}
	}
	post := func(account string, threshold int, secret string) int {
		t.Helper()
		body, _ := json.Marshal(node.Alert{Account: account, Period: june.String(), Threshold: threshold, Used: 8, Limit: 10})
		ts := strconv.FormatInt(time.Now().Unix(), 10)
		r := httptest.NewRequest("POST", alertPath, bytes.NewReader(body))
		r.Header.Set(node.AlertTimestampHeader, ts)
		r.Header.Set(node.AlertSignatureHeader, node.SignAlert([]byte(secret), ts, body))
		w := httptest.NewRecorder()
		h.alerts.ServeHTTP(w, r)
		return w.Code
	}
	deliver := func(account string, threshold int) {
		t.Helper()
		for range alertFailEvery { // the sink fails one good delivery in alertFailEvery on purpose
			if post(account, threshold, h.alerts.secret) == http.StatusNoContent {
				return
			}
		}
		t.Fatalf("the sink refused %s's alert %d times", account, alertFailEvery)
	}

	record("good", 80, 8, flush.AlertDelivered)
	deliver("good", 80)
	if r := h.alertResult(ctx); r.Verdict != cluster.Held || r.Count != 0 {
		t.Fatalf("a ledger and a webhook that agree: %+v", r)
	}

	record("pending", 80, 8, flush.AlertPending)  // never delivered
	record("unseen", 80, 8, flush.AlertDelivered) // recorded delivered, never taken
	record("early", 100, 9, flush.AlertDelivered) // claimed below its threshold
	deliver("early", 100)
	deliver("stray", 80) // taken, never recorded
	if code := post("forged", 80, "not-the-secret"); code != http.StatusUnauthorized {
		t.Fatalf("a forged alert: %d, want 401", code)
	}
	r := h.alertResult(ctx)
	if r.Verdict != cluster.Violated || r.Count != 5 {
		t.Fatalf("%d violations, want 5: %+v", r.Count, r.Violations)
	}
	for _, want := range []string{"pending: 2026-06 80% alert pending after the run", "unseen: 2026-06 80% alert recorded delivered, never taken",
		"early: 2026-06 100% alert claimed at 9 of 10 units", "stray: the webhook took a 2026-06 80% alert 1 times", ": the webhook refused a delivery: bad signature"} {
		found := false
		for _, v := range r.Violations {
			found = found || strings.Contains(v.Account+": "+v.Detail, want)
		}
		if !found {
			t.Errorf("no violation says %q: %+v", want, r.Violations)
		}
	}
}
