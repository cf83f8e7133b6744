package wal_test

import (
	"context"
	"fmt"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/quotaring/quotaring/wal"
)

// Example_settle appends two records, waits until they are durable, ships
// them, and settles them with a checkpoint.
func Example_settle() {
	l, err := wal.Open(wal.Options{Dir: "data", NodeID: "node-1", FS: vfs.NewMem()})
	if err != nil {
		panic(err)
	}
	defer l.Close()

	for _, charge := range []string{"acct-1 +5", "acct-1 +2"} {
		seq, err := l.Append([]byte(charge))
		if err != nil {
			panic(err)
		}
		if err := l.WaitDurable(context.Background(), seq); err != nil {
			panic(err) // not durable: do not acknowledge
		}
		fmt.Println("acknowledged", seq)
	}

	upto := l.DurableSeq()
	err = l.Scan(l.SettledSeq(), upto, func(seq uint64, payload []byte) error {
		fmt.Printf("ship %d %q\n", seq, payload)
		return nil
	})
	if err != nil {
		panic(err)
	}
	cp := wal.Checkpoint{Account: "acct-1", Seq: upto, Data: []byte("used=7")}
	if err := l.Settle(upto, []wal.Checkpoint{cp}); err != nil {
		panic(err)
	}
	fmt.Printf("%+v\n", l.Stats().Records)
	// Output:
	// acknowledged 1
	// acknowledged 2
	// ship 1 "acct-1 +5"
	// ship 2 "acct-1 +2"
	// 0
}
