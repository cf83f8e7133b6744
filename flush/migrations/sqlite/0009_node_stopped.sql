-- 0009_node_stopped: when a node's incarnation stopped cleanly with nothing
-- unsettled in its log (its final settle done). A month it was heard from
-- in is then final without waiting for it to come back (billing, quotad
-- prune). NULL while it runs, after a crash, or after an unclean stop;
-- cleared when it registers or settles again.
ALTER TABLE nodes ADD COLUMN stopped_at INTEGER;
