package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/cluster"
)

func short(s string) string { return s[:min(len(s), 8)] }

// Report is a run's outcome: the verdict of every checker, what the
// workload saw, the faults as they were applied, and how to run it again.
type Report struct {
	Seed     uint64        `json:"seed"`
	Nodes    int           `json:"nodes"`
	Duration time.Duration `json:"duration_ns"`
	Faults   []Fault       `json:"faults"`
	// Command runs the same plan again (the interleavings differ: the nodes
	// are real processes).
	Command string    `json:"command"`
	Began   time.Time `json:"began"`
	Elapsed string    `json:"elapsed"`
	// Plan is the seeded schedule; Applied the faults as they really
	// happened (history time, ns since the workload began).
	Plan    string           `json:"plan"`
	Applied []cluster.Window `json:"applied"`
	Results []cluster.Result `json:"results"`
	// Offending shows the operations the violations name; Rows the ledger's
	// rows of the events they name ("account/event").
	Offending map[int]string              `json:"offending,omitempty"`
	Rows      map[string][]flush.EventRow `json:"rows,omitempty"`
	Workload  Workload                    `json:"workload"`
	Loss      Loss                        `json:"loss"`
	// Series counts answers per second of the run, by status.
	Series []Bucket  `json:"series"`
	Notes  []string  `json:"notes,omitempty"`
	Limits AcctNotes `json:"accounts"`
	// Interrupted says when the run was interrupted (its context ended):
	// then no check ran, Results is empty, and the rest is what was
	// recorded until then.
	Interrupted string `json:"interrupted,omitempty"`
	// Dir holds the nodes' data dirs and logs (n1.log, ...) when the run
	// keeps them: always with Config.Dir or Keep, and after a violation.
	Dir string `json:"dir,omitempty"`
}

// Workload sums the history.
type Workload struct {
	Ops     int                       `json:"ops"`
	ByState map[cluster.Status]int    `json:"by_status"`
	ByVia   map[string]map[string]int `json:"by_via"` // via -> status -> count
	Reasons map[string]int            `json:"reasons"`
}

// Loss is the documented loss of destroyed disks.
type Loss struct {
	Charges     int64 `json:"charges"`
	ChargeUnits int64 `json:"charge_units"`
	Refunds     int64 `json:"refunds"`
	RefundUnits int64 `json:"refund_units"`
	// Revoked are the reserved units quotad revoke freed (what may be let
	// through twice at most).
	Revoked int64 `json:"revoked_units"`
}

// AcctNotes describes the accounts of the workload.
type AcctNotes struct {
	Hard        int    `json:"hard"`
	Big         int    `json:"big"`
	Soft        int    `json:"soft"`
	RateLimited int    `json:"rate_limited"`
	HardQuota   int64  `json:"hard_quota"`
	Rate        string `json:"rate"`
}

// Bucket is one second of answers.
type Bucket struct {
	T       int `json:"t"`
	OK      int `json:"ok"`
	Refused int `json:"refused"`
	Unknown int `json:"unknown"`
}

// Violated reports whether any checker found a violation.
func (r *Report) Violated() bool { return len(cluster.Failed(r.Results)) > 0 }

func (h *harness) report(in *cluster.CheckInput, results []cluster.Result, began time.Time) *Report {
	r := &Report{Seed: h.cfg.Seed, Nodes: h.cfg.Nodes, Duration: h.cfg.Duration, Faults: h.cfg.Faults, Began: began.UTC(),
		Elapsed: time.Since(began).Round(time.Second).String(), Plan: h.plan.String(), Applied: h.windows, Results: results,
		Notes: h.notes, Dir: h.keptDir(),
		Limits: AcctNotes{Hard: len(h.acct.hard), Big: len(h.acct.big), Soft: len(h.acct.soft), RateLimited: len(h.acct.rl),
			HardQuota: h.acct.limits[h.acct.hard[0]].Quota, Rate: fmt.Sprintf("%d/s, burst %d", rlRate, rlBurst)}}
	r.Command = h.cfg.command()
	lost, _ := in.SplitLoss() // what the ledger's marks cover was not lost
	r.Loss.Charges, r.Loss.ChargeUnits, r.Loss.Refunds, r.Loss.RefundUnits = cluster.LossTotals(lost)
	r.Loss.Revoked = h.revoked
	r.Workload = summarize(in.Ops)
	r.Series = series(in.Ops)
	byID := map[int]*cluster.Op{}
	for i := range in.Ops {
		byID[in.Ops[i].ID] = &in.Ops[i]
	}
	for _, res := range results {
		for _, v := range res.Violations {
			if v.Event != "" && in.Ledger != nil {
				for _, e := range in.Ledger.Events[v.Account] {
					if cluster.BaseEventID(e.EventID) == v.Event {
						if r.Rows == nil {
							r.Rows = map[string][]flush.EventRow{}
						}
						r.Rows[v.Account+"/"+v.Event] = append(r.Rows[v.Account+"/"+v.Event], e)
					}
				}
			}
			for _, id := range v.Ops {
				if o, ok := byID[id]; ok {
					if r.Offending == nil {
						r.Offending = map[int]string{}
					}
					r.Offending[id] = o.String()
				}
			}
		}
	}
	return r
}

