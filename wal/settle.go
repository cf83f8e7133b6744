package wal

import (
	"bytes"
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
	// IDs are kept apart from Data, one key each, so that a checkpoint
	// writes only those that changed: an account may remember a hundred
	// thousand. Writing, each is put (Value set) or deleted (Value nil),
	// after all of the account's stored ids are dropped when ResetIDs.
	// Reading (Checkpoints), they are every id stored for the account, and
	// IDsStale says that they were written with another checkpoint than
	// this one (by a build that kept ids inline, since): the caller should
	// ignore them and write them all again (ResetIDs).
	IDs      []CheckpointID
	ResetIDs bool
	IDsStale bool
	// IDsOnly writes only the ids (with ResetIDs: drops them all), and
	// leaves the stored checkpoint and its mark as they are: for an
	// account let go whose state did not change since it was stored.
	IDsOnly bool
}

// CheckpointID is one id of a checkpoint's account (see Checkpoint.IDs);
// Kind is the caller's, any byte but 0.
type CheckpointID struct {
	Kind  byte
	ID    string
	Value []byte
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
// seq (8 bytes, big-endian) followed by Data; its ids go under the
// account's ids prefix, with the mark (kind 0) set to seq: reading, ids
// under another mark were not written with the checkpoint stored.
func putCheckpoints(b *pebble.Batch, cps []Checkpoint) error {
	for _, cp := range cps {
		if cp.Account == "" {
			return errors.New("wal: checkpoint with an empty account")
		}
		if !cp.IDsOnly {
			body := append(encodeU64(cp.Seq), cp.Data...)
			if err := b.Set(prefixKey(prefixCheckpoint, cp.Account), encodeFrame(body), nil); err != nil {
				return err
			}
		}
		if cp.ResetIDs {
			// NB: a batch applies in order; the sets below outlive this range.
			p := idsPrefix(cp.Account)
			if err := b.DeleteRange(p, keyAfterPrefix(p), nil); err != nil {
				return err
			}
		}
		if !cp.IDsOnly {
			if err := b.Set(idKey(cp.Account, idsMarkKind, ""), encodeFrame(encodeU64(cp.Seq)), nil); err != nil {
				return err
			}
		}
		for _, id := range cp.IDs {
			if id.Kind == idsMarkKind {
				return fmt.Errorf("wal: checkpoint of %q has an id of kind 0, which is the mark's", cp.Account)
			}
			k := idKey(cp.Account, id.Kind, id.ID)
			var err error
			if id.Value == nil {
				err = b.Delete(k, nil)
			} else {
				err = b.Set(k, encodeFrame(id.Value), nil)
			}
			if err != nil {
				return err
			}
		}
	}
	return nil
}

// Checkpoints calls fn for each stored checkpoint, in account order. cp.Data
// is a copy that fn may keep. fn must not call Close. The checkpoints and
// their ids are read from one Pebble snapshot, so that a PutCheckpoints
// meanwhile never pairs one account's state with another commit's ids.
func (l *Log) Checkpoints(fn func(cp Checkpoint) error) error {
	if err := l.acquire(); err != nil {
		return err
	}
	defer l.release()
	snap := l.db.NewSnapshot()
	defer snap.Close()
	it, err := snap.NewIter(&pebble.IterOptions{
		LowerBound: []byte{prefixCheckpoint},
		UpperBound: prefixEnd(prefixCheckpoint),
	})
	if err != nil {
		return l.pebbleError("read checkpoints", err)
	}
	ids, err := snap.NewIter(&pebble.IterOptions{
		LowerBound: []byte{prefixIDs},
		UpperBound: prefixEnd(prefixIDs),
	})
	if err != nil {
		return closeAfter(l.pebbleError("read checkpoints", err), it)
	}
	err = l.eachCheckpoint(it, ids, fn)
	return closeAfter(closeAfter(err, ids), it)
}

func (l *Log) eachCheckpoint(it, ids *pebble.Iterator, fn func(cp Checkpoint) error) error {
	for valid := it.First(); valid; valid = it.Next() {
		account := string(it.Key()[1:])
		cp, err := l.decodeCheckpoint(account, it)
		if err != nil {
			return err
		}
		if err := l.readIDs(ids, &cp); err != nil {
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

// readIDs fills cp.IDs with the ids stored for its account, and
// cp.IDsStale when they were not written with cp (their mark is another
// seq, or missing while there are ids).
func (l *Log) readIDs(it *pebble.Iterator, cp *Checkpoint) error {
	p := idsPrefix(cp.Account)
	mark, marked := uint64(0), false
	for valid := it.SeekGE(p); valid && bytes.HasPrefix(it.Key(), p); valid = it.Next() {
		rest := it.Key()[len(p):]
		what := fmt.Sprintf("stored id %q of account %q", rest, cp.Account)
		if len(rest) == 0 {
			return corruptKey(l.opts.Dir, what, errors.New("no kind"))
		}
		v, err := it.ValueAndErr()
		if err != nil {
			return l.pebbleError("read "+what, err)
		}
		body, err := decodeFrame(v)
		if err != nil {
			return corruptKey(l.opts.Dir, what, err)
		}
		if rest[0] == idsMarkKind {
			if mark, err = decodeU64(body); err != nil {
				return corruptKey(l.opts.Dir, what, err)
			}
			marked = true
			continue
		}
		cp.IDs = append(cp.IDs, CheckpointID{Kind: rest[0], ID: string(rest[1:]), Value: append([]byte(nil), body...)})
	}
	if err := it.Error(); err != nil {
		return l.pebbleError("read the ids of "+cp.Account, err)
	}
	if (marked && mark != cp.Seq) || (!marked && len(cp.IDs) > 0) {
		cp.IDs, cp.IDsStale = nil, true
	}
	return nil
}
