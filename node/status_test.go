package node

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/router"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/snapshot"
)

// statusFixture is three in-process nodes whose accounts have charged: a
// hard plan, a soft plan, and a hard plan with credits.
type statusFixture struct {
	nodes []*Node
	// used is what each account was charged.
	used map[string]int64
}

func newStatusFixture(t *testing.T) *statusFixture {
	t.Helper()
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	ctx := context.Background()
	l, err := flush.Open(ctx, dsn, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	for _, p := range []snapshot.Plan{
		{ID: "free", MonthlyQuota: 100, Hard: true, Rate: "50/s", Burst: 100},
		{ID: "scale", MonthlyQuota: 40},
		{ID: "pro", MonthlyQuota: 50, Hard: true},
	} {
		if err := l.UpsertPlan(ctx, p); err != nil {
			t.Fatal(err)
		}
	}
	accounts := map[string]string{}
	for i := 1; i <= 9; i++ {
		accounts[fmt.Sprintf("acct-%d", i)] = []string{"free", "scale", "pro"}[i%3]
	}
	for id, plan := range accounts {
		if err := l.UpsertAccount(ctx, id, plan); err != nil {
			t.Fatal(err)
		}
		if plan == "pro" {
			now := time.Now().UTC()
			if err := l.AddGrant(ctx, id, snapshot.Grant{ID: "credits", Units: 500, StartsAt: now.Add(-time.Hour), ExpiresAt: now.AddDate(0, 3, 0)}); err != nil {
				t.Fatal(err)
			}
		}
	}
	l.Close()
	f := &statusFixture{nodes: startNodes(t, dsn, 3), used: map[string]int64{}}
	waitFor(t, 10*time.Second, "every node has the config", func() bool {
		for _, nd := range f.nodes {
			if s := nd.Engine().Snapshot(); s == nil || !s.HasAccount("acct-9") {
				return false
			}
		}
		return true
	})
	for i := 1; i <= 9; i++ {
		id := fmt.Sprintf("acct-%d", i)
		for k := 0; k < 3*i; k++ {
			res, err := f.nodes[k%3].Router().Charge(ctx, router.ChargeRequest{Account: id, Route: "POST /v1/tasks", Units: 2})
			if err != nil {
				t.Fatal(err)
			}
			if res.Reason == shard.OK {
				f.used[id] += 2
			}
		}
	}
	return f
}

// owned returns an account that nd owns and that charged.
func (f *statusFixture) owned(t *testing.T, nd *Node) string {
	t.Helper()
	for i := 9; i >= 1; i-- {
		id := fmt.Sprintf("acct-%d", i)
		if m, ok := nd.Ring().Owner(id); ok && m.ID == nd.ID() && f.used[id] > 0 {
			return id
		}
	}
	t.Fatalf("node %s owns none of the fixture's accounts", nd.ID())
	return ""
}

// checkStatusHTML checks what a status page must show: every member and its
// state, ring shares that add up to every partition, and the usage of an
// account the node owns.
func checkStatusHTML(t *testing.T, page string, f *statusFixture, nd *Node) {
	t.Helper()
	for _, m := range f.nodes {
		if !strings.Contains(page, ">"+m.ID()+"</a>") {
			t.Errorf("member %s is not listed", m.ID())
		}
	}
	if got := strings.Count(page, `<span class="pill serving">serving</span>`); got < 3 {
		t.Errorf("%d members shown serving, want 3", got)
	}
	shares := regexp.MustCompile(`(n\d): ([\d,]+) partitions \((\d+\.\d) %\)`).FindAllStringSubmatch(page, -1)
	total := 0
	for _, s := range shares {
		p, _ := strconv.Atoi(strings.ReplaceAll(s[2], ",", ""))
		total += p
		if pct, _ := strconv.ParseFloat(s[3], 64); pct < 20 || pct > 45 {
			t.Errorf("%s holds %s %% of the ring; three members should hold about a third each", s[1], s[3])
		}
	}
	if len(shares) != 3 || total != 1021 {
		t.Errorf("ring shares %v add up to %d partitions; want 3 members and 1021", shares, total)
	}
	acct := f.owned(t, nd)
	row := regexp.MustCompile(`(?s)<tr class="account">\s*<td><b>` + regexp.QuoteMeta(acct) + `</b></td>.*?</tr>`).FindString(page)
	if row == "" {
		t.Fatalf("account %s (owned by %s) has no row on its status page", acct, nd.ID())
	}
	want := fmt.Sprintf(`<td class="num">%d</td>`, f.used[acct])
	if !strings.Contains(row, want) || !strings.Contains(row, `class="bar`) {
		t.Errorf("account %s's row does not show its usage %d as a number and a bar:\n%s", acct, f.used[acct], row)
	}
	if !strings.Contains(page, `http-equiv="refresh"`) {
		t.Error("the page does not refresh itself")
	}
}

func TestStatusPage(t *testing.T) {
	f := newStatusFixture(t)
	nd := f.nodes[0]
	resp, err := http.Get("http://" + nd.AdminAddr() + "/status")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") {
		t.Fatalf("GET /status: %s, %s", resp.Status, resp.Header.Get("Content-Type"))
	}
	page := string(body)
	checkStatusHTML(t, page, f, nd)
	// Each node's clock verdict: this one's, at least, is known by now
	// (Start checks the clock before it takes accounts).
	for _, s := range []string{"quotad " + nd.build.Short() + " ·", "Unsettled log", "Settle lag", "config read ", "Reservations in the ledger", "holds", "internal ports <span class=\"bad\"", "<th>clock</th>", "<span>agrees</span>"} {
		if !strings.Contains(page, s) {
			t.Errorf("the page lacks %q", s)
		}
	}
	for _, bad := range []string{"<script", "src=\"http", "href=\"https://"} {
		if strings.Contains(page, bad) {
			t.Errorf("the page loads or runs something from elsewhere: %q", bad)
		}
	}
	t.Run("chromium", func(t *testing.T) { testStatusInChromium(t, f, nd) })
}

