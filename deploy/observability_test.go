package deploy

// The alert rules and the dashboard name only metrics that nodes export.
// metrics.txt is that list; a test that scrapes a running node holds the
// list to what it really exports.

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"text/template"
	"time"

	"sigs.k8s.io/yaml"
)

// exportedMetrics reads metrics.txt: one metric name per line.
func exportedMetrics(t *testing.T) map[string]bool {
	t.Helper()
	b, err := os.ReadFile("metrics.txt")
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for i, l := range strings.Split(strings.TrimRight(string(b), "\n"), "\n") {
		if !metricName.MatchString(l) || metricName.FindString(l) != l {
			t.Errorf("metrics.txt:%d: %q is not a quotaring_ metric name alone on its line", i+1, l)
		}
		if names[l] {
			t.Errorf("metrics.txt:%d: %s listed twice", i+1, l)
		}
		names[l] = true
	}
	return names
}

var metricName = regexp.MustCompile(`quotaring_[a-z0-9_]+`)

// selector is a quotaring metric with its label matchers, if any.
var selector = regexp.MustCompile(`(quotaring_[a-z0-9_]+)(\{[^}]*\})?`)

// histogramSuffixes are the series a histogram exports besides its name.
var histogramSuffixes = []string{"_bucket", "_sum", "_count"}

// checkExpr checks the quotaring_ metrics one PromQL expression names: each
// is exported (a histogram's series by its base name), rate-like functions
// take counters or histogram series, and deriv takes gauges. It returns the
// base names used.
func checkExpr(t *testing.T, where, expr string, exported map[string]bool) []string {
	t.Helper()
	var used []string
	for _, loc := range metricName.FindAllStringIndex(expr, -1) {
		name := expr[loc[0]:loc[1]]
		base := name
		if !exported[name] {
			for _, suf := range histogramSuffixes {
				if b, ok := strings.CutSuffix(name, suf); ok && exported[b] && !strings.HasSuffix(b, "_total") {
					base = b
				}
			}
		}
		if !exported[base] {
			t.Errorf("%s: %s is not in metrics.txt (the metrics nodes export)", where, name)
			continue
		}
		used = append(used, base)
		// The function applied to this selector: the nearest open call
		// before it.
		fn := enclosingFunc(expr[:loc[0]])
		counterLike := strings.HasSuffix(name, "_total") || base != name
		switch fn {
		case "rate", "irate", "increase":
			if !counterLike {
				t.Errorf("%s: %s(%s...): a gauge; rate and increase are for counters and histogram series", where, fn, name)
			}
		case "deriv", "delta", "predict_linear":
			if counterLike {
				t.Errorf("%s: %s(%s...): a counter; %s is for gauges", where, fn, name, fn)
			}
		}
		if strings.HasSuffix(name, "_bucket") && !strings.Contains(expr, "histogram_quantile") {
			t.Errorf("%s: %s outside histogram_quantile", where, name)
		}
	}
	depth := 0
	for _, r := range expr {
		switch r {
		case '(', '[', '{':
			depth++
		case ')', ']', '}':
			depth--
		}
		if depth < 0 {
			break
		}
	}
	if depth != 0 || strings.Count(expr, `"`)%2 != 0 {
		t.Errorf("%s: unbalanced brackets or quotes in %q", where, expr)
	}
	return used
}

var funcCall = regexp.MustCompile(`([a-z_]+)\s*\($`)

// enclosingFunc names the function whose argument list is open at the end of
// prefix (rate in "sum(rate(" ), or "".
func enclosingFunc(prefix string) string {
	depth := 0
	for i := len(prefix) - 1; i >= 0; i-- {
		switch prefix[i] {
		case ')':
			depth++
		case '(':
			if depth == 0 {
				if m := funcCall.FindStringSubmatch(prefix[:i+1]); m != nil {
					return m[1]
				}
				return ""
			}
			depth--
		}
	}
	return ""
}

func TestMetricsList(t *testing.T) {
	names := exportedMetrics(t)
	if len(names) != 54 {
		t.Errorf("metrics.txt lists %d metrics, want the 28 of issue 7, the config snapshot's age, the replays served free, the 8 of quota alerts, the clock offset, step and tolerance, the build, the reconcile's errors and last success, the RPC calls refused both ways and the RPC handshakes refused, the pauses noticed and held against, the reservation calls timed out, the units in doubt and those stranded, the ring members of another config, and the certificates' expiry", len(names))
	}
	// README.md's table says what each one means: four were missing.
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	for m := range names {
		if !strings.Contains(string(readme), "| `"+m) && !strings.Contains(string(readme), ", `"+m) {
			t.Errorf("README.md: metric %s is not in the metrics table", m)
		}
	}
}

