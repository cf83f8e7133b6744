-- 0010_node_build: which build of quotad each (node, incarnation) last
-- registered with (internal/buildinfo's short form: "v1.2.3",
-- "devel@c11a88a69da2+dirty"), and the newest ledger schema that build
-- knows. Both NULL for rows an older quotad wrote. An operator reads them
-- in a rolling upgrade (quotad admin nodes); quotad prune refuses while a
-- node heard from lately runs a build that predates the event log's
-- retention rules (schema_known below 8).
ALTER TABLE nodes ADD COLUMN build text;
ALTER TABLE nodes ADD COLUMN schema_known integer;
