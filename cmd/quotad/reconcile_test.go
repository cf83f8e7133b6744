package main

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/quotaring/quotaring/engine"
	"github.com/quotaring/quotaring/flush"
	"github.com/quotaring/quotaring/internal/dirsnap"
	"github.com/quotaring/quotaring/shard"
	"github.com/quotaring/quotaring/wal"
)

// reconcile --data-dir inspects a stopped node's dir as evidence: it lists
// the unsettled charges and leaves every file byte-identical. A read-write
// open would flush Pebble's WAL into a new sstable, MANIFEST and WAL.
func TestReconcileLeavesTheDataDirUnchanged(t *testing.T) {
	ctx := context.Background()
	ledger := migratedSQLite(t)

	// A node killed with 5 charges of 3 units unsettled: a copy of its dir
	// taken while its log is open holds them only in Pebble's WAL.
	live := filepath.Join(t.TempDir(), "q1")
	log, err := wal.Open(wal.Options{Dir: live, NodeID: "q1"})
	if err != nil {
		t.Fatal(err)
	}
	for range 5 {
		rec := shard.Record{Type: shard.RecCharge, Account: "acct-1", Units: 3}
		seq, err := log.Append(rec.AppendEncode(nil))
		if err == nil {
			err = log.WaitDurable(ctx, seq)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	dir := filepath.Join(t.TempDir(), "q1-stopped")
	if err := os.CopyFS(dir, os.DirFS(live)); err != nil {
		t.Fatal(err)
	}
	if err := log.Close(); err != nil {
		t.Fatal(err)
	}
	before := dirsnap.Take(t, dir)

	var out bytes.Buffer
	if err := runReconcile(ctx, &out, &out, "sqlite:"+ledger, []string{dir}, false); err != nil {
		t.Fatalf("reconcile: %v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "acct-1: +15 units pending") {
		t.Errorf("reconcile did not list the unsettled charges:\n%s", out.String())
	}
	before.Unchanged(t, dir, "reconcile")
}

// reconcile and revoke refuse a ledger a newer quotad migrated, as serve
// and migrate do: an older binary must not write to a schema it does not
// know, nor read one it would misread.
func TestLedgerCommandsRefuseANewerSchema(t *testing.T) {
	path := migratedSQLite(t)
	db, err := sql.Open("sqlite", path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec("INSERT INTO schema_migrations (version, applied_at) VALUES (999, 0)"); err != nil {
		t.Fatal(err)
	}
	db.Close()
	for _, args := range [][]string{{"reconcile", "--ledger", "sqlite:" + path}, {"revoke", "--ledger", "sqlite:" + path, "--node", "n1", "--force"}} {
		_, err := runQuotad(t, args...)
		if !errors.Is(err, flush.ErrSchemaTooNew) || !strings.Contains(err.Error(), "run a newer quotad") {
			t.Errorf("quotad %s on a ledger at schema 999: %v; want ErrSchemaTooNew saying to run a newer quotad", args[0], err)
		}
	}
}

// migratedSQLite makes an empty, migrated SQLite ledger and returns its path.
func migratedSQLite(t *testing.T) string {
	t.Helper()
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "ledger.db")
	l, err := flush.OpenSQLite(ctx, path, flush.SQLiteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	return path
}

// quotad reconcile streams its rows: more differences than one aligned
// block (reconcileBlock) are all printed, each once, with --all, the count
// is right, and the exit code is 3.
func TestReconcilePrintsEveryDifference(t *testing.T) {
	path := migratedSQLite(t)
	db, err := sql.Open("sqlite", path)
	if err != nil {
		t.Fatal(err)
	}
	const n = reconcileBlock + 7
	// Daily usage with no event behind it: one difference per account.
	if _, err := db.Exec(`WITH RECURSIVE i(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM i WHERE x < ?)
		INSERT INTO usage_daily (account_id, key_id, route, day, units, requests)
		SELECT printf('acct-%05d', x), 'k', 'GET /x', '2026-06-15', 3, 1 FROM i`, n); err != nil {
		t.Fatal(err)
	}
	db.Close()
	var out bytes.Buffer
	root := newRootCmd()
	root.SetArgs([]string{"reconcile", "--ledger", "sqlite:" + path, "--all"})
	root.SetOut(&out)
	root.SetErr(&out)
	err = root.ExecuteContext(context.Background())
	var exit *exitError
	if !errors.As(err, &exit) || exit.code != 3 {
		t.Fatalf("reconcile of %d differences: %v, want exit code 3", n, err)
	}
	text := out.String()
	for _, a := range []string{"acct-00001", fmt.Sprintf("acct-%05d", reconcileBlock), fmt.Sprintf("acct-%05d", reconcileBlock+1), fmt.Sprintf("acct-%05d", n)} {
		if c := strings.Count(text, a+" "); c != 1 {
			t.Errorf("%s printed %d times, want once", a, c)
		}
	}
	if !strings.Contains(text, fmt.Sprintf("%d rows compared, %d differences", n, n)) {
		t.Errorf("summary missing or wrong:\n%s", text[max(0, len(text)-300):])
	}
}

// A data dir restored from a copy older than the ledger, started while the
// ledger was down: its first records are the original dir's, which the
// ledger settled from there; the ones it took since sit under sequence
// numbers the ledger settled for other charges. reconcile --data-dir listed
// all of them as "not settled yet", and billing them by hand billed the
// first ones twice. It tells them apart from what the node recorded when it
// found the conflict, and lists the ones to bill, record by record.
func TestReconcileTellsAStaleDirsBilledRecordsFromTheOnesToBill(t *testing.T) {
	ctx := context.Background()
	path := migratedSQLite(t)
	dir := filepath.Join(t.TempDir(), "q1")
	period := shard.PeriodOf(time.Date(2026, 6, 15, 0, 0, 0, 0, time.UTC).UnixNano())
	appendCharges := func(log *wal.Log, account string, units int64, n int) {
		t.Helper()
		for i := range n {
			rec := shard.Record{Type: shard.RecCharge, Account: account, EventID: fmt.Sprint(account, "-", log.LastSeq()+1, "-", i), Units: units,
				Key: "k1", Route: "GET /x", Period: period, Wall: period.Start()}
			seq, err := log.Append(rec.AppendEncode(nil))
			if err == nil {
				err = log.WaitDurable(ctx, seq)
			}
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	log, err := wal.Open(wal.Options{Dir: dir, NodeID: "q1"})
	if err != nil {
		t.Fatal(err)
	}
	appendCharges(log, "acct-1", 3, 5) // the copy's records 1..5
	if err := log.Close(); err != nil {
		t.Fatal(err)
	}
	// The copy, started with the ledger down: 4 more charges, 6..9.
	log, err = wal.Open(wal.Options{Dir: dir, NodeID: "q1"})
	if err != nil {
		t.Fatal(err)
	}
	appendCharges(log, "acct-1", 1, 1)
	appendCharges(log, "acct-2", 7, 3)
	// The ledger settled the original dir to 7, then the copy reaches it.
	l, err := flush.OpenSQLite(ctx, path, flush.SQLiteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if _, err := l.RegisterNode(ctx, "q1", log.Incarnation()); err != nil {
		t.Fatal(err)
	}
	if res, err := l.Settle(ctx, &flush.Batch{Node: "q1", Incarnation: log.Incarnation(), Prev: 0, Next: 7, Events: true}); err != nil || !res.Applied {
		t.Fatalf("the original dir's settle: %+v, %v", res, err)
	}
	e, err := engine.Open(engine.Options{Log: log})
	if err != nil {
		t.Fatal(err)
	}
	s, err := flush.NewSettler(flush.SettlerOptions{Ledger: l, Engine: e})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Register(ctx); !errors.Is(err, flush.ErrStaleDataDir) {
		t.Fatalf("Register: %v; want ErrStaleDataDir", err)
	}
	e.Close()
	if err := log.Close(); err != nil {
		t.Fatal(err)
	}
	before := dirsnap.Take(t, dir)

	var out bytes.Buffer
	if err := runReconcile(ctx, &out, &out, "sqlite:"+path, []string{dir}, false); err != nil {
		t.Fatalf("reconcile: %v\n%s", err, out.String())
	}
	got := out.String()
	for _, want := range []string{
		"9 records not settled yet",
		"records 1 to 5: in the dir when it was restored, and settled by the ledger from the original dir: already billed, do not bill them again\n    acct-1 2026-06: +15 units billed already\n",
		"records 6 to 9: charges taken since, under sequence numbers the ledger settled for other charges: in no ledger, BILL THEM BY HAND\n" +
			"    acct-1 2026-06: +1 units to bill by hand\n    acct-2 2026-06: +21 units to bill by hand\n",
		"    seq 6  charge  acct-1  month 2026-06",
		"    seq 9  charge  acct-2  month 2026-06",
		"then run quotad revoke --node q1",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("reconcile --data-dir on a stale dir does not say\n%s\nin\n%s", want, got)
		}
	}
	if strings.Contains(got, "units pending") || strings.Contains(got, "seq 5 ") {
		t.Errorf("reconcile lists the records the ledger billed as ones to bill:\n%s", got)
	}
	before.Unchanged(t, dir, "reconcile")
}

// A node stopped between a settle's commit and its local mark: the ledger
// settled records its dir still holds. They are billed already; reconcile
// says so instead of counting them as pending.
func TestReconcileCountsRecordsTheLedgerSettledAsBilled(t *testing.T) {
	path, dir := reconcileDir(t, 5, 3)
	var out bytes.Buffer
	if err := runReconcile(context.Background(), &out, &out, "sqlite:"+path, []string{dir}, false); err != nil {
		t.Fatalf("reconcile: %v\n%s", err, out.String())
	}
	if want := "records 1 to 3: settled by the ledger"; !strings.Contains(out.String(), want) || !strings.Contains(out.String(), "\n  acct-1: +4 units pending\n") {
		t.Errorf("reconcile does not say %q and acct-1: +4 units pending:\n%s", want, out.String())
	}
}

// reconcileDir makes a stopped node q1's data dir holding records charges
// of 2 units to acct-1, and a migrated SQLite ledger that settled its
// incarnation to settled (beyond the log's end when settled > records).
// appendCharges logs n durable charges of units each to acct-1 (event ids
// e0, e1, ...).
func appendCharges(t *testing.T, log *wal.Log, n int, units int64) {
	t.Helper()
	for i := range n {
		rec := shard.Record{Type: shard.RecCharge, Account: "acct-1", EventID: fmt.Sprint("e", i), Units: units}
		seq, err := log.Append(rec.AppendEncode(nil))
		if err == nil {
			err = log.WaitDurable(context.Background(), seq)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

func reconcileDir(t *testing.T, records int, settled uint64) (path, dir string) {
	t.Helper()
	ctx := context.Background()
	path = migratedSQLite(t)
	dir = filepath.Join(t.TempDir(), "q1")
	log, err := wal.Open(wal.Options{Dir: dir, NodeID: "q1"})
	if err != nil {
		t.Fatal(err)
	}
	appendCharges(t, log, records, 2)
	l, err := flush.OpenSQLite(ctx, path, flush.SQLiteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if _, err := l.RegisterNode(ctx, "q1", log.Incarnation()); err != nil {
		t.Fatal(err)
	}
	if res, err := l.Settle(ctx, &flush.Batch{Node: "q1", Incarnation: log.Incarnation(), Prev: 0, Next: settled, Events: true}); err != nil || !res.Applied {
		t.Fatalf("settle (0, %d]: %+v, %v", settled, res, err)
	}
	if err := log.Close(); err != nil {
		t.Fatal(err)
	}
	return path, dir
}

// A dir older than the ledger that no node started on (so nothing recorded
// where its own records end): the ledger's mark is past the log's end, and
// its records cannot be told billed from not. They were summed as "units
// pending", and an operator billing those billed some twice.
func TestReconcileDoesNotCallAnOlderDirsRecordsPending(t *testing.T) {
	path, dir := reconcileDir(t, 3, 5)
	var out bytes.Buffer
	if err := runReconcile(context.Background(), &out, &out, "sqlite:"+path, []string{dir}, false); err != nil {
		t.Fatalf("reconcile: %v\n%s", err, out.String())
	}
	if got := out.String(); strings.Contains(got, "units pending") || !strings.Contains(got, "+6 units billed already or to bill by hand") {
		t.Errorf("reconcile of a dir older than the ledger:\n%s\nwant its 6 units as not told apart, not pending", got)
	}
}

// A dir that settled into another ledger, given with a ledger that never
// saw its node: its records were listed as "units pending" (settled at
// the next start), which that ledger would refuse. It is an error naming
// the likely mistake. A dir that never reached any ledger is listed, with
// a note that this ledger has not seen it.
func TestReconcileDirOfAnotherLedger(t *testing.T) {
	ctx := context.Background()
	fresh := migratedSQLite(t)
	dir := filepath.Join(t.TempDir(), "q9")
	log, err := wal.Open(wal.Options{Dir: dir, NodeID: "q9"})
	if err != nil {
		t.Fatal(err)
	}
	appendCharges(t, log, 4, 2)
	if err := log.Close(); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := runReconcile(ctx, &out, &out, "sqlite:"+fresh, []string{dir}, false); err != nil || !strings.Contains(out.String(), "this ledger has never seen the dir's incarnation") {
		t.Errorf("reconcile of a dir that reached no ledger yet: %v\n%s\nwant it listed with a note", err, out.String())
	}
	if log, err = wal.Open(wal.Options{Dir: dir, NodeID: "q9"}); err != nil {
		t.Fatal(err)
	}
	if err := log.Settle(2, nil); err != nil { // it settled into another ledger
		t.Fatal(err)
	}
	if err := log.Close(); err != nil {
		t.Fatal(err)
	}
	out.Reset()
	err = runReconcile(ctx, &out, &out, "sqlite:"+fresh, []string{dir}, false)
	if err == nil || !strings.Contains(out.String()+err.Error(), "is most likely not the ledger this node settles into") || strings.Contains(out.String(), "units pending") {
		t.Fatalf("reconcile of a dir of another ledger: %v\n%s\nwant an error naming the likely mistake, no units pending", err, out.String())
	}
}

// A --data-dir that cannot be read does not hide the ledger's verdict: the
// summary is printed and a difference still exits 3 (it was exit 1 with no
// summary).
func TestReconcileBadDirKeepsTheVerdict(t *testing.T) {
	path := migratedSQLite(t)
	db, err := sql.Open("sqlite", path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`INSERT INTO usage_daily (account_id, key_id, route, day, units, requests) VALUES ('acct-1', 'k', 'GET /x', '2026-06-15', 3, 1)`); err != nil {
		t.Fatal(err)
	}
	db.Close()
	var out bytes.Buffer
	err = runReconcile(context.Background(), &out, &out, "sqlite:"+path, []string{filepath.Join(t.TempDir(), "nope")}, false)
	var exit *exitError
	if !errors.As(err, &exit) || exit.code != 3 || !strings.Contains(err.Error(), "could not list") || !strings.Contains(out.String(), "1 differences") {
		t.Fatalf("reconcile with a difference and a bad --data-dir: %v\n%s\nwant exit 3, the summary and the dir's error", err, out.String())
	}
	// The dir's reason is told once, in the report, not again in the error.
	if n := strings.Count(out.String()+err.Error(), "does not exist"); n != 1 {
		t.Errorf("the dir's reason is told %d times, want once:\n%s\nerror: %v", n, out.String(), err)
	}
}

// A dir whose node found that another process had started as it on a copy
// of the dir: reconcile --data-dir tells, record by record, the charges the
// ledger billed (the records the copy held too, settled by the other
// process) from those in no ledger (taken since the copy), from the
// ledger's event log; and warns off a revoke, which would free the other
// process's reservations.
func TestReconcileTellsACopysBilledRecordsFromItsOwn(t *testing.T) {
	ctx := context.Background()
	path := migratedSQLite(t)
	period := shard.PeriodOf(time.Now().UnixNano())
	logCharges := func(log *wal.Log, prefix string, n int) {
		t.Helper()
		for i := range n {
			rec := shard.Record{Type: shard.RecCharge, Account: "acct-1", EventID: fmt.Sprint(prefix, "-", i), Units: 2,
				Key: "k1", Route: "GET /x", Period: period, Wall: time.Now().UnixNano()}
			seq, err := log.Append(rec.AppendEncode(nil))
			if err == nil {
				err = log.WaitDurable(ctx, seq)
			}
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	dirA := filepath.Join(t.TempDir(), "q1")
	log, err := wal.Open(wal.Options{Dir: dirA, NodeID: "q1"})
	if err != nil {
		t.Fatal(err)
	}
	logCharges(log, "orig", 3) // both dirs' records 1..3
	if err := log.Close(); err != nil {
		t.Fatal(err)
	}
	dirB := filepath.Join(t.TempDir(), "copy")
	if out, err := exec.Command("cp", "-a", dirA, dirB).CombinedOutput(); err != nil {
		t.Fatalf("cp -a: %v: %s", err, out)
	}
	l, err := flush.OpenSQLite(ctx, path, flush.SQLiteOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	open := func(dir, process string) (*wal.Log, *engine.Engine, *flush.Settler) {
		log, err := wal.Open(wal.Options{Dir: dir, NodeID: "q1"})
		if err != nil {
			t.Fatal(err)
		}
		e, err := engine.Open(engine.Options{Log: log})
		if err != nil {
			t.Fatal(err)
		}
		s, err := flush.NewSettler(flush.SettlerOptions{Ledger: l, Engine: e, Events: true, Start: flush.NodeStart{Process: process}})
		if err == nil {
			err = s.Register(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
		return log, e, s
	}
	logA, eA, sA := open(dirA, "proc-a")
	logB, eB, sB := open(dirB, "proc-b")
	defer func() { eB.Close(); logB.Close() }()
	logCharges(logA, "a", 2) // A's own, 4..5
	logCharges(logB, "b", 2) // B's own, 4..5
	if _, err := sA.SettleOnce(ctx); !errors.Is(err, flush.ErrOtherProcess) {
		t.Fatalf("A's settle: %v, want ErrOtherProcess", err)
	}
	eA.Close()
	if err := logA.Close(); err != nil {
		t.Fatal(err)
	}
	reconcile := func() string {
		t.Helper()
		var out bytes.Buffer
		if err := runReconcile(ctx, &out, &out, "sqlite:"+path, []string{dirA}, false); err != nil {
			t.Fatalf("reconcile: %v\n%s", err, out.String())
		}
		return out.String()
	}
	// Before B settles, none of A's records can be told: the ones the copy
	// held are B's to bill (a review: they were listed to bill by hand,
	// then B billed them too).
	if got := reconcile(); strings.Contains(got, "BILL THEM BY HAND") || !strings.Contains(got, "charges this cannot tell yet") ||
		!strings.Contains(got, "has settled only to seq 0") {
		t.Fatalf("reconcile before the other process settled:\n%s", got)
	}
	if _, err := sB.SettleOnce(ctx); err != nil {
		t.Fatalf("B's settle: %v", err)
	}

	got := reconcile()
	billed := got[strings.Index(got, "charges the ledger billed already"):]
	toBill := billed[strings.Index(billed, "BILL THEM BY HAND (2)"):]
	billed = billed[:len(billed)-len(toBill)]
	for _, want := range []string{"another process had started as it", "do not start a node on this dir again, nor run quotad revoke --node q1"} {
		if !strings.Contains(got, want) {
			t.Errorf("reconcile does not say %q:\n%s", want, got)
		}
	}
	for i := range 3 {
		if id := fmt.Sprintf(`event "orig-%d"`, i); !strings.Contains(billed, id) || strings.Contains(toBill, id) {
			t.Errorf("%s is not listed as billed alone:\n%s", id, got)
		}
	}
	for i := range 2 {
		if id := fmt.Sprintf(`event "a-%d"`, i); !strings.Contains(toBill, id) || strings.Contains(billed, id) {
			t.Errorf("%s is not listed to bill by hand alone:\n%s", id, got)
		}
	}
}
