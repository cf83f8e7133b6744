package wal

import (
	"errors"
	"fmt"

	"github.com/cockroachdb/pebble/v2"
)

// Checkpoint is the state of one account as of the record Seq. Its Data is
// opaque to wal.
type Checkpoint struct {
	Account string
	Seq     uint64
	Data    []byte
}

// Settle records that the records through upto reached the ledger. In one
// synced batch it writes the checkpoints cps, the settled mark upto, and one
// DeleteRange of the records (.., upto]. upto must be in
// [SettledSeq(), DurableSeq()]; upto == SettledSeq() only writes cps.
func (l *Log) Settle(upto uint64, cps []Checkpoint) error {
	// NB: registered for the whole call, not only its write: the chunk
	// lookup reads Pebble and the mark sync uses the mark file, both of
	// which Close closes (a Settle racing Close panicked in Pebble).
	if err := l.acquire(); err != nil {
		return err
	}
	defer l.release()
	l.settleMu.Lock()
	defer l.settleMu.Unlock()
	settled, durable := l.SettledSeq(), l.DurableSeq()
	if upto < settled || upto > durable {
		return fmt.Errorf("wal: settle to %d out of range [settled %d, durable %d] in %s",
			upto, settled, durable, l.opts.Dir)
	}
	if upto == settled && len(cps) == 0 {
		return nil
	}
	// Records live in chunks: delete the chunks that end at or before upto;
	// a chunk that straddles upto stays, and scans skip its settled part.
	end := recordKeyAfter(upto)
	if upto > settled {
		first, last, err := l.lastOfChunkAt(upto)
		if err != nil {
			return fmt.Errorf("wal: settle to %d in %s: %w", upto, l.opts.Dir, err)
		}
		if last > upto {
			end = recordKey(first)
		}
	}
	err := l.write(func(b *pebble.Batch) error {
		if err := putCheckpoints(b, cps); err != nil {
			return err
		}
		if upto == settled {
			return nil
		}
		if err := b.Set(prefixKey(prefixMeta, metaSettledSeq), encodeFrame(encodeU64(upto)), nil); err != nil {
			return err
		}
		return b.DeleteRange(recordKey(0), end, nil)
	})
	if err != nil {
		return err
	}
	l.settledSeq.Store(upto)
	l.marks.settle(upto)
	// Make the durable mark survive a power loss too, once per settle.
	if err := l.mark.sync(); err != nil {
		l.log.Warn("cannot sync the durable mark", "file", l.mark.path, "err", err)
	}
	return nil
}

// PutCheckpoints stores cps in one synced batch, replacing earlier
// checkpoints of the same accounts.
func (l *Log) PutCheckpoints(cps []Checkpoint) error {
	if len(cps) == 0 {
		return nil
	}
	return l.write(func(b *pebble.Batch) error { return putCheckpoints(b, cps) })
}

// putCheckpoints adds cps to b. A checkpoint's value is the frame of
// seq (8 bytes, big-endian) followed by Data.
func putCheckpoints(b *pebble.Batch, cps []Checkpoint) error {
	for _, cp := range cps {
		if cp.Account == "" {
			return errors.New("wal: checkpoint with an empty account")
		}
		body := append(encodeU64(cp.Seq), cp.Data...)
		if err := b.Set(prefixKey(prefixCheckpoint, cp.Account), encodeFrame(body), nil); err != nil {
			return err
		}
	}
	return nil
}

// Checkpoints calls fn for each stored checkpoint, in account order. cp.Data
// is a copy that fn may keep. fn must not call Close.
func (l *Log) Checkpoints(fn func(cp Checkpoint) error) error {
	if err := l.acquire(); err != nil {
		return err
	}
	defer l.release()
	it, err := l.db.NewIter(&pebble.IterOptions{
		LowerBound: []byte{prefixCheckpoint},
		UpperBound: prefixEnd(prefixCheckpoint),
	})
	if err != nil {
		return l.pebbleError("read checkpoints", err)
	}
	err = l.eachCheckpoint(it, fn)
	return closeAfter(err, it)
}

func (l *Log) eachCheckpoint(it *pebble.Iterator, fn func(cp Checkpoint) error) error {
	for valid := it.First(); valid; valid = it.Next() {
		account := string(it.Key()[1:])
		cp, err := l.decodeCheckpoint(account, it)
		if err != nil {
			return err
		}
		if err := fn(cp); err != nil {
			return err
		}
	}
	if err := it.Error(); err != nil {
		return l.pebbleError("read checkpoints", err)
	}
	return nil
}

func (l *Log) decodeCheckpoint(account string, it *pebble.Iterator) (Checkpoint, error) {
	what := fmt.Sprintf("checkpoint of account %q", account)
	v, err := it.ValueAndErr()
	if err != nil {
		return Checkpoint{}, l.pebbleError("read "+what, err)
	}
	body, err := decodeFrame(v)
	if err == nil && len(body) < 8 {
		err = errors.New("body shorter than its seq")
	}
	if err != nil {
		return Checkpoint{}, corruptKey(l.opts.Dir, what, err)
	}
	seq, _ := decodeU64(body[:8])
	return Checkpoint{Account: account, Seq: seq, Data: append([]byte(nil), body[8:]...)}, nil
}
