-- 0011_release_once: which hand-back (Release) last applied to each
-- reservation row: the releasing node's incarnation and the log record (seq)
-- that zeroed its allowance. A hand-back is retried when its answer is
-- lost; applied again it took units off the row that backed the node's
-- spent, unsettled charges, and another node could reserve them (G1). A
-- release whose key applied already is skipped. '' and 0 until a release
-- with a key; a node on an older build releases without one, as before.
ALTER TABLE reservations ADD COLUMN released_inc TEXT NOT NULL DEFAULT '';
ALTER TABLE reservations ADD COLUMN released_seq INTEGER NOT NULL DEFAULT 0;
