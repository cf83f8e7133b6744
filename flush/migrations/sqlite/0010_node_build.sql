-- 0010_node_build: what each (node, incarnation) last started as. build is
-- the quotad build (internal/buildinfo's short form: "v1.2.3",
-- "devel@c11a88a69da2+dirty") and schema_known the newest ledger schema it
-- knows: an operator reads them in a rolling upgrade (quotad admin nodes),
-- and quotad prune refuses while a node heard from lately runs a build
-- that predates the event log's retention rules (schema_known below 8).
-- process is a random name of the process and registered_at when it
-- registered: of two processes running as one node id, the one that
-- registered first finds a later process's name and stops. All NULL for
-- rows an older quotad wrote.
ALTER TABLE nodes ADD COLUMN build TEXT;
ALTER TABLE nodes ADD COLUMN schema_known INTEGER;
ALTER TABLE nodes ADD COLUMN process TEXT;
ALTER TABLE nodes ADD COLUMN registered_at INTEGER;