func summarize(ops []cluster.Op) Workload {
	w := Workload{Ops: len(ops), ByState: map[cluster.Status]int{}, ByVia: map[string]map[string]int{}, Reasons: map[string]int{}}
	for i := range ops {
		o := &ops[i]
		w.ByState[o.Status]++
		k := o.Kind + " via " + o.Via
		if w.ByVia[k] == nil {
			w.ByVia[k] = map[string]int{}
		}
		w.ByVia[k][string(o.Status)]++
		w.Reasons[o.Kind+": "+o.Reason]++
	}
	return w
}

func series(ops []cluster.Op) []Bucket {
	var out []Bucket
	for i := range ops {
		o := &ops[i]
		s := int(o.End / int64(time.Second))
		for len(out) <= s {
			out = append(out, Bucket{T: len(out)})
		}
		switch o.Status {
		case cluster.StatusOK:
			out[s].OK++
		case cluster.StatusRefused:
			out[s].Refused++
		default:
			out[s].Unknown++
		}
	}
	return out
}

// reportFiles are the files Write puts in --out (and checkDirs removes
// from it at the start of a run).
func reportFiles() []string {
	return []string{"report.json", "history.json", "report.svg", "report.md"}
}

// Write puts the report in dir: report.json (this report), history.json
// (every operation), report.svg (answers per second with the faults
// marked) and report.md (the table of invariants and the rest).
func (r *Report) Write(dir string, ops []cluster.Op) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	js, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	var hist bytes.Buffer
	if err := cluster.WriteOpsJSON(&hist, ops); err != nil {
		return err
	}
	names := reportFiles()
	for name, b := range map[string][]byte{names[0]: append(js, '\n'), names[1]: hist.Bytes(),
		names[2]: r.SVG(), names[3]: []byte(r.Markdown())} {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// Table is the table of invariants, as Markdown.
func (r *Report) Table() string {
	var b strings.Builder
	b.WriteString("| check | guarantee | verdict | what was checked |\n|---|---|---|---|\n")
	for _, res := range r.Results {
		v := res.Verdict
		if v == cluster.Violated {
			v = fmt.Sprintf("**VIOLATED** (%d)", res.Count)
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", res.ID, res.Name, v, escapePipes(res.Summary))
	}
	return b.String()
}

func escapePipes(s string) string { return strings.ReplaceAll(s, "|", "\\|") }

// Markdown is the whole report for people: the table, the violations with
// their first offending operations, the loss, the workload and the faults.
func (r *Report) Markdown() string {
	var b strings.Builder
	verdict := "every invariant held"
	switch {
	case r.Violated():
		verdict = "VIOLATIONS FOUND"
	case r.Interrupted != "":
		verdict = "INTERRUPTED, nothing checked"
	}
	fmt.Fprintf(&b, "# quotaring chaos report: %s\n\n", verdict)
	fmt.Fprintf(&b, "Seed %d, %d nodes, %s of faults (%s); began %s, took %s.\n\nReproduce the schedule: `%s`\n\n",
		r.Seed, r.Nodes, r.Duration, joinFaults(r.Faults), r.Began.Format(time.RFC3339), r.Elapsed, r.Command)
	b.WriteString("![answers per second, faults shaded](report.svg)\n\n")
	if r.Interrupted != "" {
		fmt.Fprintf(&b, "The run was %s. Below are the operations and faults recorded until then (`history.json` has every operation)", r.Interrupted)
		if r.Dir != "" {
			fmt.Fprintf(&b, "; the nodes' logs and data dirs are in `%s/nodes`, the ledger's dump in `%s/ledger.sql`", r.Dir, r.Dir)
		}
		b.WriteString(".\n")
	} else {
		b.WriteString(r.Table())
	}
	if r.Violated() {
		b.WriteString("\nWhat to do: each violation below names its first offending operations and the ledger's rows of its event. " +
			"`history.json` holds every operation (invoke and answer times, the way in, the deciding node, the answer)")
		if r.Dir != "" {
			fmt.Fprintf(&b, "; the nodes' logs (`n1.log`, ...) and data dirs are in `%s/nodes`, the ledger (a `pg_dump`: "+
				"`createdb chaos && psql -d chaos -f %s/ledger.sql`) in `%s/ledger.sql`", r.Dir, r.Dir, r.Dir)
		}
		b.WriteString(". Look for the event id and the account in the logs of the nodes that decided it around the operations' times, " +
			"and rerun the schedule with the command above: the interleavings are the processes' own, so a rerun may hold. " +
			"Keep this directory with the logs when you report it.\n")
	}
	for _, res := range r.Results {
		if res.Verdict != cluster.Violated {
			continue
		}
		fmt.Fprintf(&b, "\n## %s violated: %s (%d)\n\n", res.ID, res.Name, res.Count)
		for _, v := range res.Violations {
			who := strings.TrimSpace(v.Account + " " + v.Event)
			if who != "" {
				who += ": "
			}
			fmt.Fprintf(&b, "- %s%s\n", who, v.Detail)
			for _, id := range v.Ops {
				if s, ok := r.Offending[id]; ok {
					fmt.Fprintf(&b, "  - `%s`\n", s)
				}
			}
			for _, e := range r.Rows[v.Account+"/"+v.Event] {
				fmt.Fprintf(&b, "  - ledger row: %s/%s seq %d, %d units in %s, charged %s, refunded %v, tombstone %v\n",
					e.Node, short(e.Incarnation), e.Seq, e.Units, e.Period, e.ChargedAt.UTC().Format(time.RFC3339Nano), e.Refunded, e.Tombstone)
			}
		}
	}
	fmt.Fprintf(&b, "\n## Documented loss\n\nDestroyed disks held %d unsettled charges (%d units, in the customer's favour) and %d unsettled refunds (%d units); `quotad revoke` freed %d reserved units.\n",
		r.Loss.Charges, r.Loss.ChargeUnits, r.Loss.Refunds, r.Loss.RefundUnits, r.Loss.Revoked)
	fmt.Fprintf(&b, "\n## Workload\n\n%d hard accounts (quota %d a month), %d big hard accounts, %d soft accounts, %d rate-limited accounts (%s).\n\n",
		r.Limits.Hard, r.Limits.HardQuota, r.Limits.Big, r.Limits.Soft, r.Limits.RateLimited, r.Limits.Rate)
	fmt.Fprintf(&b, "%d operations: %d ok, %d refused, %d unknown.\n\n| operation | ok | refused | unknown |\n|---|---|---|---|\n",
		r.Workload.Ops, r.Workload.ByState[cluster.StatusOK], r.Workload.ByState[cluster.StatusRefused], r.Workload.ByState[cluster.StatusUnknown])
	for _, k := range sortedKeys(r.Workload.ByVia) {
		m := r.Workload.ByVia[k]
		fmt.Fprintf(&b, "| %s | %d | %d | %d |\n", k, m["ok"], m["refused"], m["unknown"])
	}
	b.WriteString("\n| answer | count |\n|---|---|\n")
	for _, k := range sortedKeys(r.Workload.Reasons) {
		fmt.Fprintf(&b, "| %s | %d |\n", k, r.Workload.Reasons[k])
	}
	b.WriteString("\n## Faults as applied\n\n| from | to | fault | node |\n|---|---|---|---|\n")
	for _, w := range r.Applied {
		fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", clock(time.Duration(w.Start)), clock(time.Duration(w.End)), w.Kind, w.Node)
	}
	fmt.Fprintf(&b, "\n## Plan\n\n```\n%s```\n", r.Plan)
	for _, n := range r.Notes {
		fmt.Fprintf(&b, "\nNote: %s\n", n)
	}
	return b.String()
}

func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

// startProgress prints a line every ProgressEvery until ctx ends.
func (h *harness) startProgress(ctx context.Context) *sync.WaitGroup {
	last := 0
	return h.every(ctx, func() {
		ops := h.hist.Ops()
		w := summarize(ops)
		rate := float64(len(ops)-last) / h.cfg.ProgressEvery.Seconds()
		last = len(ops)
		h.logf("%s/%s  %d ops (ok %d, refused %d, unknown %d), %.0f/s; faults on: %s",
			clock(time.Duration(h.hist.Now())), clock(h.cfg.Duration), w.Ops, w.ByState[cluster.StatusOK],
			w.ByState[cluster.StatusRefused], w.ByState[cluster.StatusUnknown], rate, h.activeNames())
	})
}

// every runs f every ProgressEvery, in a goroutine of its own, until ctx
// ends; the group is done once it has stopped.
func (h *harness) every(ctx context.Context, f func()) *sync.WaitGroup {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(h.cfg.ProgressEvery)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				f()
			}
		}
	}()
	return &wg
}