// testStatusInChromium loads the page in headless Chromium: the DOM it
// built must show the members, the ring shares and an account's usage, and
// a screenshot goes to the test's artifact dir (go test -artifacts keeps
// it under -outputdir), or to $QUOTARING_STATUS_SCREENSHOT when set.
func testStatusInChromium(t *testing.T, f *statusFixture, nd *Node) {
	bin := findChromium()
	if bin == "" {
		msg := "Chromium not found (looked for chromium, chromium-browser, google-chrome on PATH): " +
			"the status page was not checked in a browser. Install it (Debian: apt-get install chromium); .ci/run does."
		if os.Getenv("CI") == "true" || os.Getenv("QUOTARING_REQUIRE_CHROMIUM") == "1" {
			t.Fatal(msg)
		}
		t.Log("!!! " + msg)
		t.Skip(msg)
	}
	url := "http://" + nd.AdminAddr() + "/status"
	// NB: Chromium starting on a machine busy with -race tests can starve
	// the nodes long enough for gossip to suspect one (seen in CI: n3
	// missing from n1's page, the plain fetch just before having shown it).
	// Load the page when n1 sees every member serving, at most three times.
	allServing := func() bool { return len(nd.Ring().View().Serving) == len(f.nodes) }
	var dom string
	for attempt := 1; ; attempt++ {
		waitFor(t, 30*time.Second, "every member serving in n1's view", allServing)
		dom = runChromium(t, bin, "--dump-dom", url)
		listed := true
		for _, m := range f.nodes {
			listed = listed && strings.Contains(dom, ">"+m.ID()+"</a>")
		}
		if listed || attempt == 3 {
			break
		}
		t.Logf("attempt %d: a member is missing from the page (the ring changed while Chromium started); loading it again", attempt)
	}
	checkStatusHTML(t, dom, f, nd)

	shot := filepath.Join(t.ArtifactDir(), "status-page.png")
	if p := os.Getenv("QUOTARING_STATUS_SCREENSHOT"); p != "" {
		shot, _ = filepath.Abs(p)
	}
	runChromium(t, bin, "--screenshot="+shot, "--window-size=1280,900", "--hide-scrollbars", url)
	st, err := os.Stat(shot)
	if err != nil || st.Size() < 10_000 {
		t.Fatalf("no screenshot at %s (%v)", shot, err)
	}
	b, _ := os.ReadFile(shot)
	if !strings.HasPrefix(string(b), "\x89PNG") {
		t.Fatalf("%s is not a PNG", shot)
	}
	t.Logf("screenshot of %s's status page: %s (%d bytes)", nd.ID(), shot, st.Size())
}

func findChromium() string {
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	return ""
}

// runChromium runs headless Chromium once and returns its stdout. The
// flags that turn off background networking matter here: without them
// Chromium's own connections are refused on a closed network and it stalls.
func runChromium(t *testing.T, bin string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	base := []string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
		"--user-data-dir=" + t.TempDir()}
	cmd := exec.CommandContext(ctx, bin, append(base, args...)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", bin, strings.Join(args, " "), err, tail(stderr.String(), 20))
	}
	return string(out)
}

func tail(s string, lines int) string {
	parts := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(parts) > lines {
		parts = parts[len(parts)-lines:]
	}
	return strings.Join(parts, "\n")
}

// A member that died or left is listed as gone on the others' pages, with
// how long: it vanished from them, with nothing to say a node was down.
func TestStatusPageListsGoneMembers(t *testing.T) {
	dsn := "sqlite:" + filepath.Join(t.TempDir(), "ledger.db")
	seedLedger(t, dsn, twentyAccounts(100))
	nodes := startNodesWith(t, dsn, nil, nil)
	n1, n2 := nodes[0], nodes[1]
	if err := n2.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "n2 gone from n1's ring", func() bool {
		return len(n1.Ring().View().Members) == 1 && len(n1.Ring().Gone()) == 1
	})
	resp, err := http.Get("http://" + n1.AdminAddr() + "/status")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	page := string(body)
	for _, want := range []string{"1 alive, 1 gone", "<td>n2</td>", `<span class="pill gone">gone</span>`, "(dead, or left the ring)"} {
		if !strings.Contains(page, want) {
			t.Errorf("n1's page lacks %q", want)
		}
	}
}
