package flush

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// A data dir older than the ledger.
//
// A data dir restored from a copy (a disk snapshot, a backup) holds the
// records it had when the copy was made. Started while the ledger is out of
// reach, the node serves from it, and its new charges take the sequence
// numbers that follow: numbers the original dir used for other charges and
// the ledger settled. When the ledger answers, its settled mark of the
// incarnation is beyond what the log held when it opened (catchUp). From
// then on the dir can never settle: its new records sit under numbers the
// ledger has settled for others.
//
// Which of its records the ledger billed is known only at that moment: the
// records the dir held when it opened (up to Vouched) are the original
// dir's, settled from there; the later ones are charges taken since, which
// no ledger holds. So the settler writes that boundary into the data dir
// (StaleDir, under the meta name staleDirMeta) before it reports the
// conflict; quotad reconcile --data-dir reads it to tell the records already
// billed from those to bill by hand, and a node refuses to start on the dir
// again (a restart would vouch for every record it holds, and mark the
// charges it took under reused numbers as settled).

// staleDirMeta is the meta name of the StaleDir note in a data dir.
const staleDirMeta = "flush.stale_dir"

// StaleDir is what a node records in its data dir when the ledger showed the
// dir to be older than the ledger.
type StaleDir struct {
	Node        string `json:"node"`
	Incarnation string `json:"incarnation"`
	// LedgerMark is the ledger's settled mark of (Node, Incarnation) when
	// the conflict was found.
	LedgerMark uint64 `json:"ledger_mark"`
	// Billed is the last record that the dir held when it opened (or that
	// its process sent to be settled): records up to it are the original
	// dir's, which the ledger settled (LedgerMark is beyond it). Records
	// after it were taken since, under numbers the ledger settled for other
	// charges, and are in no ledger.
	Billed uint64 `json:"billed_through"`
	// Durable is the log's durable end when the conflict was found.
	Durable uint64 `json:"durable"`
	// Found is when the conflict was found (this node's clock).
	Found time.Time `json:"found"`
	// OtherProcess says the ledger refused this dir's settles because a
	// later process started as its node and incarnation, on a copy of the
	// dir (ErrOtherProcess). Billed is then this dir's own settled mark:
	// of the records after it, those the two dirs held in common when the
	// copy was made are the other process's to settle, and one sent in a
	// settle whose answer never came may be billed; which, only the
	// ledger's event log tells (the event at the same incarnation and seq).
	OtherProcess bool `json:"other_process,omitempty"`
}

// metaStore is the part of a data dir's log that keeps meta values.
type metaStore interface {
	GetMeta(name string) ([]byte, bool, error)
	PutMeta(name string, v []byte) error
}

// metaReader is the part of a data dir's log that reads meta values (a
// read-only open has it).
type metaReader interface {
	GetMeta(name string) ([]byte, bool, error)
}

// ReadStaleDir returns the StaleDir note of a data dir's log, if a node
// recorded one.
func ReadStaleDir(l metaReader) (StaleDir, bool, error) {
	v, ok, err := l.GetMeta(staleDirMeta)
	if err != nil || !ok {
		return StaleDir{}, false, err
	}
	var sd StaleDir
	if err := json.Unmarshal(v, &sd); err != nil {
		return StaleDir{}, false, fmt.Errorf("flush: the data dir's note that it is older than the ledger (meta %s) does not read: %w", staleDirMeta, err)
	}
	return sd, true, nil
}

// recordStaleDir writes sd into the data dir, unless a note is there
// already: the first one was written when fewer records could be vouched
// for, and its boundary stands.
func recordStaleDir(l metaStore, sd StaleDir) error {
	if _, ok, err := ReadStaleDir(l); err != nil || ok {
		return err
	}
	v, err := json.Marshal(sd)
	if err != nil {
		return err
	}
	return l.PutMeta(staleDirMeta, v)
}

// ErrStaleDataDir marks a data dir that a node found to be older than the
// ledger (StaleDir). It comes wrapped with ErrMarkConflict.
var ErrStaleDataDir = errors.New("this data dir is older than the ledger")

// StaleDirError is the refusal to start a node on a data dir with a StaleDir
// note.
func StaleDirError(dir string, sd StaleDir) error {
	if sd.OtherProcess {
		return fmt.Errorf("%w: %w: on %s, node %s (incarnation %s) found that another process had started as it on a copy of this data dir, and the ledger refused this one's settles: "+
			"records after %d can never settle from this dir. List them with quotad reconcile --data-dir %s: those the ledger's event log holds (the same event at the same seq) are billed, "+
			"those the other process settled other charges in place of are to bill by hand, and it says which it cannot tell yet (the other process has not settled that far). Do not start a node on this dir again, nor run quotad revoke for %s while the other process runs as it; give each process a --node-id and data dir of its own",
			ErrMarkConflict, ErrStaleDataDir, sd.Found.UTC().Format(time.RFC3339), sd.Node, sd.Incarnation, sd.Billed, dir, sd.Node)
	}
	return fmt.Errorf("%w: %w: on %s, node %s (incarnation %s) found the ledger settled to %d while this log held records only to %d when it opened: "+
		"records after %d are charges taken under sequence numbers the ledger settled for others, and this dir can never settle them. "+
		"List what to bill with quotad reconcile --data-dir %s (it tells the records the ledger billed already from those to bill by hand), "+
		"then run quotad revoke --node %s and start the node with an empty data dir; keep this one until the charges are billed (README: the ledger)",
		ErrMarkConflict, ErrStaleDataDir, sd.Found.UTC().Format(time.RFC3339), sd.Node, sd.Incarnation, sd.LedgerMark, sd.Billed, sd.Billed, dir, sd.Node)
}