// ruleFile is the Prometheus rule file format, decoded strictly.
type ruleFile struct {
	Groups []struct {
		Name     string `json:"name"`
		Interval string `json:"interval,omitempty"`
		Rules    []struct {
			Alert         string            `json:"alert,omitempty"`
			Record        string            `json:"record,omitempty"`
			Expr          string            `json:"expr"`
			For           string            `json:"for,omitempty"`
			KeepFiringFor string            `json:"keep_firing_for,omitempty"`
			Labels        map[string]string `json:"labels,omitempty"`
			Annotations   map[string]string `json:"annotations,omitempty"`
		} `json:"rules"`
	} `json:"groups"`
}

func TestAlertRules(t *testing.T) {
	exported := exportedMetrics(t)
	path := filepath.Join("prometheus", "alerts.yaml")
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var rf ruleFile
	if err := yaml.UnmarshalStrict(b, &rf); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	// Prometheus expands annotations as Go templates with these functions
	// (among others); parsing catches broken {{ }}.
	funcs := template.FuncMap{}
	for _, f := range []string{"humanize", "humanize1024", "humanizeDuration", "humanizePercentage", "humanizeTimestamp",
		"title", "toUpper", "toLower", "first", "label", "value", "query", "args", "reReplaceAll", "match",
		"graphLink", "tableLink", "sortByLabel", "stripPort", "stripDomain", "pathPrefix", "externalURL", "safeHtml"} {
		funcs[f] = fmtAny
	}
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	alerts := map[string]bool{}
	usedBy := map[string][]string{} // metric -> alerts
	for _, g := range rf.Groups {
		for _, r := range g.Rules {
			where := path + ": " + r.Alert
			if r.Alert == "" {
				t.Errorf("%s: group %s has a rule that is not an alert (%q)", path, g.Name, r.Expr)
				continue
			}
			if alerts[r.Alert] {
				t.Errorf("%s: alert %s defined twice", path, r.Alert)
			}
			alerts[r.Alert] = true
			if !strings.Contains(string(readme), "| "+r.Alert+" |") {
				t.Errorf("README.md: alert %s is not in the alerts table", r.Alert)
			}
			if r.For != "" {
				if _, err := time.ParseDuration(r.For); err != nil {
					t.Errorf("%s: for %q: %v", where, r.For, err)
				}
			}
			if s := r.Labels["severity"]; !slices.Contains([]string{"critical", "warning", "info"}, s) {
				t.Errorf("%s: severity %q: want critical, warning or info", where, s)
			}
			for _, a := range []string{"summary", "description"} {
				text := strings.TrimSpace(r.Annotations[a])
				if text == "" {
					t.Errorf("%s: no %s annotation", where, a)
					continue
				}
				// Prometheus defines these variables before the text.
				const defs = "{{$labels := .Labels}}{{$externalLabels := .ExternalLabels}}{{$externalURL := .ExternalURL}}{{$value := .Value}}"
				if _, err := template.New(a).Funcs(funcs).Parse(defs + text); err != nil {
					t.Errorf("%s: %s annotation: %v", where, a, err)
				}
			}
			// The description tells the operator what to do, not only what
			// happened.
			if d := r.Annotations["description"]; len(d) < 150 {
				t.Errorf("%s: description of %d characters: say what to check and do", where, len(d))
			}
			for _, m := range checkExpr(t, where, r.Expr, exported) {
				usedBy[m] = append(usedBy[m], r.Alert)
			}
			// instance is the pod's name, the same in every cluster's
			// namespace (quotad-0): grouping or matching by it alone mixes
			// two clusters that one Prometheus scrapes.
			for _, g := range byLabels.FindAllStringSubmatch(r.Expr, -1) {
				labels := strings.Split(strings.ReplaceAll(g[2], " ", ""), ",")
				if slices.Contains(labels, "instance") && !slices.Contains(labels, "namespace") {
					t.Errorf("%s: %s (%s) without namespace: two clusters' %s would mix", where, g[1], g[2], "quotad-0")
				}
			}
		}
	}
	// The alerts issue 7 asks for, by what they watch.
	// And settle lag: a ledger that hung (no error) stalled every node's
	// settles for 72 s in the SRE review with nothing that would page.
	for _, m := range []string{"quotaring_ledger_up", "quotaring_unsettled_records", "quotaring_settle_errors_total",
		"quotaring_reconcile_differences", "quotaring_ready", "quotaring_settle_lag_seconds"} {
		if len(usedBy[m]) == 0 {
			t.Errorf("%s: no alert on %s", path, m)
		}
	}
	// The job the rules select is the one the README's scrape config names
	// (a rule on another job never fires, or fires for ever).
	jobName := regexp.MustCompile(`(?m)^\s*- job_name:\s*(\S+)`).FindSubmatch(readme)
	if jobName == nil {
		t.Fatal("README.md: no Prometheus scrape config with a job_name")
	}
	for _, m := range regexp.MustCompile(`job="([^"]*)"`).FindAllStringSubmatch(string(b), -1) {
		if m[1] != string(jobName[1]) {
			t.Errorf("%s selects job=%q, but the README's scrape config names the job %s", path, m[1], jobName[1])
		}
	}
	if p, err := exec.LookPath("promtool"); err == nil {
		if out, err := exec.Command(p, "check", "rules", path).CombinedOutput(); err != nil {
			t.Errorf("promtool check rules %s: %v\n%s", path, err, out)
		}
	} else {
		t.Logf("NOTE: promtool is not on PATH: the PromQL is checked for metric names, function use and brackets only")
	}
}

