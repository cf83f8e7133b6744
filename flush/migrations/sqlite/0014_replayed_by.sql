-- 0014_replayed_by: replays by node (see flush/replay.go), a JSON array of
-- node ids, one entry per replay counted in replays: a take-back counts off
-- a replay of the node that answered it, and waits in replay_takebacks when
-- that node's replay has not settled yet. Counted on one number, a take-back
-- of a replay not settled yet counted off another node's, which had; that
-- node's own take-back then waited for ever and the late replay billed the
-- refunded event again. replays stays the count; rows of older builds have
-- no names: their replays stay unnamed, and any take-back counts them off.
ALTER TABLE events ADD COLUMN replayed_by TEXT NOT NULL DEFAULT '[]';
