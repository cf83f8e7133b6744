-- 0015_takeback_names: the replays taken back, by name (see flush/replay.go):
-- the node that answered a replay and the seq of its record there. A
-- take-back whose name is here already counts nothing: it is the same
-- take-back asked again (the HTTP front retries one whose answer was lost),
-- logged by another owner after the account moved. Counted twice, it
-- released an attempt's pending refund while another replay may have been
-- served. Take-backs of older builds have no name and are not kept here.
-- Pruned with the charge's month.
CREATE TABLE takeback_names (
    account_id TEXT    NOT NULL,
    event_id   TEXT    NOT NULL,
    period     TEXT    NOT NULL,  -- the charge's month, "2026-06"
    node_id    TEXT    NOT NULL,  -- the node that answered the replay
    replay_seq INTEGER NOT NULL,  -- the seq of the replay's record there
    PRIMARY KEY (account_id, event_id, period, node_id, replay_seq)
);