// byLabels finds the label lists of by (...), without (...), on (...) and
// ignoring (...) in PromQL.
var byLabels = regexp.MustCompile(`\b(by|on|without|ignoring)\s*\(([^)]*)\)`)

func fmtAny(...any) string { return "" }

// dashboard is the part of a Grafana dashboard JSON the test reads.
type dashboard struct {
	Title      string `json:"title"`
	UID        string `json:"uid"`
	Templating struct {
		List []struct {
			Name       string          `json:"name"`
			Type       string          `json:"type"`
			Query      json.RawMessage `json:"query"`
			Datasource *datasourceRef  `json:"datasource"`
		} `json:"list"`
	} `json:"templating"`
	Panels []panel `json:"panels"`
}

type panel struct {
	ID         int            `json:"id"`
	Type       string         `json:"type"`
	Title      string         `json:"title"`
	Datasource *datasourceRef `json:"datasource"`
	GridPos    *struct {
		H, W, X, Y int
	} `json:"gridPos"`
	Targets []struct {
		Expr       string         `json:"expr"`
		RefID      string         `json:"refId"`
		Datasource *datasourceRef `json:"datasource"`
	} `json:"targets"`
	Panels []panel `json:"panels"` // a collapsed row's
}

type datasourceRef struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

func TestDashboard(t *testing.T) {
	exported := exportedMetrics(t)
	path := filepath.Join("grafana", "quotaring.json")
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	if d.Title == "" || d.UID == "" {
		t.Errorf("%s: want a title and a uid", path)
	}
	var dsVar string
	for _, v := range d.Templating.List {
		if v.Type == "datasource" && strings.Contains(string(v.Query), "prometheus") {
			dsVar = v.Name
		}
	}
	if dsVar == "" {
		t.Fatalf("%s: no datasource template variable of type prometheus", path)
	}
	wantDS := "${" + dsVar + "}"
	for _, v := range d.Templating.List {
		if v.Type == "query" && (v.Datasource == nil || v.Datasource.UID != wantDS) {
			t.Errorf("%s: variable %s does not query the %s data source", path, v.Name, wantDS)
		}
	}
	used := map[string]bool{}
	ids := map[int]bool{}
	var walk func(ps []panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			where := path + ": panel " + p.Title
			if ids[p.ID] {
				t.Errorf("%s: id %d used twice", where, p.ID)
			}
			ids[p.ID] = true
			if p.GridPos == nil || p.GridPos.W == 0 || p.GridPos.H == 0 {
				t.Errorf("%s: no gridPos", where)
			}
			walk(p.Panels)
			if p.Type == "row" {
				continue
			}
			if p.Datasource == nil || p.Datasource.UID != wantDS {
				t.Errorf("%s: data source %+v, want uid %s", where, p.Datasource, wantDS)
			}
			if len(p.Targets) == 0 {
				t.Errorf("%s: no queries", where)
			}
			for _, tg := range p.Targets {
				if tg.Datasource != nil && tg.Datasource.UID != wantDS {
					t.Errorf("%s: query %s data source %+v, want uid %s", where, tg.RefID, tg.Datasource, wantDS)
				}
				if !strings.Contains(tg.Expr, "quotaring_") {
					t.Errorf("%s: query %q names no quotaring metric", where, tg.Expr)
				}
				// Every selector is filtered by the job, namespace and
				// instance variables: pods scraped by two jobs (a dedicated
				// one and an annotation-based one) summed twice, and two
				// clusters' quotad-0 mixed.
				for _, m := range selector.FindAllStringSubmatch(tg.Expr, -1) {
					for _, v := range []string{`job=~"$job"`, `namespace=~"$namespace"`, `instance=~"$instance"`} {
						if !strings.Contains(m[2], v) {
							t.Errorf("%s: %s%s: no %s", where, m[1], m[2], v)
						}
					}
				}
				for _, m := range checkExpr(t, where, tg.Expr, exported) {
					used[m] = true
				}
			}
		}
	}
	walk(d.Panels)
	// Every exported metric has a place on the dashboard.
	for _, m := range keys(exported) {
		if !used[m] {
			t.Errorf("%s: no panel shows %s", path, m)
		}
	}
}
